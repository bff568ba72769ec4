"""The job specs under examples/ parse, and what each platform injects for them (per its documented
contract, see the platform modules) resolves to the cluster the spec describes."""

from __future__ import annotations

import json
import os

import yaml
from conftest import REPO, resolve_cluster

from launcher.options import parse_invocation

EXAMPLES = os.path.join(REPO, "examples")
OPTIONS = parse_invocation(["train.py"], {}).options


def load(name):
    with open(os.path.join(EXAMPLES, name)) as fh:
        return yaml.safe_load(fh)  # JSON is YAML too


def resolve_all(envs, tmp_path):
    clusters = [resolve_cluster(env, OPTIONS, str(tmp_path)) for env in envs]
    assert sorted(c.node_rank for c in clusters) == list(range(len(envs)))
    assert len({(c.platform, c.nnodes, c.master_addr, c.master_port, c.nproc_per_node) for c in clusters}) == 1
    return clusters[0]


def pytorchjob_envs(job):
    """training-operator v1 envvar.go/master.go: the variables of every pod of a PyTorchJob."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    name = job["metadata"]["name"]
    port = next(p["containerPort"] for p in specs["Master"]["template"]["spec"]["containers"][0]["ports"]
                if p["name"] == "pytorchjob-port")
    pods = specs["Master"]["replicas"] + specs["Worker"]["replicas"]
    nproc = job["spec"].get("nprocPerNode")
    envs = []
    for rank in range(pods):
        env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": f"{name}-master-0", "MASTER_PORT": str(port),
               "WORLD_SIZE": str(pods * int(nproc) if nproc and nproc.isdigit() else pods), "RANK": str(rank)}
        if nproc:
            env.update({"PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(rank), "PET_NNODES": str(pods)})
        envs.append(env)
    return envs


def test_pytorchjob_one_process_per_pod(tmp_path):
    job = load("pytorchjob-per-pod.yaml")
    assert job["kind"] == "PyTorchJob"
    c = resolve_all(pytorchjob_envs(job), tmp_path)
    assert (c.platform, c.nnodes, c.master_addr, c.master_port, c.nproc_per_node) == \
        ("kubeflow", 2, "ddp-digits-master-0", 23456, 1)


def test_pytorchjob_nproc_per_node(tmp_path):
    c = resolve_all(pytorchjob_envs(load("pytorchjob-nproc-per-node.yaml")), tmp_path)
    assert (c.platform, c.nnodes, c.master_addr, c.nproc_per_node) == ("kubeflow", 4, "ddp-resnet-master-0", 2)


def trainjob_envs(job):
    """Kubeflow Trainer v2's torch runtime: the PET_* variables of every node."""
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    return [{"KUBERNETES_SERVICE_HOST": "10.96.0.1", "PET_NNODES": str(trainer["numNodes"]),
             "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]), "PET_NODE_RANK": str(i),
             "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500"}
            for i in range(trainer["numNodes"])]


def test_trainjob(tmp_path):
    job = load("trainjob.yaml")
    (tmp_path / "nvidia0").touch()  # resourcesPerNode asks for one GPU: "auto" finds it
    c = resolve_all(trainjob_envs(job), tmp_path)
    assert (c.platform, c.nnodes, c.master_addr, c.master_port, c.nproc_per_node) == \
        ("kubeflow-v2", 2, "ddp-cifar-node-0-0.ddp-cifar", 29500, 1)


def oci_group():
    return load("oci-job-run.json")["jobNodeConfigurationDetails"]["jobNodeGroupConfigurationDetailsList"][0]


def oci_envs(group, tmp_path):
    """OCI's variables on every node of the group, and the nodes' metadata file (written in ``tmp_path``)."""
    count = group["replicas"]
    meta = tmp_path / "nodes.json"
    meta.write_text(json.dumps([{"Rank": str(i), "IPAddress": f"10.0.1.{i + 5}"} for i in range(count)]))
    return [{**group["jobConfigurationDetails"]["environmentVariables"], "JOB_RUN_OCID": "ocid1.datasciencejobrun.x",
             "NODE_RANK": str(i), "NODE_COUNT": str(count), "CLUSTER_NODES_METADATA_FILE": str(meta)}
            for i in range(count)]


def test_oci_multi_node_job_run(tmp_path):
    c = resolve_all(oci_envs(oci_group(), tmp_path), tmp_path)
    assert (c.platform, c.nnodes, c.master_addr, c.master_port) == ("oci", 2, "10.0.1.5", 29400)


def vertex_envs(pools):
    """Vertex's CLUSTER_SPEC in every replica of every pool, in pool order."""
    cluster = {f"workerpool{p}": [f"cmle-training-workerpool{p}-ab-{i}:2222" for i in range(spec["replicaCount"])]
               for p, spec in enumerate(pools)}
    return [{"CLUSTER_SPEC": json.dumps({"cluster": cluster, "environment": "cloud",
                                         "task": {"type": pool, "index": i}})}
            for pool, hosts in cluster.items() for i in range(len(hosts))]


def test_vertex_worker_pools(tmp_path):
    pools = load("vertex-worker-pools.json")["jobSpec"]["workerPoolSpecs"]
    c = resolve_all(vertex_envs(pools), tmp_path)
    assert (c.platform, c.nnodes, c.master_addr, c.master_port) == ("vertex", 3, "cmle-training-workerpool0-ab-0",
                                                                     2222)
    assert all(spec["pythonPackageSpec"]["pythonModule"] == "launcher" for spec in pools)


def test_docker_compose(tmp_path):
    services = load("docker-compose.yaml")["services"]
    c = resolve_all([svc["environment"] for svc in services.values()], tmp_path)
    assert (c.platform, c.nnodes, c.master_addr, c.master_port) == ("env", 2, "node0", 29500)
    assert all("ddp-launcher.pyz" in " ".join(svc["command"]) for svc in services.values())


def test_every_platform_in_a_kubernetes_pod_writes_the_termination_message(tmp_path, monkeypatch):
    """The JobSet example runs ``--platform env`` and promises the termination message: any platform in a
    pod (KUBERNETES_SERVICE_HOST) writes it where the kubelet reads it, when the kubelet gave one."""
    from launcher import platforms
    from launcher.platforms import base

    log = tmp_path / "termination-log"
    monkeypatch.setattr(base, "TERMINATION_LOG", str(log))
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    chosen = platforms.choose({**pod, "MASTER_ADDR": "a", "MASTER_PORT": "1", "NNODES": "2", "NODE_RANK": "0"})
    assert chosen.platform is platforms.PLATFORMS["env"]
    assert chosen.platform.report_path(pod) is None  # no termination log (outside a pod, or not writable)
    log.touch()
    assert chosen.platform.report_path(pod) == str(log)
    assert chosen.platform.report_path({}) is None  # not in a pod: a file of that name is not Kubernetes'
