"""Every value a platform publishes, across its documented domain, resolves in the dry run; a value just
outside it is one line naming the variable, the value and the rule.

The domains (and their sources) are the tables "What it reads, and the domain of each value" on each
platform's page under docs/platforms/. Where an independent reader exists (python-hostlist for SLURM's
host lists, lightning-fabric's SLURMEnvironment for the master, the node rank and the job id's port),
the launcher's reading is checked against it.
"""

from __future__ import annotations

import json
import os
import string
import subprocess
import tempfile
from typing import Optional

import hostlist as python_hostlist
import pytest
from conftest import PYTHON, REPO, launcher_env, resolve_cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.errors import ConfigError
from launcher.options import parse_invocation
from launcher.platforms import env as torchrun_env
from launcher.platforms import kubeflow, oci, pbs, sagemaker, slurm, vertex

SLURM_MAX_JOB_ID = 2**32 - 2  # job ids are uint32_t; the largest real one is (63 << 26) + 67043327 = 4294901759
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def options(*args: str):
    return parse_invocation([*args, "train.py"], {}).options


def one_line_error(environ: dict, platform, hostname: str = "", *needles: str) -> str:
    with pytest.raises(ConfigError) as caught:
        resolve_cluster(environ, options(), hostname=hostname, platform=platform)
    message = str(caught.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


# --- SLURM --------------------------------------------------------------------------------------

def compress(numbers: list[int], width: int) -> str:
    """Sorted distinct numbers as a bracket group's list: runs become ``low-high``, singles stay."""
    parts, start = [], 0
    for i in range(1, len(numbers) + 1):
        if i == len(numbers) or numbers[i] != numbers[i - 1] + 1:
            low, high = numbers[start], numbers[i - 1]
            parts.append(str(low).zfill(width) if low == high else f"{str(low).zfill(width)}-{str(high).zfill(width)}")
            start = i
    return ",".join(parts)


_label = st.text(string.ascii_lowercase, min_size=1, max_size=8)


@st.composite
def slurm_node_lists(draw) -> str:
    """Node lists in SLURM's full grammar: several names, bracket groups with lists and ranges, zero
    padding, a suffix after the brackets, two bracket groups in one name, FQDNs, names without brackets."""
    names = []
    for k in range(draw(st.integers(1, 3))):
        prefix = draw(_label) + str(k) + draw(st.sampled_from(["", "-", "-n"]))
        width = draw(st.sampled_from([1, 2, 4, 6]))
        numbers = sorted(draw(st.sets(st.integers(0, 10 ** min(width, 5) - 1), min_size=1, max_size=12)))
        name = f"{prefix}[{compress(numbers, width)}]"
        if draw(st.booleans()):
            second = sorted(draw(st.sets(st.integers(0, 99), min_size=1, max_size=3)))
            name += f"-n[{compress(second, 2)}]"
        name += draw(st.sampled_from(["", "-ib", ".cluster.example.org"]))
        names.append(name)
    if draw(st.booleans()):
        names.append("login" + draw(_label))
    return ",".join(names)


def slurm_step(job_id: int, nodelist: str, node: int, host: str, **extra: str) -> dict[str, str]:
    """What ``srun --ntasks-per-node=1`` gives node ``node`` of a step (the variables of tests/test_slurm.py)."""
    nnodes = len(python_hostlist.expand_hostlist(nodelist))
    env = {"SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node),
           "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": nodelist,
           "SLURM_STEP_NODELIST": nodelist, "SLURM_NNODES": str(nnodes), "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_STEP_TASKS_PER_NODE": f"1(x{nnodes})", "SLURMD_NODENAME": host}
    env.update(extra)
    return env


@FAST
@given(job_id=st.integers(1, SLURM_MAX_JOB_ID), nodelist=slurm_node_lists(), data=st.data())
def test_slurm_every_job_id_and_node_list_resolves(job_id: int, nodelist: str, data) -> None:
    hosts = python_hostlist.expand_hostlist(nodelist)  # the oracle
    node = data.draw(st.integers(0, len(hosts) - 1))
    cluster = resolve_cluster(slurm_step(job_id, nodelist, node, hosts[node]), options(), platform=slurm.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr) == (len(hosts), node, hosts[0])
    assert cluster.hosts == tuple(hosts) and cluster.current_host == hosts[node]
    assert cluster.master_port == 20000 + job_id % 10000 and cluster.job_name == f"slurm-{job_id}.0"


@pytest.mark.filterwarnings("ignore:The `srun` command is available")  # Lightning's hint on a host with srun
@FAST
@given(job_id=st.integers(1000, SLURM_MAX_JOB_ID), width=st.integers(1, 6), first=st.integers(0, 9000),
       count=st.integers(1, 40), data=st.data())
def test_slurm_agrees_with_lightning(job_id: int, width: int, first: int, count: int, data) -> None:
    from lightning_fabric.plugins.environments import SLURMEnvironment

    nodelist = f"gpu-[{str(first).zfill(width)}-{str(first + count - 1).zfill(width)}]"
    hosts = python_hostlist.expand_hostlist(nodelist)
    node = data.draw(st.integers(0, count - 1))
    environ = slurm_step(job_id, nodelist, node, hosts[node], SLURM_NODELIST=nodelist)
    cluster = resolve_cluster(environ, options(), platform=slurm.PLATFORM)
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith(("SLURM_", "MASTER_"))]:
            patch.delenv(name)
        for name, value in environ.items():
            patch.setenv(name, value)
        theirs = SLURMEnvironment()
        assert (theirs.main_address, theirs.node_rank()) == (cluster.master_addr, cluster.node_rank)
        assert cluster.master_port == theirs.main_port + 5000  # both: the job id's last four digits


