"""The kernel's word on each worker's end (launcher/deaths.py), and what the root cause makes of it.

A real parent process starts real children, as torchrun starts its workers, each with RANK and LOCAL_RANK; the
test ends them one at a time in every way that writes no exit record (SIGKILL, os._exit, SIGSEGV, SIGABRT) and one
clean end, and checks each death's moment, code and rank. Then torchrun's failure table, exit records and deaths
together: the first failure in time wins both ways round, and a torchrun stopped before its table still names
the worker that failed first.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import PYTHON, REPO, assert_gone

from launcher import failure, proctree
from launcher.command import Launch
from launcher.deaths import PRIORITY, Deaths
from launcher.outcome import Death, Outcome

# Each child waits for a line on its stdin, then ends its own way.
ENDS = {
    "sigkill": "os.kill(os.getpid(), signal.SIGKILL)",
    "os_exit": "os._exit(3)",
    "sigsegv": "os.kill(os.getpid(), signal.SIGSEGV)",
    "abort": "os.abort()",
    "clean": "sys.exit(0)",
}
CODES = {"sigkill": -signal.SIGKILL, "os_exit": 3, "sigsegv": -signal.SIGSEGV, "abort": -signal.SIGABRT, "clean": 0}
PARENT = """
import os, subprocess, sys
ends = sys.argv[1:]
kids = []
for rank, end in enumerate(ends):
    code = "import os, signal, sys; sys.stdin.readline(); " + end
    env = {**os.environ, "RANK": str(rank + 10), "LOCAL_RANK": str(rank)}
    kids.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env=env))
print(" ".join(str(k.pid) for k in kids), flush=True)
for kid in kids:  # from the test: a line to end the next child, another to reap it (torchrun looks 10 times a second)
    sys.stdin.readline()
    kid.stdin.write(b"go\\n")
    kid.stdin.flush()
    sys.stdin.readline()
    kid.wait()
    print(kid.pid, flush=True)
"""


def watched(deaths: Deaths) -> set[int]:
    """The pids the watcher process holds a pidfd for (its ``/proc/PID/fdinfo``'s ``Pid:`` line)."""
    pids, proc = set(), f"/proc/{deaths.watcher.pid}"
    for fd in os.listdir(f"{proc}/fd"):
        try:
            if os.readlink(f"{proc}/fd/{fd}") != "anon_inode:[pidfd]":
                continue
            with open(f"{proc}/fdinfo/{fd}") as fh:
                pids.update(int(line.split()[1]) for line in fh if line.startswith("Pid:"))
        except OSError:
            continue
    return pids


@contextlib.contextmanager
def parent_process(code: str, *args: str) -> Iterator[subprocess.Popen]:
    """A process running ``code`` (stdin and stdout on text pipes) that stands for torchrun; killed at the end
    if it still runs."""
    parent = subprocess.Popen([PYTHON, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield parent
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.005)


def test_every_way_a_worker_ends_is_dated_with_its_code_and_rank() -> None:
    names = list(ENDS)
    pids: list[int] = []
    with parent_process(PARENT, *ENDS.values()) as parent:
        fds, threads = set(os.listdir("/proc/self/fd")), threading.active_count()
        deaths = Deaths(parent.pid, len(names))
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        marks = []
        for pid in pids:
            wait_for(lambda: pid in watched(deaths), f"a pidfd for {pid}")  # noqa: B023 (used at once)
            marks.append(time.time())
            parent.stdin.write("end\n")
            parent.stdin.flush()
            wait_for(lambda: pid in deaths.ended(), f"the death of {pid}")  # noqa: B023
            parent.stdin.write("reap\n")
            parent.stdin.flush()
            assert int(parent.stdout.readline()) == pid
        ended = deaths.stop()
        assert set(os.listdir("/proc/self/fd")) == fds and threading.active_count() == threads  # nothing left
        assert deaths.watcher.returncode == 0
        parent.stdin.close()
        assert parent.wait(timeout=30) == 0
    assert sorted(ended) == sorted(pids)
    for index, (pid, name) in enumerate(zip(pids, names)):
        death = ended[pid]
        assert death.code == CODES[name], (name, death)
        assert (death.rank, death.local_rank) == (index + 10, index), (name, death)
        assert death.at >= marks[index], (name, death, marks[index])
        if index + 1 < len(pids):  # dated before the next child was told to end
            assert death.at <= marks[index + 1], (name, death, marks[index + 1])
    assert_gone([parent.pid, *pids, deaths.watcher.pid])


def test_a_process_that_is_not_the_parents_child_is_never_watched() -> None:
    other = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(30)"])
    parent = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(30)"])
    try:
        deaths = Deaths(parent.pid, 1)
        time.sleep(0.2)
        other.kill()
        other.wait()
        assert deaths.stop() == {}
    finally:
        for proc in (other, parent):
            proc.kill()
            proc.wait()
    assert_gone([deaths.watcher.pid])


def test_deaths_just_before_the_stop_are_all_said() -> None:
    """Workers killed the moment before the launcher stops watching (its last kill of the tree) are in the
    result: the watcher says every death it sees before it heeds its closed stdin."""
    code = ("import os, subprocess, sys\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " env={**os.environ, 'RANK': str(r), 'LOCAL_RANK': str(r)}) for r in range(4)]\n"
            "print(' '.join(str(k.pid) for k in kids), flush=True)\nsys.stdin.readline()\n"
            "[k.wait() for k in kids]\n")
    with parent_process(code) as parent:
        deaths = Deaths(parent.pid, 4)
        kids = [int(pid) for pid in parent.stdout.readline().split()]
        wait_for(lambda: watched(deaths) == set(kids), "a pidfd for every worker")
        watcher = deaths.pids()[0]
        os.kill(watcher, signal.SIGSTOP)  # held still: its next look finds the deaths and the closed stdin at once
        wait_for(lambda: proctree.stat_fields(watcher)[0] == b"T", "the watcher stopped")
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all((proctree.stat_fields(pid) or [b"Z"])[0] == b"Z" for pid in kids), "every worker a zombie")
        deaths.watcher.stdin.close()
        os.kill(watcher, signal.SIGCONT)
        ended = deaths.stop()
        parent.stdin.write("reap\n")
        parent.stdin.flush()
        assert parent.wait(timeout=30) == 0
    assert sorted(ended) == sorted(kids) and all(d.code == -signal.SIGKILL for d in ended.values()), ended
    assert_gone([parent.pid, *kids, *deaths.pids()])


