"""Out of memory told apart from any other SIGKILL (launcher/oom.py, the ``out_of_memory`` class).

Parsers of the kernel's counter files and of /proc/self/cgroup and mountinfo (hypothesis: bad bytes,
missing lines, huge numbers); the evidence read from real files; the verdict and report of a cause
with evidence, here and on another host. Real runs (cgroup v1 with a memory controller, root): a
worker the OOM killer kills in a memory-limited cgroup made for the job -> "out of memory" in the
report and the outcome; an OOM kill in another cgroup while our worker dies of SIGKILL -> not blamed.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import uuid

import pytest
from conftest import PYTHON, REPO, assert_gone, free_port, launcher_env, validate_outcome
from hypothesis import given, settings
from hypothesis import strategies as st
from test_launcher_processes import job_pids, make_host

from launcher import codes, failure, oom, report
from launcher.cluster import Cluster
from launcher.failure import RootCause
from launcher.outcome import Outcome

OOM_WORKER = os.path.join(REPO, "tests", "scripts", "oom_worker.py")
# other counters' names: any bytes but a line's separators, never the name oom_kill itself
NAMES = st.binary(min_size=1, max_size=20).filter(lambda b: b.split() != [b"oom_kill"] and b"\n" not in b)


# -- the counter files ---------------------------------------------------------------------------------
@settings(deadline=None)  # pure parsing, but a loaded machine must not fail it by time
@given(st.binary(max_size=2000))
def test_any_bytes_give_a_count_or_none(data):
    value = oom.parse_counter(data)
    assert value is None or 0 <= value < 10 ** oom.MAX_DIGITS


@settings(deadline=None)  # pure parsing, but a loaded machine must not fail it by time
@given(before=st.lists(st.tuples(NAMES, st.integers(0, 2**64 - 1)), max_size=30),
       after=st.lists(st.tuples(NAMES, st.integers(0, 2**64 - 1)), max_size=30),
       value=st.integers(0, 2**64 - 1))
def test_the_oom_kill_line_is_found_among_any_others(before, after, value):
    lines = [b"%s %d" % (k, v) for k, v in before] + [b"oom_kill %d" % value] + [b"%s %d" % (k, v) for k, v in after]
    assert oom.parse_counter(b"\n".join(lines) + b"\n") == value


@pytest.mark.parametrize(("data", "value"), [
    (b"oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", 3),  # cgroup v1 memory.oom_control
    (b"low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n", 2),  # cgroup v2 memory.events
    (b"pgfault 123\noom_kill 18446744073709551615\n", 2**64 - 1),  # /proc/vmstat, the largest counter
    (b"oom_kill_disable 0\nunder_oom 0\n", None),  # a kernel before 4.13: no such line
    (b"", None),
    (b"oom_kill -1\n", None), (b"oom_kill 1e3\n", None), (b"oom_kill\n", None), (b"oom_kill 1 2\n", None),
    (b"oom_kill " + b"9" * 21 + b"\n", None),  # longer than any 64-bit counter
    (b"oom_kill \xd9\xa3\n", None),  # an Arabic-Indic digit is not a kernel's digit
    (b"\xff\xfe\x00oom_kill 5\n", None), (b"\xff\xfe\x00\noom_kill 5", 5),
])
def test_counter_files_as_the_kernel_writes_them_and_broken_ones(data, value):
    assert oom.parse_counter(data) == value


# -- which file: /proc/self/cgroup and mountinfo ------------------------------------------------------
HYBRID_MOUNTS = (b"35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
                 b"41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
DOCKER_V1_MOUNTS = b"601 590 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
V2_MOUNTS = b"30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n"
ESCAPED_MOUNTS = b"30 23 0:26 / /mnt/cg\\040two rw shared:9 - cgroup2 none rw\n"


@pytest.mark.parametrize(("cgroups", "mounts", "expected"), [
    # this project's machine: cgroup v1's memory controller, a cgroup2 mount without it
    (b"4:memory:/process_api/x\n0::/\n", HYBRID_MOUNTS,
     ["/sys/fs/cgroup/memory/process_api/x/memory.oom_control", "/sys/fs/cgroup/unified/memory.events"]),
    # Docker on cgroup v1 without a cgroup namespace: the mount's root is the container's cgroup
    (b"9:memory:/docker/abc\n", DOCKER_V1_MOUNTS, ["/sys/fs/cgroup/memory/memory.oom_control"]),
    # cgroup v2 (Kubernetes, systemd): the cgroup's memory.events
    (b"0::/kubepods/pod1/c1\n", V2_MOUNTS, ["/sys/fs/cgroup/kubepods/pod1/c1/memory.events"]),
    (b"0::/\n", ESCAPED_MOUNTS, ["/mnt/cg two/memory.events"]),
    (b"5:cpu,memory:/a\n", b"", []),  # no mount of the hierarchy: only the machine's count
    (b"", b"", []),
])
def test_the_counter_of_this_processs_cgroup_comes_first(cgroups, mounts, expected):
    found = oom.candidates(cgroups, mounts)
    assert [path for path, _scope in found] == [*expected, oom.VMSTAT]
    assert [scope for _path, scope in found] == [
        "cgroup v1" if path.endswith("oom_control") else "cgroup v2" for path in expected] + [oom.MACHINE]


@settings(deadline=None)  # pure parsing, but a loaded machine must not fail it by time
@given(st.binary(max_size=600), st.binary(max_size=600))
def test_any_cgroup_and_mountinfo_bytes_give_candidates(cgroups, mounts):
    found = oom.candidates(cgroups, mounts)
    assert found[-1] == (oom.VMSTAT, oom.MACHINE) and 1 <= len(found) <= 3


def test_this_machines_counter_is_read():
    counter = oom.snapshot()
    assert counter is not None, "no OOM-kill counter here: /proc/vmstat has had oom_kill since Linux 4.13"
    assert counter.value >= 0 and os.path.basename(counter.path) in ("memory.oom_control", "memory.events", "vmstat")


def test_the_evidence_is_a_rise_of_the_same_file(tmp_path):
    path = tmp_path / "memory.oom_control"
    path.write_bytes(b"oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    before = oom.Counter(str(path), "cgroup v1", 3)
    assert oom.evidence(before) == ""
    path.write_bytes(b"oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    assert oom.evidence(before) == f"oom_kill 3 -> 4 in {path} (cgroup v1)"
    path.write_bytes(b"garbage")
    assert oom.evidence(before) == ""
    path.unlink()  # the cgroup was removed meanwhile
    assert oom.evidence(before) == "" and oom.evidence(None) == ""


# -- the verdict and the report -------------------------------------------------------------------------
def sigkilled(rank=1, exception="killed by SIGKILL"):
    return RootCause(rank, rank, -9, exception, "")


def test_a_sigkill_with_a_rise_is_out_of_memory_and_said_so(tmp_path):
    counter = tmp_path / "memory.events"
    counter.write_bytes(b"oom 1\noom_kill 1\n")
    before = oom.Counter(str(counter), "cgroup v2", 0)
    outcome = Outcome(1, 1)
    cause = report.out_of_memory(outcome, sigkilled(), before)
    assert cause.oom == f"oom_kill 0 -> 1 in {counter} (cgroup v2)"
    assert report.classify(outcome, cause, 137) == codes.OUT_OF_MEMORY
    assert report.code_of(codes.OUT_OF_MEMORY, 137) == 137
    cluster = Cluster(nnodes=1, node_rank=0, nproc_per_node=2, master_addr="algo-1", master_port=7777,
                      current_host="algo-1", platform="sagemaker")
    text = failure.compose_report(cluster, outcome, cause, 137)
    head = text.split("\n")[0]
    assert head == ("algo-1: rank 1 (local rank 1) ran out of memory: was killed by SIGKILL from the kernel's "
                    "OOM killer (exit code 137)")
    assert text.split("\n")[1].startswith("out of memory: the kernel's OOM killer sent SIGKILL (oom_kill 0 -> 1")
    verdict = report.own_verdict(codes.OUT_OF_MEMORY, 137, outcome, cause, text, "algo-1")
    assert (verdict.klass, verdict.signal, verdict.root_cause) == (codes.OUT_OF_MEMORY, "SIGKILL", head)
    # another host reads the class from the report's head, and the signal
    assert report.remote_class("failed", 137, text) == codes.OUT_OF_MEMORY
    remote = report.remote_verdict(verdict, "failed", "algo-1", 137, text)
    assert (remote.klass, remote.signal) == (codes.OUT_OF_MEMORY, "SIGKILL")
    # torchrun itself killed by the OOM killer
    torchrun = report.out_of_memory(Outcome(-9, 1), RootCause(None, None, None, "torchrun was killed by SIGKILL",
                                                              ""), before)
    assert torchrun.oom and failure.compose_report(cluster, Outcome(-9, 1), torchrun, 137).startswith(
        "algo-1: torchrun ran out of memory: ")


@pytest.mark.parametrize(("outcome", "cause"), [
    (Outcome(1, 1), sigkilled()),  # no rise: a SIGKILL from someone else
    (Outcome(1, 1), RootCause(1, 1, -15, "killed by SIGTERM", "")),
    (Outcome(1, 1), RootCause(1, 1, 7, "ValueError: x", "")),
    (Outcome(1, 1), RootCause(1, 1, -9, "killed by SIGKILL", "", asked=7)),  # it asked for 7 first
    (Outcome(1, 1, stop_signal=15), sigkilled()),  # stopped: the grace period's SIGKILL
    (Outcome(1, 1), None),
])
def test_no_rise_or_no_sigkill_is_not_out_of_memory(tmp_path, outcome, cause):
    counter = tmp_path / "memory.oom_control"
    counter.write_bytes(b"oom_kill 5\n")
    rose = oom.Counter(str(counter), "cgroup v1", 4)
    same = rose._replace(value=5)
    first = cause is not None and cause.exitcode == -9 and cause.asked is None and outcome.stop_signal is None
    assert report.out_of_memory(outcome, cause, same) == cause
    assert report.out_of_memory(outcome, cause, None) == cause
    assert (report.out_of_memory(outcome, cause, rose) != cause) == first


# -- real runs in memory cgroups (cgroup v1) --------------------------------------------------------------
def memory_cgroup_dir() -> str:
    """This process's cgroup v1 memory directory, where the tests may make cgroups; skip when there is none."""
    with open("/proc/self/cgroup", "rb") as fh:
        cgroups = fh.read()
    with open("/proc/self/mountinfo", "rb") as fh:
        mounts = fh.read()
    found = [path for path, scope in oom.candidates(cgroups, mounts) if scope == "cgroup v1"]
    directory = os.path.dirname(found[0]) if found else ""
    if not directory or not os.access(directory, os.W_OK):
        pytest.skip("needs a writable cgroup v1 memory controller (this project's machine has one)")
    return directory