@pytest.mark.parametrize("job_id", [48213377, 67043327, 67043328, 67108865, SLURM_MAX_JOB_ID])
def test_slurm_large_job_ids_resolve(job_id: int) -> None:
    for node in (0, 1):
        host = f"gpu-000{7 + node}"
        cluster = resolve_cluster(slurm_step(job_id, "gpu-[0007-0008]", node, host), options(), platform=slurm.PLATFORM)
        assert (cluster.nnodes, cluster.node_rank, cluster.master_addr) == (2, node, "gpu-0007")
        assert cluster.master_port == 20000 + job_id % 10000 and cluster.job_name == f"slurm-{job_id}.0"


def test_slurm_job_id_48213377_through_the_command(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    environ = {k: v for k, v in launcher_env().items() if not k.startswith(("SLURM", "PBS_", "MASTER_", "KUBERNETES"))}
    environ.update(slurm_step(48213377, "gpu-[0007-0008]", 1, "gpu-0008"))
    run = subprocess.run([PYTHON, "-m", "launcher", "--dry-run", "--json", str(script)], cwd=REPO, env=environ,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    cluster = json.loads(run.stdout)["cluster"]
    assert (cluster["platform"], cluster["nnodes"], cluster["node_rank"]) == ("slurm", 2, 1)
    assert (cluster["master_addr"], cluster["master_port"]) == ("gpu-0007", 23377)
    assert not (tmp_path / "train.py.ran").exists()


@pytest.mark.parametrize("value", ["0", str(SLURM_MAX_JOB_ID + 1), str(2**32), "-5"])
def test_slurm_job_ids_outside_32_bits_are_one_line(value: str) -> None:
    environ = slurm_step(1, "gpu-[0007-0008]", 0, "gpu-0007", SLURM_JOB_ID=value)
    one_line_error(environ, slurm.PLATFORM, "", f"SLURM_JOB_ID must be 1-{SLURM_MAX_JOB_ID}", repr(value),
                   "unsigned 32-bit")


@FAST
@given(array_job=st.integers(1, SLURM_MAX_JOB_ID), task=st.integers(0, 4_000_000), het_size=st.integers(2, 8))
def test_slurm_array_and_heterogeneous_job_variables_leave_the_step_alone(array_job: int, task: int,
                                                                         het_size: int) -> None:
    # Array tasks: SLURM_ARRAY_TASK_ID up to MaxArraySize - 1 (at most 4,000,000); their SLURM_JOB_ID is the
    # task's own id. Heterogeneous jobs: SLURM_HET_SIZE and the *_HET_GROUP_<n> variables beside the step's own.
    extra = {"SLURM_ARRAY_JOB_ID": str(array_job), "SLURM_ARRAY_TASK_ID": str(task),
             "SLURM_ARRAY_TASK_MAX": str(task), "SLURM_HET_SIZE": str(het_size),
             "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NTASKS_PER_NODE": "-"}
    for group in range(het_size):
        extra[f"SLURM_JOB_ID_HET_GROUP_{group}"] = str(min(array_job + group, SLURM_MAX_JOB_ID))
        extra[f"SLURM_JOB_NODELIST_HET_GROUP_{group}"] = f"g{group}-[01-02]"
    environ = {k: v for k, v in slurm_step(array_job, "gpu-[0007-0008],cpu-[1-3]", 3, "cpu-2", **extra).items()
               if v != "-"}
    cluster = resolve_cluster(environ, options(), platform=slurm.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr) == (5, 3, "gpu-0007")


@pytest.mark.parametrize("layout", ["1", "1(x2)", "1(x4294967294)", "1,1(x7),1"])
def test_slurm_task_layouts_of_one_task_per_node(layout: str) -> None:
    environ = slurm_step(48213377, "n[1-2]", 0, "n1", SLURM_STEP_TASKS_PER_NODE=layout)
    assert resolve_cluster(environ, options(), platform=slurm.PLATFORM).nnodes == 2


# --- PBS ----------------------------------------------------------------------------------------

@st.composite
def pbs_job_ids(draw) -> tuple[str, int]:
    """``seq.server[.domain]``, an array's ``seq[].server`` and a subjob's ``seq[index].server``; and seq."""
    seq = draw(st.integers(0, 999_999_999_999))  # PBS Pro's max_job_sequence_id goes up to 999,999,999,999
    server = draw(st.sampled_from(["pbs01", "pbs01.cluster.example.edu", "aurora-pbs-0001.hostmgmt.cm"]))
    form = draw(st.sampled_from(["plain", "array", "subjob"]))
    if form == "array":
        return f"{seq}[].{server}", seq
    if form == "subjob":
        return f"{seq}[{draw(st.integers(0, 10_000_000))}].{server}", seq
    return f"{seq}.{server}", seq


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=pbs_job_ids(), nnodes=st.integers(1, 40), cores=st.integers(1, 256),
       domain=st.sampled_from(["", ".cluster.example.edu", ".hostmgmt2000.cm.aurora.alcf.anl.gov"]),
       short_name=st.booleans(), data=st.data())
def test_pbs_every_job_id_and_node_file_resolves(job, nnodes, cores, domain, short_name, data) -> None:
    job_id, seq = job
    hosts = [f"x4000c0s{i}b0n0{domain}" for i in range(nnodes)]
    node = data.draw(st.integers(0, nnodes - 1))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "nodefile")
        with open(path, "w") as out:
            out.writelines(f"{h}\n" for h in hosts for _ in range(cores))  # one line per core, as PBS writes
        environ = {"PBS_JOBID": job_id, "PBS_NODEFILE": path}
        name = hosts[node].split(".")[0] if short_name else hosts[node]
        cluster = resolve_cluster(environ, options(), hostname=name, platform=pbs.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr) == (nnodes, node, hosts[0])
    assert 20000 <= cluster.master_port < 30000 and cluster.job_name == f"pbs-{job_id}"
    if "[" not in job_id:
        assert cluster.master_port == 20000 + seq % 10000