def test_the_watcher_ends_with_the_launcher_that_started_it() -> None:
    """A launcher killed (SIGKILL: no stop()) leaves no watcher: its stdin closes with the launcher."""
    code = ("import subprocess, sys, time; sys.path.insert(0, sys.argv[1]); from launcher.deaths import Deaths; "
            "torchrun = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "deaths = Deaths(torchrun.pid, 1); print(torchrun.pid, deaths.watcher.pid, flush=True); time.sleep(60)")
    launcher = subprocess.Popen([PYTHON, "-c", code, REPO], stdout=subprocess.PIPE, text=True)
    try:
        torchrun, watcher = (int(pid) for pid in launcher.stdout.readline().split())
    finally:
        launcher.kill()
        launcher.wait()
    os.kill(torchrun, signal.SIGKILL)
    assert_gone([watcher, torchrun])


# --- the first failure in time, from the table, the exit records and the deaths ---------------------

TABLE = """\
Failures:
[1]:
  time      : 2026-11-28_18:00:00
  host      : algo-2
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 4462)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4462
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_18:00:00
  host      : algo-2
  rank      : 2 (local_rank: 0)
  exitcode  : 1 (pid: 4461)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================""".splitlines()


def launch_in(tmp_path: Any) -> Launch:
    fields = {"argv": (), "env_changes": {}, "env_removed": (), "run_dir": str(tmp_path),
              "error_file": str(tmp_path / "torchrun_error.json"), "log_dir": str(tmp_path / "logs")}
    launch = Launch(**{k: v for k, v in fields.items() if k in Launch._fields})
    os.makedirs(launch.exit_dir, exist_ok=True)
    return launch


def record(launch: Launch, pid: int, code: int, at: float) -> None:
    path = os.path.join(launch.exit_dir, f"{pid}.json")
    with open(path, "w") as fh:
        fh.write(json.dumps({"code": code, "stderr_offset": 0, "started": 0}))
    os.utime(path, (at, at))


@pytest.mark.parametrize("shape", ["killed-first", "killed-first-stamped-late", "raised-first"])
def test_the_first_failure_in_time_wins_between_a_record_and_a_death(tmp_path: Any, shape: str) -> None:
    launch, now = launch_in(tmp_path), time.time()
    record(launch, 4461, 1, now - 1.0)  # rank 2 raised; it died 0.5 s later (its teardown)
    # rank 3 was killed: long before; 2 ms before rank 2's record but its stamp 20 ms late; or after rank 2 died
    died = {"killed-first": now - 1.5, "killed-first-stamped-late": now - 1.002 + 0.02,
            "raised-first": now - 0.5 + 0.002}[shape]
    killed_first = shape != "raised-first"
    deaths = {4462: Death(died, -9, 3, 1), 4461: Death(now - 0.5, 1, 2, 0)}
    outcome = Outcome(returncode=1, pid=1, stderr_tail=TABLE, deaths=deaths)
    cause = failure.find_root_cause(outcome, launch)
    assert (cause.rank, cause.exitcode) == ((3, -9) if killed_first else (2, 1))
    assert cause.at == pytest.approx(died if killed_first else now - 1.0, abs=0.01)
    ended = time.monotonic()
    first = failure.first_failure(outcome, launch.exit_dir, ended)
    assert ended - first == pytest.approx(time.time() - (died if killed_first else now - 1.0), abs=0.05)


@pytest.mark.parametrize("text, lost", [
    # gloo (third_party/gloo/gloo/transport/tcp/pair.cc), as torch 2.8 prints it here
    ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
     "[127.0.0.1]:49297. This is typically caused by a remote worker crashing.", True),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:6301: Connection reset "
     "by peer", True),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Write error [10.0.0.2]:6301: Broken pipe",
     True),
    # NCCL's ncclRemoteError, through torch's DistBackendError
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, remote "
     "process exited or there was a network error, NCCL version 2.21.5", True),
    ("torch.distributed.DistNetworkError: failed to recv, got 0 bytes", True),  # TCPStore's client
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("OSError: [Errno 28] No space left on device", False),
    ("ValueError: bad batch on rank 1 at step 3", False),
])
def test_a_lost_peer_is_read_in_the_words_gloo_nccl_and_the_store_use(text: str, lost: bool) -> None:
    assert bool(failure.LOST_PEER.search(text)) is lost