class MemoryCgroup:
    """A memory cgroup of its own under this process's, with a limit; removed at the end (it must be empty)."""

    def __init__(self, limit_bytes: int) -> None:
        self.path = os.path.join(memory_cgroup_dir(), f"ddp-test-oom-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)
        for name, value in (("memory.limit_in_bytes", limit_bytes), ("memory.swappiness", 0)):
            with open(os.path.join(self.path, name), "w") as fh:
                fh.write(str(value))

    def oom_kills(self) -> int:
        with open(os.path.join(self.path, "memory.oom_control"), "rb") as fh:
            return oom.parse_counter(fh.read()) or 0

    def remove(self) -> None:
        """Remove it: fails (EBUSY) while a process is still in it."""
        os.rmdir(self.path)
        assert not os.path.exists(self.path)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *_exc: object) -> None:
        if os.path.exists(self.path):
            self.remove()


def run_job(tmp_path, worker_args, cgroup=None):
    """One host, one worker (oom_worker.py); the launcher started in ``cgroup`` (its processes inherit it)."""
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    env = launcher_env(SAGEMAKER_BASE_DIR=str(base), WORKER_RECORD_DIR=str(base / "records"),
                       LAUNCHER_MASTER_PORT=str(free_port()), LAUNCHER_RESOLVE="algo-1=127.0.0.1")
    argv = [PYTHON, "-m", "launcher", "--nproc-per-node", "1", OOM_WORKER, *worker_args]
    if cgroup is not None:  # the launcher's own process joins it before it starts (exec keeps the PID)
        argv = ["sh", "-c", f'echo $$ > {shlex.quote(cgroup.path)}/cgroup.procs && exec "$@"', "sh", *argv]
    proc = subprocess.run(argv, env=env, cwd=str(base), capture_output=True, text=True, timeout=300)
    data = validate_outcome(str(base / "output" / "data" / "outcome.json"))
    with open(base / "records" / "rank0.json") as fh:
        record = json.load(fh)
    return base, proc, data, record


