"""The launcher on a real 2-node SLURM cluster (launcher/simulate/slurm_lab.py): sbatch, srun, scancel, scontrol.

One lab per module (about 2 s to bring up). Every job's step is ``srun --ntasks-per-node=1 python -m
launcher ...`` (2 processes per node; 1 where two jobs share the nodes: each node has 4 CPUs, a job takes 1
per node, so SLURM runs two at once without oversubscribing). Needs root; skipped with the reason elsewhere.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import time
from collections.abc import Iterator

import pytest
from conftest import PYTHON, REPO, TRAIN_SCRIPTS, assert_gone, launcher_env
from test_slurm import random_nodelist

from launcher.cluster import Cluster
from launcher.command import job_identity, watch_ports
from launcher.options import parse_invocation
from launcher.platforms import hostlist
from launcher.simulate.slurm_lab import SlurmLab, fqdn, missing_requirement, node_list

pytestmark = pytest.mark.skipif(missing_requirement() is not None, reason=missing_requirement() or "")
WORKER = os.path.join(REPO, "tests", "scripts", "launcher_worker.py")
PAIRED = os.path.join(REPO, "tests", "scripts", "paired_worker.py")
DIGITS = os.path.join(TRAIN_SCRIPTS, "train_digits.py")
KILL_WAIT = 30.0
SLOW = 300.0  # a torch job: on a loaded 2-core machine, importing torch alone took 20 s


def running_lab() -> Iterator[SlurmLab]:
    """A 2-node lab for a module's tests; when they are done, proof that nothing of it is left."""
    cluster = SlurmLab(nodes=2, cpus=4)
    try:
        cluster.up()
    except Exception:
        cluster.down()
        raise
    cluster.baseline = {node: set(cluster.node_pids(node)) for node in (1, 2)}  # holder + slurmd
    yield cluster
    root = cluster.root
    nets = list(cluster.info["net"])
    pids = cluster.down()
    assert_gone(pids)  # every daemon and job process of the lab, by PID
    for net in nets:
        assert not [p for p in os.listdir("/proc") if p.isdigit() and _link(p) == net], f"{net} still used"
    with open("/proc/self/mountinfo") as fh:
        assert root not in fh.read(), "a lab mount leaked into the machine's mount namespace"
    assert not os.path.exists(root)


@pytest.fixture(scope="module")
def lab() -> Iterator[SlurmLab]:
    yield from running_lab()