def test_pbs_node_file_beyond_16_mib_of_a_large_job(tmp_path) -> None:
    # 1,500 hosts x 256 lines (one per core) of 50-byte FQDNs: 19 MB, a file the 16 MiB bound refused.
    hosts = [f"x{4000 + i // 64}c0s{i % 64:02d}b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov" for i in range(1500)]
    path = tmp_path / "nodefile"
    path.write_text("".join(f"{h}\n" * 256 for h in hosts))
    assert path.stat().st_size > 16 << 20
    cluster = resolve_cluster({"PBS_JOBID": "8123456.aurora-pbs-0001.hostmgmt.cm", "PBS_NODEFILE": str(path)},
                              options(), hostname=hosts[1234], platform=pbs.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr, cluster.master_port) == \
        (1500, 1234, hosts[0], 23456)


def test_pbs_node_file_beyond_any_job_is_one_line(tmp_path) -> None:
    path = tmp_path / "nodefile"
    with open(path, "wb") as out:
        out.truncate(pbs.MAX_NODEFILE_BYTES + 1)  # sparse: nothing is written, the size alone is refused
    one_line_error({"PBS_JOBID": "1.pbs", "PBS_NODEFILE": str(path)}, pbs.PLATFORM, "n1",
                   "PBS_NODEFILE", str(path), "larger than 256 MiB")


