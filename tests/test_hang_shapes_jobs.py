"""Hangs in the shapes real ones take are ended within the timeout + 15 s, the culprit named; the shapes that
look like them are not: real gloo jobs on 2 namespaced hosts of one rank each (tests/scripts/hang_shapes.py).

Every step of these jobs is one blocking call at the sampler's own period (0.1 s), so the sampler may never
see a step come round, and ``--hang-timeout`` is fixed with no start bound given: the start ends once the
workers have run the timeout (docs/hangs.md). Each hang job ends with 124 on both hosts, every report starting
with the culprit:

- ``early``: a deadlock at step 4 (rank 1 waits for a message, rank 0 in the all-reduce);
- ``timer``: a deadlock at step 30 while a status logger on a ``threading.Timer`` chain prints on;
- ``loader``: rank 1's DataLoader worker blocks for ever on one item; the report names rank 1 and its
  worker's stack at the dataset's line;
- ``livelock``: rank 1 retries a refused connection for ever while rank 0 waits in the all-reduce;
- ``chatty``: rank 1 blocks on a read while a thread of every rank prints and logs.

The ``healthy`` job (steps of one blocking call at 0.1 s, 0.2 s and 1 s, a loader that takes 5 s a batch, a
checkpoint written in shards with a beat per shard while the other rank waits in a barrier) ends 0, with the
fixed timeout and with the learned default (its floor lowered by the test-only variable). The jobs run four
at a time; each proves that nothing of it is left, the fixture that the machine's network is as it was.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Union

import pytest
from conftest import REPO, launcher_env
from test_hang_jobs import BOUND, job_result
from test_simulate import Simulate
from test_simulate_netns import machine_state

from launcher import codes, hangtimeout
from launcher.simulate import netns

WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}"),
              pytest.mark.job, pytest.mark.lab]

SCRIPT = os.path.join(REPO, "tests", "scripts", "hang_shapes.py")
TIMEOUT = 10.0  # --hang-timeout
PHASE = 1.2 * TIMEOUT  # each healthy phase: longer than the timeout
FLOOR = 8.0  # the learned default's floor in the healthy job without --hang-timeout
DEADLINE = 300.0  # simulate's deadline


def line_of(mark: str) -> int:
    """The script's line carrying ``# at:<mark>``."""
    with open(SCRIPT, encoding="utf-8") as fh:
        return next(i for i, line in enumerate(fh, 1) if line.rstrip().endswith(f"# at:{mark}"))


def run(tmp_path: Path, name: str, *args: str, env: Optional[dict[str, str]] = None,
        timeout: Optional[float] = TIMEOUT) -> dict:
    """Run the job on 2 namespaced hosts to its end; prove nothing is left; exit codes, reports, timing."""
    workdir = str(tmp_path / name)
    fixed = ["--launcher-hang-timeout", f"{timeout:g}"] if timeout is not None else []
    sim = Simulate(["--hosts", "2", "--workdir", workdir, "--job-name", name, "--network", "netns",
                    "--platform-stop", "off", "--deadline", f"{DEADLINE:g}", "--", SCRIPT, *args, *fixed],
                   str(tmp_path), launcher_env(**(env or {})))
    try:
        code = sim.finish(timeout=DEADLINE + 60)  # simulate's own deadline ends it first
        ended = time.time()
    finally:
        if sim.proc.poll() is None:
            sim.abort()
    return job_result(sim, workdir, 2, code, ended)


JOBS: dict[str, Callable[[Path], dict]] = {  # the long healthy jobs first: the hang jobs run beside them
    "healthy": lambda tmp: run(tmp, "healthy", "--mode", "healthy", "--phase", f"{PHASE:g}"),
    "healthy-learned": lambda tmp: run(tmp, "healthy-learned", "--mode", "healthy", "--phase", f"{PHASE:g}",
                                       env={hangtimeout.FLOOR_ENV: f"{FLOOR:g}"}, timeout=None),
    "early": lambda tmp: run(tmp, "early", "--mode", "early"),
    "timer": lambda tmp: run(tmp, "timer", "--mode", "timer"),
    "loader": lambda tmp: run(tmp, "loader", "--mode", "loader"),
    "livelock": lambda tmp: run(tmp, "livelock", "--mode", "livelock"),
    "chatty": lambda tmp: run(tmp, "chatty", "--mode", "chatty"),
}
PARALLEL = 4  # jobs at a time


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: Any) -> dict[str, Union[dict, BaseException]]:
    """Every job of :data:`JOBS`, :data:`PARALLEL` at a time, each to its end: its result, or what it raised."""
    tmp_path = tmp_path_factory.mktemp("hang-shapes")
    before = machine_state()
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {name: pool.submit(job, tmp_path) for name, job in JOBS.items()}
    assert machine_state() == before  # every lab is gone: namespaces, links, hosts file, hostname
    return {name: future.exception() or future.result() for name, future in futures.items()}