@pytest.mark.parametrize("shape", ["ended-first", "ended-first-no-record", "ended-after", "stopped", "own-error"])
def test_a_rank_that_ended_cleanly_before_the_failure_is_said_beside_it(tmp_path: Any, shape: str) -> None:
    # A rank with fewer batches ends its script (exit code 0); its connections close with it, and its peer, still
    # in a collective, fails on them ("Connection closed by peer ... typically caused by a remote worker
    # crashing"): the report named the peer's exception and nothing else. The clean end comes first in time: it is
    # said on the line after the exception, the head unchanged; a clean end after the failure (the job ending) or
    # a stopped job, or a failure of the rank's own (not a lost peer), says nothing of it.
    from launcher.cluster import Cluster

    launch, now = launch_in(tmp_path), time.time()
    root = TABLE[TABLE.index("Root Cause (first observed failure):"):]
    table = ["Failures:", "  <NO_OTHER_FAILURES>", "-" * 60, *root]
    log = tmp_path / "logs" / "job" / "attempt_0" / "0" / "stderr.log"  # rank 2's, as torchrun keeps it
    log.parent.mkdir(parents=True)
    log.write_text("Traceback (most recent call last):\n  File \"train.py\", line 40, in <module>\n"
                   "    dist.all_reduce(t)\n"
                   + ("OSError: [Errno 28] No space left on device\n" if shape == "own-error" else
                      "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                      "[10.0.1.17]:41205. This is typically caused by a remote worker crashing.\n"))
    with open(os.path.join(launch.exit_dir, "4461.json"), "w") as fh:  # rank 2 raised (the peer's exception)
        json.dump({"code": 1, "stderr_offset": 0, "started": now - 30, "ended": now - 1.0}, fh)
    ended = now - (0.5 if shape == "ended-after" else 1.6)
    if shape != "ended-first-no-record":
        with open(os.path.join(launch.exit_dir, "4462.json"), "w") as fh:  # rank 3 ended cleanly
            json.dump({"code": 0, "stderr_offset": 0, "started": now - 30, "ended": ended}, fh)
    deaths = {4462: Death(ended + (0.0 if shape == "ended-first-no-record" else 0.58), 0, 3, 1),
              4461: Death(now - 0.5, 1, 2, 0)}
    outcome = Outcome(returncode=1, pid=1, stderr_tail=table, deaths=deaths,
                      stop_signal=signal.SIGTERM if shape == "stopped" else None)
    cause = failure.find_root_cause(outcome, launch)
    assert (cause.rank, cause.exitcode) == (2, 1)
    cluster = Cluster(platform="sagemaker", nnodes=2, node_rank=1, nproc_per_node=2, current_host="algo-2",
                      master_addr="algo-1", master_port=7777)
    report = failure.compose_report(cluster, outcome._replace(stop_signal=None), cause, 1).splitlines()
    assert report[0] == "algo-2: rank 2 (local rank 0) exited with code 1"
    if shape in ("ended-after", "stopped", "own-error"):
        assert cause.note == "" and not any("exit code 0" in line for line in report), report
        return
    assert report[1].startswith("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection")
    assert cause.note == report[2] == (
        "rank 3 (local rank 1) had ended its script with exit code 0, 0.6 s before: a rank that ends while the "
        "others still run collectives closes its connections, and they fail on them (does every rank run the same "
        "number of steps?)"), report


def test_without_deaths_a_worker_without_a_record_still_comes_first(tmp_path: Any) -> None:
    launch = launch_in(tmp_path)
    record(launch, 4461, 1, time.time())
    cause = failure.find_root_cause(Outcome(returncode=1, pid=1, stderr_tail=TABLE), launch)
    assert (cause.rank, cause.exitcode, cause.at) == (3, -9, None)


@pytest.mark.parametrize("code", [-signal.SIGKILL, -signal.SIGSEGV, 3])
def test_a_torchrun_stopped_before_its_table_names_the_worker_that_died_before_the_stop(tmp_path: Any,
                                                                                       code: int) -> None:
    launch, now = launch_in(tmp_path), time.time()
    deaths = {7001: Death(now - 2.0, code, 5, 1),  # its own end, before the stop
              7000: Death(now - 0.5, -signal.SIGTERM, 4, 0)}  # the stop's
    outcome = Outcome(returncode=-signal.SIGKILL, pid=1, stop_signal=signal.SIGTERM, deaths=deaths,
                      stopped_at=now - 1.0)
    cause = failure.find_root_cause(outcome, launch)
    assert (cause.rank, cause.local_rank, cause.exitcode) == (5, 1, code)
    assert failure.failed_before_stop(outcome, cause)
    # every death after the stop: torchrun killed by the launcher, as before
    late = outcome._replace(deaths={7001: deaths[7001]._replace(at=now - 0.2), 7000: deaths[7000]})
    cause = failure.find_root_cause(late, launch)
    assert cause.rank is None and not failure.failed_before_stop(late, cause)


FORKS = """
import os, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # no RANK: not a worker
pid = os.fork()
if pid == 0:  # a worker forked, and exec'd only later (torchrun's Popen between its fork and its exec)
    time.sleep(0.5)
    env = {**os.environ, "RANK": "7", "LOCAL_RANK": "1"}
    os.execve(sys.executable, [sys.executable, "-c", "import os, time; time.sleep(0.5); os._exit(5)"], env)
print(helper.pid, pid, flush=True)
sys.stdin.readline()  # the test has seen the death: reap
os.waitpid(pid, 0)
helper.kill()
helper.wait()
"""


def test_only_workers_are_watched_even_one_seen_before_its_exec() -> None:
    with parent_process(FORKS) as parent:
        deaths = Deaths(parent.pid, 1)
        helper, worker = (int(pid) for pid in parent.stdout.readline().split())
        wait_for(lambda: worker in deaths.ended(), "the worker's death")
        parent.stdin.write("reap\n")
        parent.stdin.flush()
        assert parent.wait(timeout=30) == 0
        ended = deaths.stop()
    assert list(ended) == [worker] and (ended[worker].code, ended[worker].rank) == (5, 7), ended
    assert_gone([parent.pid, helper, worker])


def test_the_watcher_runs_ahead_of_busy_processes_where_it_may() -> None:
    """Its stamp is the death's time only if it runs as soon as it wakes: on a host whose cores are busy it is
    PRIORITY nice levels above the launcher's where that is permitted (root here, as in the platforms' containers),
    else at the launcher's own."""
    parent = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(30)"])
    try:
        deaths = Deaths(parent.pid, 1)
        watcher = deaths.pids()[0]
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        wait_for(lambda: os.getpriority(os.PRIO_PROCESS, watcher) != mine or os.geteuid() != 0, "its priority")
        expected = max(-20, mine - PRIORITY) if os.geteuid() == 0 else mine
        assert os.getpriority(os.PRIO_PROCESS, watcher) == expected
        deaths.stop()
    finally:
        parent.kill()
        parent.wait()
    assert_gone([parent.pid, watcher])