# --- SageMaker ----------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nhosts=st.integers(1, 4096), groups=st.integers(1, 5), data=st.data())
def test_sagemaker_host_counts_and_instance_groups_resolve(nhosts: int, groups: int, data) -> None:
    groups = min(groups, nhosts)
    hosts = [f"algo-{i + 1}" for i in range(nhosts)]
    current = data.draw(st.sampled_from(hosts))
    split = [hosts[g::groups] for g in range(groups)]  # every host in exactly one group
    config = {"current_host": current, "hosts": sorted(hosts), "network_interface_name": "eth0"}
    if groups > 1:
        mine = next(g for g, members in enumerate(split) if current in members)
        config.update(current_group_name=f"group-{mine}", current_instance_type="ml.p4d.24xlarge",
                      instance_groups=[{"instance_group_name": f"group-{g}", "instance_type": "ml.p4d.24xlarge",
                                        "hosts": members} for g, members in enumerate(split)])
    with tempfile.TemporaryDirectory() as base:
        os.makedirs(os.path.join(base, "input", "config"))
        with open(os.path.join(base, "input", "config", "resourceconfig.json"), "w") as out:
            json.dump(config, out)
        cluster = resolve_cluster({"SAGEMAKER_BASE_DIR": base, "SM_CURRENT_HOST": current}, options(),
                                  platform=sagemaker.PLATFORM)
    order = sorted(hosts)  # SageMaker's order: the names sorted as text
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr) == (nhosts, order.index(current), order[0])
    assert cluster.master_port == 7777


@FAST
@given(count=st.integers(1, 100_000), data=st.data())
def test_sagemaker_sdk3_host_count_and_rank(count: int, data) -> None:
    rank = data.draw(st.integers(0, count - 1))
    environ = {"SM_HOST_COUNT": str(count), "SM_CURRENT_HOST_RANK": str(rank), "SM_MASTER_ADDR": "algo-1",
               "SM_CURRENT_HOST": f"algo-{rank + 1}", "SAGEMAKER_BASE_DIR": "/nonexistent"}
    cluster = resolve_cluster(environ, options(), platform=sagemaker.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank) == (count, rank)
    if count > 1:
        assert cluster.master_addr == "algo-1"


# --- Kubernetes: Kubeflow v1 and Trainer v2 ----------------------------------------------------

@st.composite
def job_names(draw, room: int) -> str:
    """A DNS-1035 label (the operators' job names) short enough that ``<job><tail>`` fits in 63 characters."""
    first = draw(st.sampled_from(string.ascii_lowercase))
    middle = draw(st.text(string.ascii_lowercase + string.digits + "-", max_size=max(0, room - 2)))
    last = draw(st.sampled_from(string.ascii_lowercase + string.digits)) if room > 1 else ""
    return first + middle + last


