"""The job watch: the launchers of one job watch each other (launcher/jobwatch.py).

Protocol tests run a real hub and real clients on 127.0.0.1 (threads in this process, or a client in a
subprocess paused with SIGSTOP: a silent peer). Job tests run two real launchers with torchrun (gloo,
CPU) on SageMaker trees and fault one host. Every test that starts a process proves by PID that none is
left; the in-process ones prove that their watch threads ended.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest
from conftest import PYTHON, REPO, assert_gone, free_port, is_alive, launcher_env
from test_launcher_processes import make_host, records, wait_for_records

from launcher import jobwatch, proctree

WORKER = os.path.join(REPO, "tests", "scripts", "launcher_worker.py")
TIMEOUT = 1.5  # heartbeat timeout of the protocol tests (heartbeats every 0.5 s)


class Recorder:
    """A log and a stop hook that remember what they were given (the watch's two outputs)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.stops: list[tuple[float, str]] = []

    def log(self, line: str) -> None:
        self.lines.append(line)

    def stop(self, grace: float, why: str) -> None:
        self.stops.append((grace, why))


def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


@pytest.fixture
def watches():
    """Start watches on one port; close every one at the end and prove their threads ended."""
    started: list[jobwatch.Watch] = []
    port = free_port()

    def make(node: int, nnodes: int = 3, connect_for: float = 30.0) -> tuple[jobwatch.Watch, Recorder]:
        rec = Recorder()
        watch = jobwatch.start(node, f"algo-{node + 1}", nnodes, "127.0.0.1", port, TIMEOUT, connect_for, rec.log)
        assert watch is not None, rec.lines
        watch.attach(rec.stop)
        started.append(watch)
        return watch, rec

    make.port = port
    yield make
    for watch in started:
        watch.close()
        assert not watch.thread.is_alive()
    socket.create_server(("", port)).close()  # the hub no longer listens


def joined(watch: jobwatch.Watch) -> bool:
    return watch.connected()


def test_a_failure_is_relayed_to_every_host_and_stops_it(watches):
    hub, hub_rec = watches(0)
    one, one_rec = watches(1)
    two, two_rec = watches(2)
    until(lambda: joined(one) and joined(two) and len(hub.states) == 2)
    report = "algo-3: rank 4 (local rank 0) exited with code 7\nValueError: bad batch\n  File x.py, line 3"
    code, text = two.finish(7, report, primary=True)
    assert (code, text) == (7, report)  # the cause itself reports only itself
    for watch, rec in ((hub, hub_rec), (one, one_rec)):
        until(lambda w=watch: w.cause() is not None)
        cause = watch.cause()
        assert (cause.kind, cause.node, cause.host, cause.code) == ("failed", 2, "algo-3", 7)
        assert cause.report == "algo-3: rank 4 (local rank 0) exited with code 7\nValueError: bad batch"
        assert rec.stops and rec.stops[0][0] == jobwatch.REMOTE_GRACE
        assert "algo-3: rank 4 (local rank 0) exited with code 7" in rec.stops[0][1]
    # host 2's own workers failed because of it (a collective lost its peer): the job's cause comes first
    code, text = one.finish(1, "algo-2: rank 2 (local rank 0) exited with code 1\nRuntimeError: Connection "
                            "closed by peer [127.0.0.1]:5", primary=False)
    assert code == 7
    assert text.splitlines()[:3] == ["algo-3: rank 4 (local rank 0) exited with code 7", "ValueError: bad batch",
                                     "then algo-2: rank 2 (local rank 0) exited with code 1"]
    code, text = hub.finish(0, "", primary=True)  # the hub's workers had finished: it waited for the others
    assert code == 0 and hub.states == {1: "failed", 2: "failed"}


def test_a_silent_peer_is_lost_after_the_heartbeat_timeout(watches, tmp_path):
    """A client in a subprocess, paused with SIGSTOP: its packets stop, its socket stays open."""
    hub, rec = watches(0, nnodes=2)
    script = ("import sys, time; from launcher import jobwatch\n"
              f"w = jobwatch.start(1, 'algo-2', 2, '127.0.0.1', {watches.port}, {TIMEOUT}, 30.0, print)\n"
              "time.sleep(600)\n")
    client = subprocess.Popen([PYTHON, "-c", script], env=launcher_env(), stdout=subprocess.PIPE, text=True)
    try:
        until(lambda: hub.states == {1: "running"})
        time.sleep(2 * TIMEOUT)  # heartbeats keep a live peer: no loss
        assert hub.cause() is None
        client.send_signal(signal.SIGSTOP)
        paused = time.monotonic()
        until(lambda: hub.cause() is not None)
        waited = time.monotonic() - paused
        assert hub.cause().report == f"algo-2 lost: no heartbeat for {TIMEOUT:g} s"
        assert hub.cause().code == jobwatch.LOST_CODE and hub.states == {1: "lost"}
        assert TIMEOUT - TIMEOUT / 3 - 0.1 <= waited <= TIMEOUT + 1.0, waited  # the last heartbeat came before
        assert rec.stops and "algo-2 lost: no heartbeat" in rec.stops[0][1]
    finally:
        client.kill()
        client.send_signal(signal.SIGCONT)
        client.communicate(timeout=10)
    assert_gone([client.pid])


def raw_client(port: int, hello: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if hello:
        sock.sendall(b'{"t":"hello","node":1,"host":"algo-2","nnodes":2}\n')
        assert json.loads(sock.makefile().readline())["t"] == "hello"
    return sock


@pytest.mark.parametrize("garbage", [b"not json\n", b"[1, 2]\n", b'{"t": "failed", "code": "x"}\n',
                                     b"x" * (jobwatch.MAX_LINE + 10), b"[" * 3000 + b"\n",
                                     b'{"t":"failed","code":1e400,"report":"","primary":true}\n'])
def test_a_peer_that_sends_garbage_is_dropped_as_lost(watches, garbage):
    hub, _rec = watches(0, nnodes=2)
    with raw_client(watches.port) as sock:
        sock.sendall(garbage)
        until(lambda: hub.cause() is not None)
    assert hub.cause().report == "algo-2 lost: sent garbage" and hub.thread.is_alive()


def test_a_stranger_before_the_handshake_is_no_loss(watches):
    hub, _rec = watches(0, nnodes=2)
    for junk in (b"GET / HTTP/1.0\r\n\r\n", b'{"t":"hello","node":5,"host":"x","nnodes":2}\n',
                 b'{"t":"hello","node":1,"host":"x","nnodes":9}\n'):
        with raw_client(watches.port, hello=False) as sock:
            sock.sendall(junk)
            until(lambda s=sock: s.recv(100) == b"")  # the hub hung up on it
    with raw_client(watches.port, hello=False):
        pass  # connects and leaves
    time.sleep(0.3)
    assert hub.cause() is None and hub.states == {} and hub.thread.is_alive()


def test_a_client_whose_port_holds_another_program_keeps_going(watches):
    """The watch port taken by something that is not a hub: the client logs it once, no loss, no crash."""
    stranger = socket.create_server(("127.0.0.1", watches.port))
    served = []

    def serve() -> None:
        for _ in range(2):
            conn, _addr = stranger.accept()
            served.append(conn)
            conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client, rec = watches(1, nnodes=2)
    until(lambda: len(served) == 2)
    stranger.close()
    assert any("is not this job's hub (sent garbage)" in line for line in rec.lines), rec.lines
    assert client.cause() is None and not rec.stops and client.thread.is_alive()
    for conn in served:
        conn.close()


def test_a_late_joiner_learns_what_happened_before_it(watches):
    hub, _ = watches(0)
    early, _ = watches(1)
    until(lambda: joined(early))
    early.finish(3, "algo-2: rank 2 (local rank 0) exited with code 3\nKeyError: 'x'", primary=True)
    until(lambda: hub.cause() is not None)
    late, late_rec = watches(2)
    until(lambda: late.cause() is not None)
    assert late.cause().report == "algo-2: rank 2 (local rank 0) exited with code 3\nKeyError: 'x'"
    assert late_rec.stops


def test_done_is_no_loss_but_a_closed_connection_is(watches):
    hub, rec = watches(0)
    done, _ = watches(1)
    vanished, _ = watches(2)
    until(lambda: joined(done) and joined(vanished) and len(hub.states) == 2)
    assert done.finish(0, "", primary=True) == (0, "")
    done.close()
    until(lambda: hub.states[1] == "done")
    time.sleep(2 * TIMEOUT)
    assert hub.cause() is None and not rec.stops  # finished early: never lost
    vanished.close()  # its connection closes without done or failed
    until(lambda: hub.cause() is not None)
    assert hub.cause().report == "algo-3 lost: connection closed" and hub.states == {1: "done", 2: "lost"}


def test_the_hub_lost_is_seen_by_its_clients(watches):
    hub, _ = watches(0, nnodes=2)
    client, rec = watches(1, nnodes=2)
    until(lambda: joined(client))
    hub.close()
    until(lambda: client.cause() is not None)
    assert client.cause().report == "algo-1 lost: connection closed" and rec.stops
    code, text = client.finish(1, "algo-2: torchrun failed before or around the workers (exit code 1)", False)
    assert code == jobwatch.LOST_CODE and text.startswith("algo-1 lost: connection closed\nthen algo-2: ")


def test_a_taken_port_turns_the_watch_off():
    with socket.create_server(("", 0)) as taken:
        lines: list[str] = []
        port = taken.getsockname()[1]
        assert jobwatch.start(0, "algo-1", 2, "127.0.0.1", port, 3.0, 10.0, lines.append) is None
    assert lines == [f"job watch off: cannot listen on port {port}: Address already in use"]


# -- real jobs: two launchers, torchrun, gloo workers; one host faulted --

HOSTS = ["algo-1", "algo-2"]
LONG_RUN = ["--steps", "100000", "--step-sleep", "0.05"]
JOB_BOUND = 12.0  # seconds from the fault until every process has exited (a loaded 2-core machine)


class TwoHosts:
    """Two launchers of one job on 127.0.0.1, each on its own SageMaker tree; stderr read as it comes."""

    def __init__(self, tmp_path, script_args, launcher_args=()) -> None:
        self.bases = [make_host(tmp_path, h, HOSTS) for h in HOSTS]
        port, watch = free_port(), free_port()
        self.procs = []
        self.err: list[list[str]] = [[], []]
        for base, err in zip(self.bases, self.err):
            env = launcher_env(SAGEMAKER_BASE_DIR=str(base), WORKER_RECORD_DIR=str(base / "records"),
                               LAUNCHER_MASTER_PORT=str(port), LAUNCHER_WATCH_PORT=str(watch),
                               LAUNCHER_RESOLVE=",".join(f"{h}=127.0.0.1" for h in HOSTS))
            proc = subprocess.Popen([PYTHON, "-m", "launcher", "--nproc-per-node", "2", *launcher_args,
                                     *script_args], env=env, cwd=str(base), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
            self.procs.append(proc)
            threading.Thread(target=lambda p=proc, e=err: e.extend(p.stderr), daemon=True).start()

    def pids(self, host: int) -> set[int]:
        """That host's launcher, torchrun and workers."""
        found = {self.procs[host].pid}
        for data in records(self.bases[host]).values():
            found.update({data["pid"], data["ppid"]})
        return found

    def failure(self, host: int) -> str:
        return (self.bases[host] / "output" / "failure").read_text()

    def stderr(self, host: int) -> str:
        return "".join(self.err[host])

    def end(self) -> None:
        """Kill what is left (a test that failed half-way), by PID, and prove nothing is."""
        everything = self.pids(0) | self.pids(1)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proctree.kill_tree([proc.pid])
            proc.wait(timeout=30)
        assert_gone(everything)


@pytest.fixture
def jobs():
    started: list[TwoHosts] = []

    def make(tmp_path, script_args, launcher_args=()) -> TwoHosts:
        job = TwoHosts(tmp_path, script_args, launcher_args)
        started.append(job)
        return job

    yield make
    for job in started:
        job.end()


def wait_dead(pid: int, timeout: float = 120.0) -> float:
    """When ``pid`` is gone (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while is_alive(pid):
        assert time.monotonic() < deadline, f"{pid} still alive"
        time.sleep(0.01)
    return time.monotonic()


def worker_pid(job: TwoHosts, host: int, rank: int) -> int:
    return wait_for_records(job.bases[host], 2, timeout=120, steps=1)[rank]["pid"]


@pytest.mark.parametrize("fault, head, code", [
    (["--exit-code", "7"], "algo-2: rank 2 (local rank 0) exited with code 7", 7),
    (["--exit-code", "7", "--abort-at-exit"], "algo-2: rank 2 (local rank 0) exited with code 7 (then aborted in "
     "interpreter teardown: terminate called without an active exception)", 7),
    (["--self-signal", "SIGKILL"], "algo-2: rank 2 (local rank 0) was killed by SIGKILL (exit code 137)", 137)])
def test_a_worker_failure_stops_both_hosts_with_its_root_cause(jobs, tmp_path, fault, head, code):
    job = jobs(tmp_path, [WORKER, *LONG_RUN, *fault, "--fail-rank", "2", "--fail-at-step", "10"])
    faulted = wait_dead(worker_pid(job, 1, 2))
    pids = job.pids(0) | job.pids(1)
    for proc in job.procs:
        proc.wait(timeout=60)
    waited = assert_gone(pids) + time.monotonic() - faulted
    print(f"{fault[-1]} on algo-2: every process exited {waited:.2f} s after the worker died")
    for host in (0, 1):
        assert job.procs[host].returncode == code, job.stderr(host)[-3000:]
        assert job.failure(host).startswith(head + "\n" if host == 0 else head), job.failure(host)
        assert job.stderr(host).rstrip().endswith(job.failure(host).rstrip().splitlines()[-1])
    assert "\nthen algo-1: " in job.failure(0)  # and then what happened there
    assert waited <= JOB_BOUND


def test_a_silent_launcher_is_lost_after_the_heartbeat_timeout(jobs, tmp_path):
    """algo-2's launcher paused (SIGSTOP): its workers run on, its heartbeats stop."""
    job = jobs(tmp_path, [WORKER, *LONG_RUN])
    worker_pid(job, 1, 2)
    worker_pid(job, 0, 0)
    survivors = job.pids(0)
    job.procs[1].send_signal(signal.SIGSTOP)
    paused = time.monotonic()
    job.procs[0].wait(timeout=60)
    waited = assert_gone(survivors) + time.monotonic() - paused
    print(f"algo-2's launcher stopped: algo-1 all exited {waited:.2f} s later (heartbeat timeout 3 s)")
    assert job.procs[0].returncode == jobwatch.LOST_CODE, job.stderr(0)[-3000:]
    assert job.failure(0).startswith("algo-2 lost: no heartbeat for 3 s\nthen algo-1: ")
    assert waited <= 3 + JOB_BOUND
    job.procs[1].send_signal(signal.SIGCONT)  # it wakes up to a job that is over, and is told why
    job.procs[1].wait(timeout=60)
    assert job.procs[1].returncode == jobwatch.LOST_CODE, job.stderr(1)[-3000:]
    assert job.failure(1).startswith("algo-2 lost: no heartbeat for 3 s\nthen algo-2: ")


@pytest.mark.parametrize("lost", [1, 0])
def test_a_host_that_loses_power_is_lost(jobs, tmp_path, lost):
    """Every process of one host SIGKILLed at once: the other names it and exits 137."""
    job = jobs(tmp_path, [WORKER, *LONG_RUN])
    worker_pid(job, 1, 2)
    worker_pid(job, 0, 0)
    other = 1 - lost
    survivors = job.pids(other)
    proctree.kill_tree([job.procs[lost].pid])
    killed = time.monotonic()
    job.procs[other].wait(timeout=60)
    waited = assert_gone(survivors) + time.monotonic() - killed
    print(f"{HOSTS[lost]} powered off: {HOSTS[other]} all exited {waited:.2f} s later")
    assert job.procs[other].returncode == jobwatch.LOST_CODE, job.stderr(other)[-3000:]
    assert job.failure(other).startswith(f"{HOSTS[lost]} lost: connection closed\nthen {HOSTS[other]}: ")
    assert waited <= JOB_BOUND


EARLY_AND_LATE = """import json, os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
if os.environ["GROUP_RANK"] == "1":  # algo-2
    time.sleep(8)  # longer than the heartbeat timeout: algo-1's workers are long done
rank = int(os.environ["RANK"])
with open(os.path.join(os.environ["WORKER_RECORD_DIR"], f"rank{rank}.json"), "w") as fh:
    json.dump({"rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "sum": t.item(), "steps_done": 1}, fh)
"""


def test_a_host_that_finishes_early_is_no_loss(jobs, tmp_path):
    script = tmp_path / "early_and_late.py"
    script.write_text(EARLY_AND_LATE)
    job = jobs(tmp_path, [str(script)])
    for proc in job.procs:
        proc.wait(timeout=180)
    for host in (0, 1):
        assert job.procs[host].returncode == 0, job.stderr(host)[-3000:]
        assert "lost" not in job.stderr(host) and not (job.bases[host] / "output" / "failure").exists()
    assert {r["sum"] for h in (0, 1) for r in records(job.bases[h]).values()} == {4.0}


def test_no_job_watch_starts_none(jobs, tmp_path):
    job = jobs(tmp_path, [WORKER, "--steps", "3"], ["--no-job-watch"])
    for proc in job.procs:
        proc.wait(timeout=180)
    for host in (0, 1):
        assert job.procs[host].returncode == 0, job.stderr(host)[-3000:]
        assert "job watch" not in job.stderr(host)