def _link(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def job_env(lab: SlurmLab, **extra: str) -> dict[str, str]:
    """What the jobs inherit from sbatch: the repository importable, a private TMPDIR."""
    tmp = os.path.join(lab.root, "tmp")
    os.makedirs(tmp, exist_ok=True)
    return launcher_env(TMPDIR=tmp, OMP_NUM_THREADS="1", **extra)


def step(args: str, srun: str = "--ntasks-per-node=1") -> str:
    """A batch script whose step runs the launcher on every node."""
    return f"#!/bin/bash\nsrun {srun} {PYTHON} -m launcher {args}\n"


def job_pids(lab: SlurmLab) -> list[int]:
    """Every process on the nodes that is not the lab's own (slurmstepd, launcher, torchrun, workers)."""
    return [p for node in (1, 2) for p in lab.node_pids(node) if p not in lab.baseline[node]]


@pytest.mark.lab
def test_host_lists_expand_as_scontrol_does(lab: SlurmLab) -> None:
    rng = random.Random(10)
    corpus = ["gpu[01-04,07]", "r[1-2]n[1-3]", "n[008-011]", "a[1-2],b,c[09-10]x[1,3]", "node1"]
    corpus += [random_nodelist(rng) for _ in range(40)]
    for nodelist in corpus:
        expected = lab.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        assert hostlist.expand(nodelist) == expected, nodelist


@pytest.mark.job
@pytest.mark.lab
def test_two_nodes_train_with_world_size_4_and_rank_0_on_the_first_node(lab: SlurmLab, tmp_path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    job = lab.sbatch(step(f"--nproc-per-node 2 {WORKER} --steps 5"), "-N2",
                     env=job_env(lab, WORKER_RECORD_DIR=str(records)))
    fields = lab.wait_job(job, timeout=SLOW)
    out = lab.output(job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out
    facts = [json.loads((records / f"rank{r}.json").read_text()) for r in range(4)]
    first, second = (fqdn(name) for name in lab.names)  # each node's host name is its FQDN
    assert [(f["rank"], f["world_size"], f["host"]) for f in facts] == [
        (0, 4, first), (1, 4, first), (2, 4, second), (3, 4, second)]
    assert all(f["params"] == facts[0]["params"] for f in facts)  # DDP kept every replica identical
    # A job id and a node list of a real site's shape (gpu-[0007-0008]), as each node's launcher read them:
    # its torchrun command names the job id, the first node as master and its own node of the expanded list.
    assert job > 10_000_000 and (fields["NodeList"], lab.names) == ("gpu-[0007-0008]", ["gpu-0007", "gpu-0008"])
    port = 20000 + job % 10000
    for rank, name in enumerate(lab.names):
        assert (f"slurm host {name}: node {rank} of 2, 2 process(es) per node; " in out
                and f" --node-rank {rank} --master-addr gpu-0007 --master-port {port} --rdzv-backend static "
                    f"--rdzv-id slurm-{job}.0 --rdzv-conf timeout=900 --local-addr {name} " in out), out


@pytest.mark.job
@pytest.mark.lab
def test_a_worker_exit_code_on_node_2_is_the_step_exit_code_with_the_root_cause(lab: SlurmLab, tmp_path) -> None:
    # Rank 2 is local rank 0 of node 2. (Were it local rank 1, rank 2's "connection closed" may land in the same
    # second, and torchrun, which times failures to the second, names the lower local rank: see the report.)
    job = lab.sbatch(step(f"--nproc-per-node 2 {WORKER} --steps 200 --step-sleep 0.05 --fail-rank 2 "
                          "--exit-code 7 --fail-at-step 2"), "-N2",
                     env=job_env(lab, WORKER_RECORD_DIR=str(tmp_path)))
    fields = lab.wait_job(job, timeout=SLOW)
    out = lab.output(job)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "7:0"), out
    assert f"{lab.names[1]}: rank 2 (local rank 0) exited with code 7" in out


@pytest.mark.job
@pytest.mark.lab
def test_scancel_checkpoints_ends_within_killwait_and_the_rerun_resumes(lab: SlurmLab, tmp_path) -> None:
    args = (f"--nproc-per-node 2 {DIGITS} --batch-size 8 --print-freq 1 --plot false --timeout 1 "
            f"--output-dir {tmp_path / 'out'} --checkpoint-dir {tmp_path / 'ck'}")
    job = lab.sbatch(step(args + " --epochs 500"), "-N2", env=job_env(lab))
    deadline = time.monotonic() + SLOW
    while "METRIC epoch=1 " not in lab.output(job):
        assert time.monotonic() < deadline and lab.job(job)["JobState"] in ("PENDING", "RUNNING"), lab.output(job)
        time.sleep(0.2)
    running = job_pids(lab)
    lab.run(["scancel", str(job)])
    fields = lab.wait_job(job, timeout=KILL_WAIT + 15)
    assert_gone(running, within=KILL_WAIT)
    out = lab.output(job)
    assert fields["JobState"] == "CANCELLED", out
    # within KillWait: had slurmd's SIGKILL come first, srun would say "task N: Killed" (strsignal) for that
    # launcher; each ended by itself, with its own code (an event, not the seconds a loaded machine took)
    ends = re.findall(r"srun: error: \S+: tasks? [\d,-]+: (.+)", out)
    assert all(end.startswith("Exited with exit code ") for end in ends), out[-3000:]
    assert "received SIGTERM: finishing this step" in out
    assert not job_pids(lab), "processes left on a node after the job ended"
    saved = sorted(glob.glob(str(tmp_path / "ck" / "checkpoint-e*.pt")))
    assert saved, out[-3000:]
    epoch, step_ = map(int, re.search(r"checkpoint-e(\d+)-s(\d+)\.pt$", saved[-1]).groups())

    rerun = lab.sbatch(step(args + f" --epochs {epoch + 1}"), "-N2", env=job_env(lab))
    fields = lab.wait_job(rerun, timeout=SLOW)
    out = lab.output(rerun)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert f"resuming from {saved[-1]}: epoch {epoch + 1} of {epoch + 1}, step {step_}" in out


@pytest.mark.lab
@pytest.mark.parametrize("srun, expected", [
    ("--ntasks-per-node=2", "start one launcher per node: srun --ntasks-per-node=1"),
    (None, "not in a job step: start it on every node with srun --ntasks-per-node=1"),
])
def test_wrong_use_is_one_line_and_exit_2(lab: SlurmLab, srun, expected, tmp_path) -> None:
    command = f"{PYTHON} -m launcher {WORKER}"
    script = f"#!/bin/bash\n{command}\n" if srun is None else f"#!/bin/bash\nsrun {srun} {command}\n"
    job = lab.sbatch(script, "-N2", "--ntasks-per-node=2", env=job_env(lab, WORKER_RECORD_DIR=str(tmp_path)))
    fields = lab.wait_job(job)
    out = lab.output(job)
    assert fields["ExitCode"] == "2:0", out
    errors = [line for line in out.splitlines() if line.startswith("ddp-launcher: error:")]
    assert errors and all(re.search(expected, line) for line in errors), out
    assert not os.listdir(tmp_path), "a worker started"


def own_watch_ports(job: int, master: str) -> tuple[int, ...]:
    """The job watch's candidate ports of the first step of 2-node job ``job`` (the launcher's own rule)."""
    cluster = Cluster("slurm", 2, 0, 1, master, master, 20000 + job % 10000, job_name=f"slurm-{job}.0")
    identity = job_identity(cluster.job_name, master, cluster.master_port, 2)
    return watch_ports(cluster, parse_invocation(["t.py"], {}).options, identity)


@pytest.mark.job
@pytest.mark.lab
def test_two_jobs_whose_ids_differ_by_1_share_both_nodes_and_both_succeed(lab: SlurmLab, tmp_path) -> None:
    # Their rendezvous ports differ by 1 (20000 + id % 10000); each job's watch must find its own hub on the first node.
    # The workers wait for each other's ranks after their process group is up (tests/scripts/paired_worker.py),
    # so both jobs' rendezvous, process groups and watches are alive at the same time.
    meet = tmp_path / "meet"
    meet.mkdir()
    script = step(f"--nproc-per-node 1 {PAIRED} --meet {meet} --job $SLURM_JOB_ID --expect 4")
    first = lab.sbatch(script, "-N2", env=job_env(lab))
    second = lab.sbatch(script, "-N2", env=job_env(lab))
    assert second == first + 1
    deadline = time.monotonic() + SLOW
    while len(list(meet.glob("*.json"))) < 4:  # every rank of both jobs is in: the jobs share both nodes now
        states = [lab.job(job)["JobState"] for job in (first, second)]
        assert time.monotonic() < deadline and set(states) <= {"PENDING", "CONFIGURING", "RUNNING"}, (
            states, lab.output(first), lab.output(second))
        time.sleep(0.2)
    running, master = job_pids(lab), lab.names[0]
    for job in (first, second):
        fields = lab.wait_job(job, timeout=SLOW)
        out = lab.output(job)
        assert (fields["JobState"], fields["ExitCode"], fields["NodeList"]) == ("COMPLETED", "0:0", node_list(2)), out
        assert f"--master-addr {master} --master-port {20000 + job % 10000}" in out
        connected = re.findall(rf"job watch: connected to the hub on {master} \({master}:(\d+)\)$", out, re.M)
        hub = re.findall(r"job watch: hub on port (\d+)$", out, re.M)
        assert len(connected) == 1 and connected == hub and int(hub[0]) in own_watch_ports(job, master), out
        assert not re.search(r"refused|lost|job watch off", out), out
    records = [json.loads(path.read_text()) for path in sorted(meet.glob("*.json"))]
    assert sorted((r["job"], r["rank"], r["sum"]) for r in records) == [
        (str(first), 0, 3), (str(first), 1, 3), (str(second), 0, 3), (str(second), 1, 3)]
    assert max(r["met_at"] for r in records) < min(r["left_at"] for r in records), records  # they overlapped
    assert_gone(running, within=KILL_WAIT)
    assert not job_pids(lab), "processes left on a node after both jobs ended"