@FAST
@given(nnodes=st.integers(1, 10_000), port=st.integers(1, 65535), data=st.data())
def test_kubeflow_v1_pod_names_up_to_63_characters(nnodes: int, port: int, data) -> None:
    rank = data.draw(st.integers(0, nnodes - 1))
    tail = "-master-0" if rank == 0 else f"-worker-{rank - 1}"
    job = data.draw(job_names(63 - len(f"-worker-{nnodes}")))
    pod = job + tail
    assert len(pod) <= 63
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": pod, "MASTER_ADDR": f"{job}-master-0",
               "MASTER_PORT": str(port), "WORLD_SIZE": str(nnodes), "RANK": str(rank)}
    cluster = resolve_cluster(environ, options(), platform=kubeflow.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr, cluster.master_port) == \
        (nnodes, rank, f"{job}-master-0", port)
    assert cluster.current_host == pod


@FAST
@given(nnodes=st.integers(1, 10_000), port=st.integers(1, 65535), data=st.data())
def test_kubeflow_v1_elastic_worker_pods(nnodes: int, port: int, data) -> None:
    rank = data.draw(st.integers(0, nnodes - 1))
    job = data.draw(job_names(63 - len(f"-worker-{nnodes}")))
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": f"{job}-worker-{rank}",
               "PET_RDZV_ENDPOINT": f"{job}-worker-0:{port}", "PET_NNODES": f"{nnodes}:{nnodes}"}
    cluster = resolve_cluster(environ, options(), platform=kubeflow.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr, cluster.master_port) == \
        (nnodes, rank, f"{job}-worker-0", port)


@FAST
@given(nnodes=st.integers(1, 10_000), port=st.integers(1, 65535), data=st.data())
def test_trainer_v2_job_names_and_ranks(nnodes: int, port: int, data) -> None:
    rank = data.draw(st.integers(0, nnodes - 1))
    job = data.draw(job_names(63 - len(f"-node-0-{nnodes}")))
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": f"{job}-node-0-{rank}",
               "PET_NNODES": str(nnodes), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "auto",
               "PET_MASTER_ADDR": f"{job}-node-0-0.{job}", "PET_MASTER_PORT": str(port)}
    cluster = resolve_cluster(environ, options(), platform=kubeflow.PLATFORM_V2)
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr, cluster.master_port) == \
        (nnodes, rank, f"{job}-node-0-0.{job}", port)


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_kubernetes_ports_outside_tcp_are_one_line(port: str) -> None:
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "PET_NNODES": "2", "PET_NODE_RANK": "1",
               "PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": port}
    one_line_error(environ, kubeflow.PLATFORM_V2, "", "PET_MASTER_PORT must be 1-65535", repr(port), "TCP port")


# --- Vertex AI ------------------------------------------------------------------------------------

@FAST
@given(workers=st.integers(0, 200), reducers=st.integers(0, 50), evaluators=st.integers(0, 3),
       port=st.integers(1, 65535), data=st.data())
def test_vertex_cluster_spec_with_every_worker_pool(workers: int, reducers: int, evaluators: int, port: int,
                                                    data) -> None:
    def pool(n: int, count: int) -> list[str]:
        return [f"workerpool{n}-0123456789-{i}:{port}" for i in range(count)]

    cluster_spec = {"workerpool0": pool(0, 1)}
    for number, count in ((1, workers), (2, reducers), (3, evaluators)):
        if count:
            cluster_spec[f"workerpool{number}"] = pool(number, count)
    rank = data.draw(st.integers(0, workers))
    task = {"type": "workerpool0", "index": 0} if rank == 0 else {"type": "workerpool1", "index": rank - 1}
    spec = {"cluster": cluster_spec, "environment": "cloud", "task": task,
            "job": json.dumps({"worker_pool_specs": [{"replica_count": workers}]})}
    cluster = resolve_cluster({"CLUSTER_SPEC": json.dumps(spec)}, options(), platform=vertex.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank, cluster.master_port) == (1 + workers, rank, port)
    assert cluster.master_addr == "workerpool0-0123456789-0"


@pytest.mark.parametrize("address", ["workerpool0-0:0", "workerpool0-0:65536", "workerpool0-0"])
def test_vertex_ports_outside_tcp_are_one_line(address: str) -> None:
    spec = json.dumps({"cluster": {"workerpool0": [address]}, "task": {"type": "workerpool0", "index": 0}})
    one_line_error({"CLUSTER_SPEC": spec}, vertex.PLATFORM, "", "CLUSTER_SPEC", address, "port 1-65535")