def result_of(jobs: dict[str, Union[dict, BaseException]], name: str) -> dict:
    """The job's result; what it raised, raised again in this test."""
    result = jobs[name]
    if isinstance(result, BaseException):
        raise result
    return result


def check_hang(result: dict, culprit: str) -> list[str]:
    """124 on both hosts, each report's sentence names ``culprit`` (a pattern) first, the end came within the
    timeout + 15 s of the hang. The reports."""
    assert result["code"] == codes.HANG_CODE, result["stderr"][-4000:]
    reports = []
    for host in result["summary"]["hosts"]:
        assert host["exit_code"] == codes.HANG_CODE, (host, result["stderr"][-3000:])
        report = result["reports"][host["host"]] or ""
        found = re.match(r"hang: no progress for (\d+) s; ", report)
        assert found and TIMEOUT - 1 <= int(found.group(1)) <= TIMEOUT + 5, (report, result["stderr"][-3000:])
        assert re.match(culprit, report[found.end():]), (culprit, report, result["stderr"][-3000:])
        reports.append(report)
    assert result["since_hang"] is not None and result["since_hang"] <= TIMEOUT + BOUND, result["since_hang"]
    print(f"\nended {result['since_hang']:.1f} s after the hang: {reports[0].splitlines()[0]}")
    return reports


WAITING = rf"; rank 0 in all_reduce \(hang_shapes\.py:{line_of('all_reduce')}\)"


def test_an_early_deadlock_in_a_loop_of_blocking_steps_ends_in_time(jobs: Any) -> None:
    check_hang(result_of(jobs, "early"),
               rf"rank 1 \(algo-2\) at hang_shapes\.py:{line_of('early')} in wait_for_peer \(in recv\){WAITING}")


def test_a_deadlock_behind_a_timer_chain_logger_ends_in_time(jobs: Any) -> None:
    result = result_of(jobs, "timer")
    assert "status: still here" in result["stdout"]
    check_hang(result, rf"rank 1 \(algo-2\) at hang_shapes\.py:{line_of('timer')} in log_status{WAITING}")


def test_a_dataloader_worker_blocked_on_one_item_is_named_with_its_stack(jobs: Any) -> None:
    reports = check_hang(result_of(jobs, "loader"),
                         rf"rank 1 \(algo-2\) at hang_shapes\.py:{line_of('loader')} in loader_steps")
    for report in reports:
        assert re.search(rf"; rank 1's child pid \d+ at hang_shapes\.py:{line_of('item')} in __getitem__",
                         report.splitlines()[0]), report


def test_a_livelocked_rank_is_the_one_not_waiting_in_a_collective(jobs: Any) -> None:
    result = result_of(jobs, "livelock")
    check_hang(result, r"rank 1 \(algo-2\) at hang_shapes\.py:\d+ in (retry_for_ever|call_the_service)"
                       rf"( \(in \w+\))?{WAITING}")
    assert "waited in torch.distributed for the others" in result["stderr"]  # the rule that found it


def test_a_stuck_rank_whose_thread_chatters_ends_in_time(jobs: Any) -> None:
    result = result_of(jobs, "chatty")
    assert "chat " in result["stdout"] or "chat " in result["stderr"]
    check_hang(result, rf"rank 1 \(algo-2\) at hang_shapes\.py:{line_of('chatty')} in read_input{WAITING}")


@pytest.mark.parametrize("name", ["healthy", "healthy-learned"])
def test_blocking_steps_a_slow_loader_and_a_long_checkpoint_are_no_hang(jobs: Any, name: str) -> None:
    result = result_of(jobs, name)
    assert result["code"] == 0, result["stderr"][-4000:]
    assert all(h["exit_code"] == 0 for h in result["summary"]["hosts"])
    assert "hang:" not in result["stderr"] and set(result["reports"].values()) == {None}
    assert result["stdout"].count("done: ") == 2, result["stdout"][-2000:]
