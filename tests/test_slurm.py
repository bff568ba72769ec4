"""SLURM without a cluster: host lists against python-hostlist, and what each node's variables become.

The same readings on a real cluster: tests/test_slurm_cluster.py.
"""

from __future__ import annotations

import random
import subprocess

import hostlist as python_hostlist
import pytest
from conftest import PYTHON, REPO, launcher_env, resolve_cluster
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher import platforms
from launcher.errors import ConfigError
from launcher.options import parse_invocation
from launcher.platforms import hostlist, slurm

PREFIXES = ["n", "gpu", "r", "node-", "cn", "a1b", "x", "compute.lab"]


def random_nodelist(rng: random.Random) -> str:
    """A node list as SLURM writes them: prefixes, bracket groups of ranges, zero padding, text between
    groups (SLURM refuses text after the last group: ``x[1-2]s`` is "Invalid hostlist")."""
    items = []
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(PREFIXES)
        for group in range(rng.randint(0, 2)):
            if group:
                name += rng.choice(["n", "-ib", "s"])
            width = rng.choice([1, 1, 2, 3])
            parts = []
            for _ in range(rng.randint(1, 3)):
                low = rng.randint(0, 30)
                high = low + rng.randint(0, 12)
                parts.append(str(low).zfill(width) if low == high
                             else f"{str(low).zfill(width)}-{str(high).zfill(width)}")
            name += "[" + ",".join(parts) + "]"
        items.append(name)
    return ",".join(items)


@settings(max_examples=400, deadline=None)
@given(st.randoms(use_true_random=False))
def test_expansion_equals_python_hostlist(rng: random.Random) -> None:
    nodelist = random_nodelist(rng)
    assert hostlist.expand(nodelist) == python_hostlist.expand_hostlist(nodelist, allow_duplicates=True)


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("r[1-2]n[1-3]", ["r1n1", "r1n2", "r1n3", "r2n1", "r2n2", "r2n3"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a[1-2],login,b-ib[7]", ["a1", "a2", "login", "b-ib7"]),
    ("node1", ["node1"]),
])
def test_the_forms_slurm_writes(nodelist: str, hosts: list[str]) -> None:
    assert hostlist.expand(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["n[1-2", "n1-2]", "n[[1]]", "n[2-1]", "n[a-b]", "n[]", "a,,b", "",
                                      "n[1-999999999]", "r[1-1000]n[1-1000]"])
def test_malformed_or_absurd_lists_are_refused(nodelist: str) -> None:
    with pytest.raises(hostlist.HostlistError):
        hostlist.expand(nodelist)


def step_env(node: int = 0, nodelist: str = "node[1-2]", **extra: str) -> dict[str, str]:
    """The variables ``srun -N2 --ntasks-per-node=1`` gives a task (measured on the lab cluster)."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node),
           "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": nodelist,
           "SLURM_STEP_NODELIST": nodelist, "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURMD_NODENAME": f"node{node + 1}"}
    env.update(extra)
    return {k: v for k, v in env.items() if v != "-"}


def resolve(environ: dict[str, str], *argv: str, dev_dir: str = "/nonexistent"):
    options = parse_invocation([*argv, "train.py"], {}).options
    return resolve_cluster(environ, options, dev_dir, platform=slurm.PLATFORM)


def test_each_node_reads_its_rank_the_master_and_the_port() -> None:
    for node in (0, 1):
        c = resolve(step_env(node, "gpu[01-02]", SLURMD_NODENAME=f"gpu0{node + 1}", SLURM_GPUS_ON_NODE="2"))
        assert (c.nnodes, c.node_rank, c.current_host, c.master_addr) == (2, node, f"gpu0{node + 1}", "gpu01")
        assert (c.nproc_per_node, c.master_port, c.hosts) == (2, 24242, ("gpu01", "gpu02"))
    assert resolve(step_env(1), "--nproc-per-node", "3").nproc_per_node == 3  # the option wins
    assert resolve(step_env(1)).nproc_per_node == 1  # no GPU variable, no device: one process


def test_a_shared_node_runs_one_process_per_gpu_the_job_was_given(tmp_path) -> None:
    """All 8 GPUs show in /dev where cgroups deny the job 6 of them; SLURMs that set no SLURM_GPUS_ON_NODE
    still list the node's own GPU ids (Lightning-AI/pytorch-lightning#16236: SLURM_STEP_GPUS='2,3')."""
    for i in range(8):
        (tmp_path / f"nvidia{i}").touch()
    dev = str(tmp_path)
    assert resolve(step_env(0), dev_dir=dev).nproc_per_node == 8  # nothing but the devices: all of them
    assert resolve(step_env(0, SLURM_STEP_GPUS="2,3", SLURM_JOB_GPUS="2,3"), dev_dir=dev).nproc_per_node == 2
    assert resolve(step_env(0, SLURM_JOB_GPUS="5,6,7"), dev_dir=dev).nproc_per_node == 3  # the batch script's
    assert resolve(step_env(0, SLURM_STEP_GPUS="4", SLURM_JOB_GPUS="4,5"), dev_dir=dev).nproc_per_node == 1
    assert resolve(step_env(0, SLURM_GPUS_ON_NODE="4", SLURM_STEP_GPUS="2,3"), dev_dir=dev).nproc_per_node == 4
    # gres.conf without device files: SLURM writes NoDevFiles (src/plugins/gres/common/gres_common.c)
    assert resolve(step_env(0, SLURM_STEP_GPUS="NoDevFiles", SLURM_JOB_GPUS="NoDevFiles"),
                   dev_dir=dev).nproc_per_node == 8