# --- OCI Data Science -----------------------------------------------------------------------------

@FAST
@given(nnodes=st.integers(1, 500), port=st.one_of(st.none(), st.integers(1, 65535)), text_ranks=st.booleans(),
       data=st.data())
def test_oci_multi_node_job_runs(nnodes: int, port: Optional[int], text_ranks: bool, data) -> None:
    rank = data.draw(st.integers(0, nnodes - 1))
    order = data.draw(st.permutations(range(nnodes)))
    nodes = [{"Rank": str(k) if text_ranks else k, "IPAddress": f"10.{k // 65536}.{k // 256 % 256}.{k % 256}"}
             for k in order]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "nodes.json")
        with open(path, "w") as out:
            json.dump(nodes, out)
        environ = {"JOB_RUN_OCID": "ocid1.datasciencejobrun.oc1.iad.x", "NODE_RANK": str(rank),
                   "NODE_COUNT": str(nnodes), "CLUSTER_NODES_METADATA_FILE": path}
        if port is not None:
            environ["MASTER_PORT"] = str(port)
        cluster = resolve_cluster(environ, options(), platform=oci.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank) == (nnodes, rank)
    assert cluster.master_port == (port or oci.DEFAULT_PORT)
    assert cluster.master_addr == (None if nnodes == 1 else "10.0.0.0")


@FAST
@given(workers=st.integers(0, 500), data=st.data())
def test_oci_older_ads_clusters(workers: int, data) -> None:
    rank = data.draw(st.integers(0, workers))
    environ = {"OCI__MODE": "MAIN" if rank == 0 else "WORKER", "OCI__WORKER_COUNT": str(workers),
               "NODE_RANK": str(rank), "MASTER_ADDR": "10.0.1.5", "JOB_RUN_OCID": "ocid1.datasciencejobrun.x"}
    cluster = resolve_cluster(environ, options(), platform=oci.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank) == (workers + 1, rank if workers else 0)


# --- torchrun-style environment -------------------------------------------------------------------

_addresses = st.one_of(
    st.builds(lambda a, b, c, d: f"{a}.{b}.{c}.{d}", *[st.integers(0, 255)] * 4),
    st.sampled_from(["fd00::1", "2001:db8::8a2e:370:7334", "::1"]),
    st.builds(lambda labels: ".".join(labels), st.lists(job_names(63), min_size=1, max_size=3)),
)


@FAST
@given(master=_addresses, port=st.integers(1, 65535), nnodes=st.integers(1, 100_000), pet=st.booleans(),
       elastic_form=st.booleans(), data=st.data())
def test_env_every_address_port_count_and_rank(master: str, port: int, nnodes: int, pet: bool,
                                               elastic_form: bool, data) -> None:
    rank = data.draw(st.integers(0, nnodes - 1))
    prefix = "PET_" if pet else ""
    environ = {f"{prefix}MASTER_ADDR": master, f"{prefix}MASTER_PORT": str(port), f"{prefix}NODE_RANK": str(rank),
               f"{prefix}NNODES": f"{nnodes}:{nnodes}" if elastic_form else str(nnodes)}
    cluster = resolve_cluster(environ, options(), platform=torchrun_env.PLATFORM)
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr, cluster.master_port) == \
        (nnodes, rank, master, port)


@pytest.mark.parametrize("name, value, needle", [
    ("MASTER_PORT", "0", "MASTER_PORT must be 1-65535 (a TCP port): '0'"),
    ("MASTER_PORT", "65536", "MASTER_PORT must be 1-65535 (a TCP port): '65536'"),
    ("NODE_RANK", "4", "NODE_RANK=4 is not a node of NNODES=4 (0-3)"),
    ("NNODES", "0", "NNODES must be >= 1: '0'"),
])
def test_env_values_just_outside_are_one_line(name: str, value: str, needle: str) -> None:
    environ = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "NNODES": "4", "NODE_RANK": "3", name: value}
    one_line_error(environ, torchrun_env.PLATFORM, "", needle)