def vmstat_oom_kills() -> int:
    with open(oom.VMSTAT, "rb") as fh:
        return oom.parse_counter(fh.read()) or 0


@pytest.mark.job
def test_a_worker_the_oom_killer_kills_is_out_of_memory(tmp_path):
    with MemoryCgroup(1 << 30) as cgroup:  # 1 GiB for the launcher, torchrun (torch imported) and the worker
        base, proc, data, record = run_job(tmp_path, ["--allocate"], cgroup)
        assert cgroup.oom_kills() >= 1, proc.stderr[-3000:]
        assert_gone(job_pids(None, base) | {record["pid"]})
        cgroup.remove()  # empty: nothing of the job is left in it
    assert proc.returncode == 137, proc.stderr[-3000:]
    head = "algo-1: rank 0 (local rank 0) ran out of memory: was killed by SIGKILL from the kernel's OOM killer"
    assert proc.stderr.rstrip().split("\n")[-1].startswith(head) or head in proc.stderr, proc.stderr[-3000:]
    assert (data["class"], data["exit_code"], data["signal"], data["rank"]) == ("out_of_memory", 137, "SIGKILL", 0)
    assert data["root_cause"].startswith(head) and not data["infrastructure"]
    assert data["exception"] == ("out of memory: the kernel's OOM killer sent SIGKILL (oom_kill 0 -> 1 in "
                                 f"{cgroup.path}/memory.oom_control (cgroup v1))")
    with open(base / "output" / "failure") as fh:
        assert fh.read().startswith(head)


@pytest.mark.job
def test_an_oom_kill_elsewhere_is_not_blamed_for_a_sigkill(tmp_path):
    machine = vmstat_oom_kills()
    with MemoryCgroup(64 << 20) as elsewhere:  # a process of our worker's, but in a cgroup of its own
        base, proc, data, record = run_job(tmp_path, ["--elsewhere", elsewhere.path])
        assert record["child_code"] == -9 and elsewhere.oom_kills() == 1, record
        assert_gone(job_pids(None, base) | {record["pid"], record["child"]})
        elsewhere.remove()
    assert vmstat_oom_kills() > machine  # the machine's count rose: reading it alone would have blamed it
    assert proc.returncode == 137, proc.stderr[-3000:]
    assert (data["class"], data["signal"]) == ("worker_signal", "SIGKILL"), data
    assert "out of memory" not in proc.stderr and "killed by SIGKILL (exit code 137)" in data["root_cause"]
