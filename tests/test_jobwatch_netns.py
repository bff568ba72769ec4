"""The job watch on hosts that are really apart (``simulate --network netns --platform-stop off``).

Two SageMaker hosts, one rank each (rank 1 on algo-2), a worker that all-reduces every 0.1 s for ever
(tests/scripts/ddp_allreduce.py). One fault on algo-2 per test: its link goes down (``partition``),
every process of it is SIGKILLed at once (``poweroff``), its worker exits 7, its worker is SIGKILLed
(by PID, from the test). simulate does not stop the other host: what ends the job is the launchers'
own job watch. Each test proves that every process of both hosts (the machine's PIDs, taken from the
hosts' network namespaces before the fault) exited within the bound, that every host's failure report
starts with the job's root cause, that the exit codes agree (the worker's 7; 137 for a SIGKILL and for
a lost host: a host that never comes back ends the job within the loss timeout + 2 s, issue 16: the
default one where the host is powered off, 10 s for the partition), and that nothing is left: no process
in either namespace, simulate and the lab gone.
Skipped, with the reason, where network namespaces are not permitted.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any, Optional

import pytest
from conftest import assert_gone, is_alive
from test_simulate import Simulate, job_pids, processes_inside, rank_records, read_json
from test_simulate_netns import _cmdline, _ppid, machine, start  # noqa: F401  (machine: a fixture used below)

from launcher import jobwatch
from launcher.options import parse_invocation
from launcher.simulate import netns

WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}"),
              pytest.mark.usefixtures("machine"),  # the machine's network as before, after each test
              pytest.mark.job, pytest.mark.lab]

LOSS_TIMEOUT = parse_invocation(["t.py"], {}).options.loss_timeout  # the launcher's default
BOUND = 20.0  # seconds from the fault until every process exited: a few s, with margin for a loaded machine
LOST_BOUND = LOSS_TIMEOUT + 2 + 10.0  # a lost host: the loss timeout + 2 s, and 10 s for a loaded machine
# The partition's loss timeout: what it proves (each side names the other) does not depend on the value, and the
# default is proven by the poweroff; 20 s of the suite's time saved.
PARTITION_LOSS = 10.0
ENDLESS = ("--steps", "0", "--step-sleep", "0.1")
FAULT_STEP = 8  # a --fault fires when algo-2's worker prints this step


def base_args(*extra: str) -> tuple[str, ...]:
    return ("--nproc-per-node", "1", "--platform-stop", "off", "--deadline", f"{LOSS_TIMEOUT + 120:g}", *extra)


def namespaces_of(workdir: str) -> set[int]:
    """The network namespaces (inodes) of both hosts, read from their running workers."""
    found = set()
    for recs in rank_records(workdir, 2).values():
        for rec in recs:
            found.add(int(re.sub(r"\D", "", os.readlink(f"/proc/{rec['pid']}/ns/net"))))
    assert len(found) == 2, found
    return found


def wait_record(workdir: str, host: str, rank: int, steps: int = 0, timeout: float = 90.0) -> dict[str, Any]:
    """That worker's record once it did ``steps`` steps (polled every 10 ms)."""
    path = os.path.join(workdir, host, "output", "data", f"rank{rank}.json")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            rec = read_json(path)
            if rec["steps"] >= steps:
                return rec
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    pytest.fail(f"{host} rank {rank} never did {steps} step(s)")


def gone_at(pids: list[int], timeout: float = 120.0) -> float:
    """When the last of ``pids`` exited (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while any(is_alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if is_alive(p)]
        time.sleep(0.01)
    return time.monotonic()


def started(sim: Simulate, workdir: str) -> tuple[list[int], list[int], set[int]]:
    """Both workers running: every process of both hosts, the lab's holder, the namespaces."""
    wait_record(workdir, "algo-1", 0)
    wait_record(workdir, "algo-2", 1)
    inodes = namespaces_of(workdir)
    processes = netns.namespace_pids(inodes)  # launchers, their watchdogs, torchruns, workers
    holder = [int(n) for n in os.listdir("/proc") if n.isdigit()
              and _cmdline(int(n)).endswith("netns.py\0hold\0") and _ppid(int(n)) == sim.proc.pid]
    assert len(processes) >= 6 and len(holder) == 1, (processes, holder)
    return processes, holder, inodes


def run_fault(tmp_path: Any, name: str, extra: tuple[str, ...], script_args: tuple[str, ...],
              fire: Callable[[Simulate, str], float]) -> dict[str, Any]:
    """Start the job, let ``fire(sim, workdir)`` cause the fault and return when it happened; then wait for
    every process of both hosts and check that nothing is left. Returns what the test checks."""
    sim, workdir = start(tmp_path, name, 2, *base_args(*extra), script_args=script_args)
    try:
        processes, holder, inodes = started(sim, workdir)
        fault = fire(sim, workdir)
        ended = gone_at(processes) - fault
        code = sim.finish()
    finally:
        if sim.proc.poll() is None:
            sim.abort()
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert_gone(job_pids(rank_records(workdir, 2), sim.proc.pid, summary))
    assert_gone([sim.proc.pid, *holder])  # the lab's holder gone: the namespaces are freed
    assert netns.namespace_pids(inodes) == [] and processes_inside(workdir) == []
    assert summary["network"] == "netns" and not summary["deadline_reached"], sim.stderr
    hosts = {h["host"]: h for h in summary["hosts"]}
    failures = {}
    for host in hosts:
        path = os.path.join(workdir, host, "output", "failure")
        failures[host] = None
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                failures[host] = fh.read()
        if failures[host] is not None:  # the host's own stderr ends with its report
            mine = [line for line in sim.err if line.startswith(f"[{host}] ")]
            assert failures[host].splitlines()[-1] in mine[-1], (host, mine[-5:])
    print(f"\n{name}: every process of both hosts exited {ended:.2f} s after the fault "
          f"(launchers: {summary['fault_to_last_exit'] if summary['fault_to_last_exit'] is not None else '-'} s)")
    return {"code": code, "ended": ended, "hosts": hosts, "failures": failures, "stderr": sim.stderr}


