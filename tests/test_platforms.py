"""Kubeflow (v1, v2), Vertex AI, OCI Data Science and torchrun-style hosts: from each platform's own
variables to the cluster, the dry run, malformed inputs, Lightning's reading. Their real 2-host x 2-process
jobs are tests/test_simulate_platforms.py::test_two_hosts_two_processes (the hosts' variables as simulate's
builders write them, checked against each platform's list there)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest
from conftest import PYTHON, REPO, launcher_env, resolve_cluster

from launcher import cli, platforms, preflight
from launcher.errors import ConfigError
from launcher.options import parse_invocation
from launcher.platforms import kubeflow

WORKER = os.path.join(REPO, "tests", "scripts", "launcher_worker.py")
K8S = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}


def options(*args):
    return parse_invocation([*args, "train.py"], {}).options


# Each builder gives node i of n exactly what the platform injects (sources cited in each module),
# and the host name node i has: rank 0's host must be the master.
def kubeflow_per_pod(i, n, tmp):
    pod = "job-master-0" if i == 0 else f"job-worker-{i - 1}"
    return {**K8S, "HOSTNAME": pod, "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
            "WORLD_SIZE": str(n), "RANK": str(i), "PYTHONUNBUFFERED": "0"}, pod


def kubeflow_nproc(i, n, tmp):
    env, pod = kubeflow_per_pod(i, n, tmp)
    env.update({"WORLD_SIZE": str(2 * n), "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(i), "PET_NNODES": str(n)})
    return env, pod


def kubeflow_elastic(i, n, tmp):
    pod = f"job-worker-{i}"
    return {**K8S, "HOSTNAME": pod, "PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_RDZV_BACKEND": "c10d",
            "PET_NNODES": f"{n}:{n}", "PET_NPROC_PER_NODE": "1", "PET_MAX_RESTARTS": "3"}, pod


def kubeflow_v2(i, n, tmp):
    pod = f"tj-node-0-{i}"
    return {**K8S, "HOSTNAME": pod, "JOB_COMPLETION_INDEX": str(i), "PET_NNODES": str(n),
            "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": "tj-node-0-0.tj",
            "PET_MASTER_PORT": "29500"}, pod


def vertex_spec(i, n):
    task = {"type": "workerpool0", "index": 0} if i == 0 else {"type": "workerpool1", "index": i - 1}
    return json.dumps({"cluster": {"workerpool0": ["cmle-wp0-0:2222"],
                                   "workerpool1": [f"cmle-wp1-{k}:2222" for k in range(n - 1)]},
                       "environment": "cloud", "task": task, "job": "{}"})


def vertex(i, n, tmp):
    return {"CLUSTER_SPEC": vertex_spec(i, n), "MASTER_ADDR": "cmle-wp0-0", "WORLD_SIZE": str(n)}, \
        "cmle-wp0-0" if i == 0 else f"cmle-wp1-{i - 1}"


def oci(i, n, tmp):
    path = tmp / "nodes.json"
    path.write_text(json.dumps([{"Rank": str(k), "IPAddress": f"10.0.0.{10 + k}"} for k in reversed(range(n))]))
    return {"JOB_RUN_OCID": f"ocid1.datasciencejobrun.{i}", "NODE_RANK": str(i), "NODE_COUNT": str(n),
            "CLUSTER_NODES_METADATA_FILE": str(path)}, f"10.0.0.{10 + i}"


def plain(i, n, tmp):
    return {"MASTER_ADDR": "node0", "MASTER_PORT": "29501", "NNODES": str(n), "NODE_RANK": str(i)}, f"node{i}"


def plain_pet(i, n, tmp):
    return {"PET_MASTER_ADDR": "node0", "PET_MASTER_PORT": "29501", "PET_NNODES": str(n),
            "PET_NODE_RANK": str(i), "PET_NPROC_PER_NODE": "1"}, f"node{i}"


BUILDERS = {"kubeflow": [kubeflow_per_pod, kubeflow_nproc, kubeflow_elastic], "kubeflow-v2": [kubeflow_v2],
            "vertex": [vertex], "oci": [oci], "env": [plain, plain_pet]}
CASES = [(name, b) for name, bs in BUILDERS.items() for b in bs]


@pytest.mark.parametrize("nnodes", [1, 2, 5])
@pytest.mark.parametrize(("name", "build"), CASES, ids=[b.__name__ for _, b in CASES])
def test_round_trip_over_every_host(tmp_path, name, build, nnodes):
    seen = []
    for i in range(nnodes):
        environ, host = build(i, nnodes, tmp_path)
        assert platforms.choose(environ).platform.name == name
        cluster = resolve_cluster(environ, options(), dev_dir=str(tmp_path))
        seen.append((cluster, host))
    assert sorted(c.node_rank for c, _ in seen) == list(range(nnodes))
    assert {(c.nnodes, c.master_addr, c.master_port) for c, _ in seen} == {seen[0][0][1:2] + seen[0][0][5:7]}
    master = seen[0][0].master_addr
    if nnodes > 1:
        rank0_host = next(h for c, h in seen if c.node_rank == 0)
        assert rank0_host in (master, master.split(".")[0])  # global rank 0 is on the master's host
        assert all(c.master_port for c, _ in seen)


def test_nproc_words_follow_torchrun(tmp_path):
    environ, _ = kubeflow_v2(0, 2, tmp_path)
    for word, expected in (("3", 3), ("cpu", len(os.sched_getaffinity(0))), ("auto", len(os.sched_getaffinity(0)))):
        cluster = resolve_cluster({**environ, "PET_NPROC_PER_NODE": word}, options(), str(tmp_path))
        assert cluster.nproc_per_node == expected
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidia1").touch()
    for word in ("auto", "gpu"):
        assert resolve_cluster({**environ, "PET_NPROC_PER_NODE": word}, options(),
                                         str(tmp_path)).nproc_per_node == 2
    assert resolve_cluster({**environ, "PET_NPROC_PER_NODE": "auto"}, options("--nproc-per-node", "4"),
                                     str(tmp_path)).nproc_per_node == 4


BAD = [
    ("kubeflow", {**K8S, "MASTER_ADDR": "m", "WORLD_SIZE": "2", "RANK": "2"}, "RANK=2"),
    ("kubeflow", {**K8S, "MASTER_ADDR": "m", "WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE"),
    ("kubeflow", {**K8S, "MASTER_ADDR": "m", "WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "99999"}, "MASTER_PORT"),
    ("kubeflow", {**K8S, "MASTER_ADDR": "m", "WORLD_SIZE": "4", "RANK": "1", "PET_NODE_RANK": "0",
                  "PET_NNODES": "2"}, "RANK=1 and PET_NODE_RANK=0"),
    ("kubeflow", {**K8S, "MASTER_ADDR": "m", "WORLD_SIZE": "4", "RANK": "1", "PET_NODE_RANK": "1",
                  "PET_NNODES": "2", "PET_NPROC_PER_NODE": "many"}, "PET_NPROC_PER_NODE"),
    ("kubeflow", {**K8S, "PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_NNODES": "1:4",
                  "HOSTNAME": "job-worker-1"}, "PET_NNODES=1:4"),
    ("kubeflow", {**K8S, "PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_NNODES": "2", "HOSTNAME": "laptop"},
     "HOSTNAME='laptop'"),
    ("kubeflow", {**K8S, "PET_RDZV_ENDPOINT": "etcd:2379", "PET_NNODES": "2", "HOSTNAME": "job-worker-1"},
     "PET_RDZV_ENDPOINT='etcd:2379'"),
    ("kubeflow", {**K8S, "PET_RDZV_ENDPOINT": "job-worker-0", "PET_NNODES": "2", "HOSTNAME": "job-worker-1"},
     "PET_RDZV_ENDPOINT"),
    ("kubeflow-v2", {**K8S, "PET_NNODES": "2", "PET_NODE_RANK": "5", "PET_MASTER_ADDR": "m"}, "PET_NODE_RANK=5"),
    ("kubeflow-v2", {**K8S, "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m",
                     "PET_NPROC_PER_NODE": "gpu"}, "PET_NPROC_PER_NODE=gpu"),
    ("vertex", {"CLUSTER_SPEC": "{not json"}, "CLUSTER_SPEC"),
    ("vertex", {"CLUSTER_SPEC": "[1, 2]"}, "CLUSTER_SPEC"),
    ("vertex", {"CLUSTER_SPEC": json.dumps({"cluster": {"workerpool0": []}, "task": {"type": "workerpool0",
                                                                                  "index": 0}})}, "workerpool0"),
    ("vertex", {"CLUSTER_SPEC": vertex_spec(1, 2).replace('"index": 0', '"index": 7')}, "task.index 7"),
    ("vertex", {"CLUSTER_SPEC": vertex_spec(1, 2).replace("workerpool1\", \"index", "workerpool2\", \"index")},
     "task.type 'workerpool2'"),
    ("vertex", {"CLUSTER_SPEC": vertex_spec(0, 2).replace("cmle-wp0-0:2222", "cmle-wp0-0")}, "HOST:PORT"),
    ("oci", {"OCI__MODE": "WORKER", "OCI__WORKER_COUNT": "2", "MAIN_JOB_RUN_OCID": "ocid1.x"}, "set MASTER_ADDR"),
    ("oci", {"JOB_RUN_OCID": "x", "NODE_COUNT": "2", "NODE_RANK": "2", "MASTER_ADDR": "m"}, "NODE_RANK=2"),
    ("env", {"MASTER_ADDR": "m", "RANK": "3", "WORLD_SIZE": "4"}, "RANK='3' without NODE_RANK is ambiguous"),
    ("env", {"MASTER_ADDR": "m", "NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2"),
    ("env", {"MASTER_ADDR": "m", "NNODES": "2", "NODE_RANK": "x"}, "NODE_RANK is not a whole number: 'x'"),
    ("env", {"NNODES": "2", "NODE_RANK": "1"}, "MASTER_ADDR is not set"),
    ("env", {"MASTER_ADDR": "m", "NODE_RANK": "1"}, "without NNODES"),
    ("env", {"MASTER_ADDR": "a", "PET_MASTER_ADDR": "b", "NNODES": "2", "NODE_RANK": "1"}, "disagree"),
]


@pytest.mark.parametrize(("name", "environ", "needle"), BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_malformed_input_is_one_line_naming_it(tmp_path, name, environ, needle):
    assert platforms.choose(environ).platform.name == name
    with pytest.raises(ConfigError) as err:
        resolve_cluster(environ, options(), dev_dir=str(tmp_path))
    assert needle in str(err.value) and "\n" not in str(err.value)


def oci_metadata(tmp_path, nodes, count):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(nodes))
    return {"JOB_RUN_OCID": "x", "NODE_COUNT": str(count), "NODE_RANK": "1", "CLUSTER_NODES_METADATA_FILE": str(path)}


@pytest.mark.parametrize(("nodes", "needle"), [
    ({"Rank": 0}, "expected a JSON list"),
    ([{"Rank": 0}], "without a whole-number Rank and an IPAddress"),
    ([{"Rank": 0, "IPAddress": "a"}, {"Rank": 0, "IPAddress": "b"}], "Rank 0 is listed twice"),
    ([{"Rank": 3, "IPAddress": "a"}], "Rank 3 is not a node of 2"),
])
def test_oci_metadata_of_the_wrong_shape(tmp_path, nodes, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        resolve_cluster(oci_metadata(tmp_path, nodes, 2), options(), dev_dir=str(tmp_path))
    assert "nodes.json" in str(err.value)


def test_oci_waits_for_the_node_list_to_fill_in(tmp_path):
    environ = oci_metadata(tmp_path, [{"Rank": "1", "IPAddress": "10.0.0.2"}], 2)
    path = environ["CLUSTER_NODES_METADATA_FILE"]

    def second_node_starts():
        time.sleep(1.0)
        with open(path, "w") as fh:
            fh.write('[{"Rank": "1", "IPAddress": "10.0.0.2"}, {"Rank"')  # half-written first
        time.sleep(0.6)
        with open(path, "w") as fh:
            json.dump([{"Rank": "1", "IPAddress": "10.0.0.2"}, {"Rank": "0", "IPAddress": "10.0.0.1"}], fh)

    writer = threading.Thread(target=second_node_starts)
    writer.start()
    start = time.monotonic()
    cluster = resolve_cluster(environ, options("--rdzv-timeout", "20"), dev_dir=str(tmp_path))
    writer.join()
    assert time.monotonic() - start >= 1.5
    assert (cluster.master_addr, cluster.local_addr, cluster.hosts) == ("10.0.0.1", "10.0.0.2",
                                                                         ("10.0.0.1", "10.0.0.2"))
    with pytest.raises(ConfigError, match="1 of 2 nodes listed.*dry run: not waiting"):
        resolve_cluster(oci_metadata(tmp_path, [{"Rank": 0, "IPAddress": "a"}], 2),
                                  options("--dry-run"), dev_dir=str(tmp_path))


def test_name_wait_is_bounded_and_reports_progress(tmp_path):
    lines: list[str] = []
    published = tmp_path / "dns"

    def resolver(name):  # a name service that learns the pod's name 1.2 s later
        return published.read_text() if published.exists() else None

    threading.Timer(1.2, published.write_text, args=("10.1.2.3",)).start()
    found = preflight.wait_for_names(["job-master-0", "sim"], {"sim": "127.0.0.1"}, 10, lines.append, resolver)
    assert found == {"job-master-0": "10.1.2.3", "sim": "127.0.0.1"}
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        preflight.wait_for_names(["job-master-0"], {}, 1.5, lines.append, lambda name: None)
    assert 1.5 <= time.monotonic() - start < 3
    assert "'job-master-0'" in str(err.value) and "after 2 s (limit 1.5 s)" in str(err.value)
    assert preflight.wait_for_names(["localhost"], {}, 5) == {"localhost": preflight.lookup("localhost")}
    assert preflight.lookup("localhost") in ("127.0.0.1", "::1")


def test_names_to_wait_for(tmp_path):
    environ, _ = kubeflow_v2(1, 2, tmp_path)
    cluster = resolve_cluster(environ, options(), str(tmp_path))
    assert kubeflow.PLATFORM_V2.names_to_wait_for(cluster) == ("tj-node-0-0.tj",)
    one = resolve_cluster(kubeflow_v2(0, 1, tmp_path)[0], options(), str(tmp_path))
    assert kubeflow.PLATFORM_V2.names_to_wait_for(one) == ()
    by_ip = resolve_cluster({**environ, "PET_MASTER_ADDR": "10.0.0.1"}, options(), str(tmp_path))
    assert kubeflow.PLATFORM_V2.names_to_wait_for(by_ip) == ()


def test_termination_log_only_when_writable(tmp_path):
    platform = kubeflow.KubeflowV1()
    platform.termination_log = str(tmp_path / "termination-log")
    assert platform.report_path({}) is None
    (tmp_path / "termination-log").touch()
    assert platform.report_path({}) == platform.termination_log
    assert (platform.report_limit, platform.grace_period) == (4096, 25.0)


@pytest.mark.parametrize(("name", "build"), CASES, ids=[b.__name__ for _, b in CASES])
def test_dry_run_names_platform_and_why(tmp_path, name, build):
    environ, _ = build(1, 2, tmp_path)
    text = cli.describe(cli.plan(["--dry-run", WORKER], environ, str(tmp_path / "run")), False)
    assert text.startswith(f"platform:  {name}: first in the detection order (")
    assert "node 1 of 2" in text and f"\nmatched:   {name}: " in text
    data = json.loads(cli.describe(cli.plan(["--dry-run", WORKER], environ, str(tmp_path / "run")), True))
    assert data["platform"] == name and name in data["matched"]
    assert not any(k.startswith("PET_") for k in cli.plan([WORKER], environ).launch.environment(environ))


def test_ambiguity_and_override_behave_as_the_dry_run_says(tmp_path):
    environ = {**kubeflow_per_pod(1, 2, tmp_path)[0], "CLUSTER_SPEC": vertex_spec(2, 3)}
    p = cli.plan([WORKER], environ, str(tmp_path))
    text = cli.describe(p, False)
    assert p.cluster.platform == "kubeflow" and "also matched: vertex, env" in text
    assert [name for name, _ in p.choice.matches] == ["kubeflow", "vertex", "env", "local"]
    override = cli.plan(["--platform", "vertex", WORKER], environ, str(tmp_path))
    assert (override.cluster.platform, override.cluster.node_rank, override.cluster.nnodes) == ("vertex", 2, 3)
    assert "named by --platform vertex" in cli.describe(override, False)
    by_env = cli.plan([WORKER], {**environ, "LAUNCHER_PLATFORM": "env", "NNODES": "2", "NODE_RANK": "1"})
    assert by_env.cluster.platform == "env"


def test_lightning_agrees_where_it_overlaps(tmp_path, monkeypatch):
    from lightning_fabric.plugins.environments import KubeflowEnvironment, TorchElasticEnvironment

    for i in range(3):
        environ, _ = kubeflow_per_pod(i, 3, tmp_path)
        cluster = resolve_cluster(environ, options(), str(tmp_path))
        for k, v in environ.items():
            monkeypatch.setenv(k, v)
        ours = (cluster.nnodes * cluster.nproc_per_node, cluster.node_rank, cluster.master_addr, cluster.master_port)
        kf = KubeflowEnvironment()
        assert ours == (kf.world_size(), kf.node_rank(), kf.main_address, kf.main_port)
    for i in range(2):  # torchrun-style hosts: Lightning reads MASTER_ADDR/MASTER_PORT as the main node
        environ, _ = plain(i, 2, tmp_path)
        cluster = resolve_cluster(environ, options(), str(tmp_path))
        for k, v in {**environ, "TORCHELASTIC_RUN_ID": "x"}.items():
            monkeypatch.setenv(k, v)
        te = TorchElasticEnvironment()
        assert TorchElasticEnvironment.detect()
        assert (te.main_address, te.main_port) == (cluster.master_addr, cluster.master_port)


def run_launcher(environ, args, timeout=30):
    return subprocess.run([PYTHON, "-m", "launcher", *args], env=launcher_env(**environ), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("case", ["vertex", "oci-never-complete"])
def test_bad_input_through_the_command_exits_2_and_starts_nothing(tmp_path, case):
    records = tmp_path / "records"
    records.mkdir()
    if case == "vertex":
        environ, needle = {"CLUSTER_SPEC": '{"cluster": {}, "task": 3}'}, "CLUSTER_SPEC"
    else:
        environ = oci_metadata(tmp_path, [{"Rank": 0, "IPAddress": "127.0.0.1"}], 2)
        environ["LAUNCHER_RDZV_TIMEOUT"] = "1"
        needle = f"gave up waiting for {environ['CLUSTER_NODES_METADATA_FILE']} to list all 2 nodes"
    start = time.monotonic()
    proc = run_launcher({**environ, "WORKER_RECORD_DIR": str(records)}, [WORKER])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
    assert time.monotonic() - start < 10
    assert not list(records.iterdir())


def test_master_addr_alone_is_a_workstation_not_a_cluster():
    # Single-machine scripts often export MASTER_ADDR; without a node rank or count it names no cluster.
    choice = platforms.choose({"MASTER_ADDR": "localhost", "MASTER_PORT": "29500"})
    assert choice.platform.name == "local"
