"""Out of memory told apart from any other SIGKILL (launcher/oom.py, the ``out_of_memory`` class).

Parsers of the kernel's counter files, its log (/dev/kmsg) and of /proc/self/cgroup and mountinfo
(hypothesis: bad bytes, missing lines, huge numbers); the evidence read from real files; the victim and
the limit from a cgroup v1 and a v2 tree of files; the verdict and report of a cause with evidence,
here and on another host. Real runs (cgroup v1 with a memory controller, root): a worker the OOM killer
kills in a memory-limited cgroup made for the job -> "out of memory" in the report and the outcome;
rank 1's DataLoader worker killed so in a 2-rank DDP job -> named, with its pid, rank and the limit;
an OOM kill in another cgroup while our worker dies of SIGKILL -> not blamed.
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
OOM_LOADER = os.path.join(REPO, "tests", "scripts", "oom_loader.py")
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
    assert (counter.log is not None) == oom.readable()  # marked at the kernel log's end, where it can be read


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
LOADER_LIMIT = 3 << 29  # 1.5 GiB: the launcher, torchrun and 2 ranks with torch, and the loader's worker
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


def run_job(tmp_path, worker_args, cgroup=None, script=OOM_WORKER, nproc=1, record="rank0.json"):
    """One host, ``nproc`` workers of ``script``; the launcher started in ``cgroup`` (its processes inherit it)."""
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    env = launcher_env(SAGEMAKER_BASE_DIR=str(base), WORKER_RECORD_DIR=str(base / "records"),
                       LAUNCHER_MASTER_PORT=str(free_port()), LAUNCHER_RESOLVE="algo-1=127.0.0.1")
    argv = [PYTHON, "-m", "launcher", "--nproc-per-node", str(nproc), script, *worker_args]
    if cgroup is not None:  # the launcher's own process joins it before it starts (exec keeps the PID)
        argv = ["sh", "-c", f'echo $$ > {shlex.quote(cgroup.path)}/cgroup.procs && exec "$@"', "sh", *argv]
    proc = subprocess.run(argv, env=env, cwd=str(base), capture_output=True, text=True, timeout=300)
    data = validate_outcome(str(base / "output" / "data" / "outcome.json"))
    with open(base / "records" / record) as fh:
        found = json.load(fh)
    return base, proc, data, found


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
    assert data["root_cause"].endswith(f"cgroup limit 1 GiB of {cgroup.path}) (exit code 137)"), data["root_cause"]
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


@pytest.mark.job
def test_a_dataloader_worker_the_oom_killer_kills_is_named_with_its_rank_and_the_limit(tmp_path):
    """2 ranks (gloo); rank 1's DataLoader worker allocates until the OOM killer kills it in the job's cgroup."""
    with MemoryCgroup(LOADER_LIMIT) as cgroup:
        base, proc, data, loader = run_job(tmp_path, ["--victim", "1"], cgroup, OOM_LOADER, 2, "loader.json")
        assert cgroup.oom_kills() >= 1, proc.stderr[-3000:]
        assert_gone(job_pids(None, base) | {loader["pid"]})
        cgroup.remove()
    with open(base / "output" / "failure") as fh:
        head = fh.read().split("\n")[0]
    assert loader["rank"] == 1 and proc.returncode == 137, proc.stderr[-3000:]
    assert head.startswith("algo-1: rank 1 (local rank 1) ran out of memory: the kernel's OOM killer killed its "
                           f"DataLoader worker (pid {loader['pid']}"), head
    assert head.endswith(f"; cgroup limit 1.5 GiB of {cgroup.path}) (exit code 137)"), head
    if oom.readable():  # the kernel's log names it too: PyTorch names its loader processes so
        assert f"(pid {loader['pid']}, pt_data_worker;" in head, head
    assert (data["class"], data["exit_code"], data["signal"], data["rank"]) == ("out_of_memory", 137, "SIGKILL", 1)
    assert data["root_cause"] == head and data["exception"].startswith("out of memory: the kernel's OOM killer")
    assert "DataLoader worker (pid" in proc.stderr  # PyTorch's own words stay in the report's tail


# -- which process, and the limit: the kernel's log and a cgroup tree of files (v1 and v2) -------------------
def kmsg_kill(seq, pid, name, memcg, oom_memcg="/job"):
    """The two records the kernel logs for one OOM kill in a memory cgroup (Linux 5.x and 6.x wording)."""
    return (f"6,{seq},1000,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
            f"oom_memcg={oom_memcg},task_memcg={memcg},task={name},pid={pid},uid=0\n"
            f"3,{seq + 1},1001,-;Memory cgroup out of memory: Killed process {pid} ({name}) total-vm:2097152kB, "
            f"anon-rss:1048576kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:2100kB oom_score_adj:1000\n")


def test_the_kernel_logs_kills_are_parsed_with_their_cgroup():
    data = ("5,1,0,-;Linux version 6.1\n" + kmsg_kill(10, 4242, "pt_data_worker", "/job/rank1")
            + "3,20,2000,-;Out of memory: Killed process 77 (my, odd) name) total-vm:10kB, anon-rss:1kB\n"
            + " SUBSYSTEM=memory\n").encode()
    assert oom.parse_kmsg(data) == [oom.Kill(11, 4242, "pt_data_worker", "/job/rank1"),
                                    oom.Kill(20, 77, "my, odd) name", None)]


@settings(deadline=None)  # pure parsing, but a loaded machine must not fail it by time
@given(st.binary(max_size=2000))
def test_any_kernel_log_bytes_give_kills_or_none(data):
    for kill in oom.parse_kmsg(data):
        assert kill.pid < 10 ** 10 and kill.seq < 10 ** oom.MAX_DIGITS


def v2_tree(tmp_path, kills=0):
    """A cgroup v2 hierarchy of files: the root (no memory.max), job (512 MiB), job/rank1 (max)."""
    (tmp_path / "job" / "rank1").mkdir(parents=True)
    (tmp_path / "job" / "memory.max").write_text("536870912\n")
    (tmp_path / "job" / "rank1" / "memory.max").write_text("max\n")
    events = tmp_path / "job" / "rank1" / "memory.events"
    events.write_text(f"low 0\nhigh 0\nmax 40\noom 1\noom_kill {kills}\noom_group_kill 0\n")
    return events


def test_the_limit_is_the_smallest_of_the_cgroup_and_those_above(tmp_path):
    events = v2_tree(tmp_path)
    assert oom.memory_limit(oom.Counter(str(events), "cgroup v2", 0)) == f"512 MiB of {tmp_path / 'job'}"
    v1 = tmp_path / "memory" / "job"
    v1.mkdir(parents=True)
    for directory, value in ((v1.parent, "9223372036854771712"), (v1, "9223372036854771712")):
        (directory / "memory.limit_in_bytes").write_text(value + "\n")
    control = v1 / "memory.oom_control"
    assert oom.memory_limit(oom.Counter(str(control), "cgroup v1", 0)) == "none"
    (v1 / "memory.limit_in_bytes").write_text("1610612736\n")
    assert oom.memory_limit(oom.Counter(str(control), "cgroup v1", 0)) == f"1.5 GiB of {v1}"
    assert oom.memory_limit(oom.Counter(oom.VMSTAT, oom.MACHINE, 0)) == ""
    assert [oom.size_text(v) for v in (512, 4096, 3 << 29)] == ["512 B", "4 KiB", "1.5 GiB"]


EARLIER = kmsg_kill(2, 555, "tokenizer", "/job/rank1")  # logged before the generation started
LOADER_ERROR = ("Traceback (most recent call last):\nRuntimeError: DataLoader worker (pid(s) 4242) exited "
                "unexpectedly")


@pytest.mark.parametrize(("log", "text", "killed", "what"), [
    # the kernel's log names the DataLoader worker PyTorch named: its name too
    (kmsg_kill(10, 4242, "pt_data_worker", "/job/rank1"), LOADER_ERROR, False,
     "the kernel's OOM killer killed its DataLoader worker (pid 4242, pt_data_worker; cgroup limit 512 MiB of {job})"),
    # no kernel log to read (no root, dmesg_restrict): PyTorch's message alone names the pid
    (None, "DataLoader worker (pid 4242) is killed by signal: Killed.", False,
     "the kernel's OOM killer killed its DataLoader worker (pid 4242; cgroup limit 512 MiB of {job})"),
    # another process of the job's cgroup (a subprocess the rank started): the kernel's log names it
    (kmsg_kill(10, 555, "tokenizer", "/job/rank1/sub"), "subprocess.CalledProcessError: ... died with "
     "<Signals.SIGKILL: 9>.", False, "the kernel's OOM killer killed process 555 (tokenizer) of the job "
     "(cgroup limit 512 MiB of {job})"),
    (None, "subprocess.CalledProcessError: ... died with <Signals.SIGKILL: 9>.", False,
     "the kernel's OOM killer killed a process of it (cgroup limit 512 MiB of {job})"),
    # the rank itself: torchrun's "received by PID" matches the kernel's log
    (kmsg_kill(10, 31, "python3", "/job/rank1") + kmsg_kill(12, 32, "python3", "/job/rank1"),
     "Signal 9 (SIGKILL) received by PID 32", True,
     "was killed by SIGKILL from the kernel's OOM killer (pid 32, python3; cgroup limit 512 MiB of {job})"),
    (None, "", True, "was killed by SIGKILL from the kernel's OOM killer (cgroup limit 512 MiB of {job})"),
    # a kill logged before the job started (EARLIER), or in a cgroup beside this one: not ours
    ("", "ValueError: x", False, None),
    (kmsg_kill(10, 555, "other", "/job/rank10"), "ValueError: x", False, None),
    (None, "ValueError: x", False, None),
])
def test_the_victim_is_named_from_what_is_known(tmp_path, log, text, killed, what):
    events = v2_tree(tmp_path, kills=1)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(EARLIER)
    mark = oom.KernelLog.mark(str(kmsg)) if log is not None else None  # None: no log to read
    with open(kmsg, "a") as fh:
        fh.write(log or "")
    before = oom.Counter(str(events), "cgroup v2", 0, "/job/rank1", mark)
    found = oom.explain(before, text, killed)
    expected = None if what is None else (f"oom_kill 0 -> 1 in {events} (cgroup v2)",
                                          what.format(job=tmp_path / "job"))
    assert found == expected
    assert oom.explain(before._replace(value=1), text, killed) is None  # no rise: never blamed
    assert oom.explain(before, text, killed) == expected  # the kills read stay for the next look


def test_with_the_machines_count_only_a_named_process_is_blamed(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 1\noom_kill 9\n")
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    mark = oom.KernelLog.mark(str(kmsg))
    kmsg.write_text(kmsg_kill(10, 555, "elsewhere", "/other"))
    before = oom.Counter(str(vmstat), oom.MACHINE, 8, "/", mark)
    assert oom.explain(before, "died with <Signals.SIGKILL: 9>.", False) is None
    assert oom.explain(before, LOADER_ERROR, False) == (
        f"oom_kill 8 -> 9 in {vmstat} (the whole machine)", "the kernel's OOM killer killed its DataLoader worker "
        "(pid 4242)")


def test_a_dataloader_workers_oom_kill_is_the_ranks_out_of_memory_in_the_report(tmp_path):
    events = v2_tree(tmp_path, kills=1)
    before = oom.Counter(str(events), "cgroup v2", 0, "/job/rank1")
    outcome = Outcome(1, 1)
    cause = report.out_of_memory(outcome, RootCause(1, 1, 1, LOADER_ERROR.split("\n")[-1], LOADER_ERROR), before)
    assert report.classify(outcome, cause, 1) == codes.OUT_OF_MEMORY
    cluster = Cluster(nnodes=2, node_rank=1, nproc_per_node=1, master_addr="algo-1", master_port=7777,
                      current_host="algo-2", platform="sagemaker")
    text = failure.compose_report(cluster, outcome, cause, 137)
    assert text.split("\n")[0] == (
        "algo-2: rank 1 (local rank 1) ran out of memory: the kernel's OOM killer killed its DataLoader worker "
        f"(pid 4242; cgroup limit 512 MiB of {tmp_path / 'job'}) (exit code 137)")
    assert text.split("\n")[-1] == LOADER_ERROR.split("\n")[-1]  # PyTorch's own words stay in the tail
    assert report.remote_class("failed", 137, text) == codes.OUT_OF_MEMORY
    # stopped by the job, or torchrun failing otherwise: never out of memory
    assert report.out_of_memory(Outcome(1, 1, stop_signal=15), cause._replace(oom=""), before).oom == ""
    torchrun = RootCause(None, None, None, "torchrun failed", LOADER_ERROR)
    assert report.out_of_memory(Outcome(1, 1), torchrun, before) == torchrun