@given(st.sets(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=64), st.randoms())
def test_gpu_id_lists_count_each_id(ids: set[int], rng: random.Random) -> None:
    written = [str(i) for i in ids]
    rng.shuffle(written)
    assert slurm.gpu_id_count({"SLURM_STEP_GPUS": " " + ",".join(written)}, "SLURM_STEP_GPUS") == len(ids)


@pytest.mark.parametrize("text", ["2,2", "0,,1", "gpu0", "0-3", "1;2", "٣"])
def test_a_gpu_id_list_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve(step_env(0, SLURM_STEP_GPUS=text))
    assert str(caught.value) == f"SLURM_STEP_GPUS is not a list of distinct GPU ids (\"0,1\"): {text!r}"


def test_the_step_list_wins_over_the_job_list() -> None:
    c = resolve(step_env(0, "n[3-4]", SLURM_JOB_NODELIST="n[1-4]", SLURMD_NODENAME="n3"))
    assert (c.hosts, c.node_rank, c.master_addr) == (("n3", "n4"), 0, "n3")


@given(st.integers(min_value=0, max_value=2**32))
def test_ports_stay_in_their_range_and_neighbouring_jobs_differ(job_id: int) -> None:
    port = slurm.port_for(job_id)
    assert 20000 <= port < 30000 and port != slurm.port_for(job_id + 1)


@pytest.mark.parametrize("extra, message", [
    ({"SLURM_LOCALID": "1"}, "SLURM_LOCALID=1: several tasks of this step run on this node; start one "
                             "launcher per node: srun --ntasks-per-node=1"),
    ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "-"},
     "SLURM_NTASKS_PER_NODE='2': more than one task per node"),
    ({"SLURM_NTASKS_PER_NODE": "-", "SLURM_STEP_TASKS_PER_NODE": "1,2(x3)"},
     "SLURM_STEP_TASKS_PER_NODE='1,2(x3)': more than one task per node"),
    ({"SLURM_STEP_ID": "-", "SLURM_STEP_NODELIST": "-"}, "run in the batch script of a 2-node job "
     "(SLURM_JOB_NODELIST='node[1-2]'), not in a job step: start it on every node with srun"),
    ({"SLURMD_NODENAME": "login1"}, "this node 'login1' (SLURMD_NODENAME, else the host name) is not in "
                                    "SLURM_STEP_NODELIST='node[1-2]'"),
    ({"SLURM_NODEID": "1"}, "SLURM_NODEID=1 but this node 'node1' is number 0 of SLURM_STEP_NODELIST"),
    ({"SLURM_STEP_NODELIST": "node[1-2"}, "SLURM_STEP_NODELIST is not a SLURM host list ('[' without ']')"),
    ({"SLURM_STEP_NODELIST": "node[1-2],node1"}, "SLURM_STEP_NODELIST names host 'node1' twice"),
    ({"SLURM_STEP_TASKS_PER_NODE": "two"}, "SLURM_STEP_TASKS_PER_NODE is not a SLURM task layout: 'two'"),
    ({"SLURM_GPUS_ON_NODE": "x"}, "SLURM_GPUS_ON_NODE is not a whole number: 'x'"),
])
def test_wrong_use_is_refused_with_one_line(extra: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve(step_env(0, **extra))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_batch_script_of_a_one_node_job_runs_the_launcher_itself() -> None:
    env = step_env(0, "node1", SLURM_STEP_ID="-", SLURM_STEP_NODELIST="-", SLURM_STEP_TASKS_PER_NODE="-",
                   SLURM_NTASKS_PER_NODE="4")  # the job's layout (4 tasks for 4 GPUs), not this process's
    c = resolve(env)
    assert (c.nnodes, c.node_rank, c.job_name) == (1, 0, "slurm-4242")


def test_a_step_reads_its_own_task_layout_not_the_jobs() -> None:
    c = resolve(step_env(1, SLURM_NTASKS_PER_NODE="4", SLURM_STEP_TASKS_PER_NODE="1(x2)"))
    assert (c.nnodes, c.node_rank) == (2, 1)


def test_wrong_use_exits_2_before_anything_starts(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    run = subprocess.run([PYTHON, "-m", "launcher", str(script)], cwd=REPO, capture_output=True, text=True,
                         env=launcher_env(**step_env(1, SLURM_LOCALID="1")), timeout=30)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == ["ddp-launcher: error: SLURM_LOCALID=1: several tasks of this step run on "
                                       "this node; start one launcher per node: srun --ntasks-per-node=1 ..."]
    assert not (tmp_path / "train.py.ran").exists()


def test_slurm_is_detected_before_pbs_and_local_and_its_grace_period_fits_killwait() -> None:
    choice = platforms.choose(step_env(0, PBS_JOBID="1.pbs", PBS_NODEFILE="/x"))
    assert choice.platform is slurm.PLATFORM
    assert [name for name, _ in choice.matches] == ["slurm", "pbs", "local"]
    assert not slurm.PLATFORM.detect({"PBS_JOBID": "1"})
    assert slurm.PLATFORM.grace_period + 3 <= 30  # KillWait's default: SIGKILL 30 s after SIGTERM
    assert slurm.PLATFORM.report_path(step_env()) is None  # SLURM shows no reason: stderr only