def check(result: dict[str, Any], code: int, heads: dict[str, Optional[str]], bound: float) -> None:
    """The exit codes agree, every report starts with the root cause, everything ended in time."""
    assert result["code"] == code, result["stderr"][-3000:]
    for host, head in heads.items():
        failure = result["failures"][host]
        if head is None:  # powered off: its launcher had no moment to write anything
            assert failure is None and result["hosts"][host]["exit_code"] == code, result["hosts"][host]
            continue
        assert result["hosts"][host]["exit_code"] == code, (host, result["hosts"][host], result["stderr"][-3000:])
        assert failure is not None and failure.startswith(head), (host, failure)
        assert result["hosts"][host]["failure"] == head.splitlines()[0]
    assert result["ended"] <= bound, result["ended"]


def by_simulate(sim: Simulate, _workdir: str) -> float:
    """When simulate logged that the ``--fault`` fired (it logs right after the deed; polled every 10 ms)."""
    deadline = time.monotonic() + 150
    while not any("fault: " in line for line in list(sim.err)):
        assert time.monotonic() < deadline and sim.proc.poll() is None, sim.stderr[-3000:]
        time.sleep(0.01)
    return time.monotonic()


def test_partition_each_host_names_the_other_lost(tmp_path: Any) -> None:
    # Neither side can tell a partition from the other's death: each names the other, both exit 137.
    result = run_fault(tmp_path, "partition", ("--fault", f"algo-2:partition:step={FAULT_STEP}"),
                       (*ENDLESS, "--launcher-loss-timeout", f"{PARTITION_LOSS:g}"), by_simulate)
    lost = f"no heartbeat for {PARTITION_LOSS:g} s"
    check(result, jobwatch.LOST_CODE, {"algo-1": f"algo-2 lost: {lost}\nthen algo-1: ",
                                       "algo-2": f"algo-1 lost: {lost}\nthen algo-2: "},
          LOST_BOUND - LOSS_TIMEOUT + PARTITION_LOSS)
    assert result["hosts"]["algo-2"]["outcome"].startswith("partitioned: partition by --fault")


def test_poweroff_the_survivor_names_the_lost_host(tmp_path: Any) -> None:
    result = run_fault(tmp_path, "poweroff", ("--fault", f"algo-2:poweroff:step={FAULT_STEP}"), ENDLESS,
                       by_simulate)
    # The link goes down before the kill: no FIN reaches algo-1, only the heartbeats stop.
    check(result, jobwatch.LOST_CODE, {"algo-1": f"algo-2 lost: no heartbeat for {LOSS_TIMEOUT:g} s\nthen algo-1: ",
                                       "algo-2": None}, LOST_BOUND)
    assert result["hosts"]["algo-2"]["outcome"].startswith("lost: poweroff by --fault")


def test_worker_exit_7_every_host_exits_7(tmp_path: Any) -> None:
    def fire(_sim: Simulate, workdir: str) -> float:  # rank 1 exits 7 after its first step
        return gone_at([wait_record(workdir, "algo-2", 1)["pid"]])

    # and then aborts in interpreter teardown, as torch's threads can ("terminate called ..."): still 7
    result = run_fault(tmp_path, "exit7", (), (*ENDLESS, "--fail-rank", "1", "--exit-code", "7", "--abort-at-exit"),
                       fire)
    head = ("algo-2: rank 1 (local rank 0) exited with code 7 (then aborted in interpreter teardown: "
            "terminate called without an active exception)")
    check(result, 7, {"algo-1": head + "\n", "algo-2": head}, BOUND)
    assert "\nthen algo-1: " in result["failures"]["algo-1"]


def test_worker_sigkill_every_host_exits_137(tmp_path: Any) -> None:
    def fire(_sim: Simulate, workdir: str) -> float:
        pid = wait_record(workdir, "algo-2", 1, steps=3)["pid"]
        os.kill(pid, signal.SIGKILL)  # our own job's worker, by its PID
        return time.monotonic()

    result = run_fault(tmp_path, "sigkill", (), ENDLESS, fire)
    head = "algo-2: rank 1 (local rank 0) was killed by SIGKILL (exit code 137)"
    check(result, 128 + signal.SIGKILL, {"algo-1": head + "\n", "algo-2": head}, BOUND)
    assert "\nthen algo-1: " in result["failures"]["algo-1"]
