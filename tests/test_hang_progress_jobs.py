"""Progress is the training loop's, the start has its own bound, the default is learned: real gloo jobs on
namespaced hosts (``simulate --network netns``), 2 hosts of one rank each.

- a rank deadlocks while a thread of every rank keeps printing: a hang, the deadlocked rank named (the
  printing proves nothing: the bootstrap samples the main threads);
- a start that holds one frame longer than the timeout between steps, then three phases longer than it
  without a line or a beat (a silent computation, a checkpoint written in pieces, an evaluation): exit 0;
- no ``--hang-timeout``, regular steps, a rank that skips a collective after the warm-up: a hang, named,
  within the learned timeout (the floor lowered by the test-only variable, so that it takes seconds).

The three jobs run side by side (each mostly waits: for its timeout, or through its silent phases), started
by one fixture; each test judges its own job. Every job proves that nothing of it is left (processes, work
directory), and the fixture that the machine's network and names are as they were.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Union

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

WORKER = os.path.join(REPO, "tests", "scripts", "progress_worker.py")
HANG_WORKER = os.path.join(REPO, "tests", "scripts", "hang_worker.py")
TIMEOUT = 8.0  # the timeout between steps
START = 120.0  # the start's bound: above a loaded machine's torch import, which a sampler sees moving anyway
FLOOR = 4.0  # the learned timeout's floor in the learned test (DDP_LAUNCHER_TEST_HANG_FLOOR)
DEADLINE = 420.0  # simulate's deadline: far above a loaded machine's learned timeout (5 x its longest stall)


def line_of(mark: str, script: str) -> int:
    """The script's line carrying ``# at:<mark>``."""
    with open(script, encoding="utf-8") as fh:
        return next(i for i, line in enumerate(fh, 1) if line.rstrip().endswith(f"# at:{mark}"))


def run(tmp_path: Path, name: str, script: str, *script_args: str, env: dict[str, str] | None = None,
        then: tuple[str, str] | None = None) -> dict:
    """Run the job on 2 namespaced hosts to its end; prove nothing is left; exit codes, reports, timing.
    ``then``: (a pattern, a file): once a line of the job's stderr matches the pattern, the file is made."""
    workdir = str(tmp_path / name)
    sim = Simulate(["--hosts", "2", "--workdir", workdir, "--job-name", name, "--network", "netns",
                    "--platform-stop", "off", "--deadline", f"{DEADLINE:g}", "--", script, *script_args,
                    "--launcher-hang-start-timeout", f"{START:g}"], str(tmp_path), launcher_env(**(env or {})))
    try:
        if then is not None:
            pattern, path = re.compile(then[0]), then[1]
            waited_until = time.monotonic() + DEADLINE
            while not any(pattern.search(line) for line in list(sim.err)) and sim.proc.poll() is None:
                assert time.monotonic() < waited_until, sim.stderr[-3000:]
                time.sleep(0.2)
            with open(path, "w", encoding="utf-8"):
                pass
        code = sim.finish(timeout=DEADLINE + 60)  # simulate's own deadline ends it first
        ended = time.time()
    finally:
        if sim.proc.poll() is None:
            sim.abort()
    return job_result(sim, workdir, 2, code, ended)


def check_hang(result: dict, culprit: str, timeout: float) -> None:
    """124 on both hosts, each report names ``culprit`` first, the end came within the timeout + the bound."""
    assert result["code"] == codes.HANG_CODE, result["stderr"][-4000:]
    for host in result["summary"]["hosts"]:
        assert host["exit_code"] == codes.HANG_CODE, (host, result["stderr"][-3000:])
        report = result["reports"][host["host"]] or ""
        found = re.match(r"hang: no progress for (\d+) s; ", report)
        assert found and timeout - 1 <= int(found.group(1)) <= timeout + 5, (report, result["stderr"][-3000:])
        assert report[found.end():].startswith(culprit), (report, result["stderr"][-3000:])
    assert result["since_hang"] <= timeout + BOUND, result["since_hang"]


SAID = r"hang timeout: ([\d.]+) s\S*(?: \(the \w+\))?, learned"  # node 0's log once it learned a timeout


def _learned(tmp_path: Path) -> dict:
    # The hang comes once node 0 said it learned a timeout: after the warm-up, however long a loaded machine
    # makes it (the gaps between step-like events stretch with its stalls).
    return run(tmp_path, "learned", HANG_WORKER, "--mode", "skip", "--rank", "1", "--at-step", str(10**8),
               "--hang-file", str(tmp_path / "hang-now"), "--step-sleep", "0.1",
               env={hangtimeout.FLOOR_ENV: f"{FLOOR:g}"}, then=(SAID, str(tmp_path / "hang-now")))


JOBS = {
    "printer": lambda tmp_path: run(tmp_path, "printer", WORKER, "--mode", "printer", "--rank", "1", "--at-step", "30",
                                    "--launcher-hang-timeout", f"{TIMEOUT:g}"),
    "healthy": lambda tmp_path: run(tmp_path, "healthy", WORKER, "--mode", "healthy", "--steps", "20",
                                    "--slow-start", f"{TIMEOUT * 1.5:g}", "--quiet-phase", f"{TIMEOUT * 1.2:g}",
                                    "--launcher-hang-timeout", f"{TIMEOUT:g}"),
    "learned": _learned,
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: Any) -> dict[str, Union[dict, BaseException]]:
    """Every job of :data:`JOBS` side by side, each to its end: its result, or what it raised."""
    tmp_path = tmp_path_factory.mktemp("progress-jobs")
    before = machine_state()
    with ThreadPoolExecutor(len(JOBS)) as pool:
        futures = {name: pool.submit(job, tmp_path) for name, job in JOBS.items()}
    assert machine_state() == before  # every lab is gone: namespaces, links, hosts file, hostname
    return {name: future.exception() or future.result() for name, future in futures.items()}


def result_of(jobs: dict[str, Union[dict, BaseException]], name: str) -> dict:
    """The job's result; what it raised, raised again in this test."""
    result = jobs[name]
    if isinstance(result, BaseException):
        raise result
    return result


def test_a_deadlock_while_every_rank_prints_is_a_hang_and_named(jobs: Any) -> None:
    result = result_of(jobs, "printer")
    assert "status: still here" in result["stdout"]  # the threads printed to the end
    check_hang(result, f"rank 1 (algo-2) at progress_worker.py:{line_of('deadlock', WORKER)} in deadlock",
               TIMEOUT)


def test_a_slow_start_and_silent_phases_are_no_hang(jobs: Any) -> None:
    result = result_of(jobs, "healthy")
    assert result["code"] == 0, result["stderr"][-4000:]
    assert all(h["exit_code"] == 0 for h in result["summary"]["hosts"])
    assert "hang:" not in result["stderr"] and set(result["reports"].values()) == {None}
    assert result["since_hang"] >= 3 * TIMEOUT * 1.2  # the three silent phases ran
    assert "until the first step 120 s" in result["stderr"]  # the log says which timeout applies


def test_the_learned_timeout_names_a_hang_after_the_warm_up(jobs: Any) -> None:
    result = result_of(jobs, "learned")
    learned = [float(m) for m in re.findall(SAID, result["stderr"])]
    assert learned, result["stderr"][-4000:]  # the warm-up ended before the hang, and the log said so
    assert FLOOR <= learned[-1] <= hangtimeout.CEILING_CPU  # learned (the log says so), whatever the load's stalls
    culprit = f"rank 1 (algo-2) at hang_worker.py:{line_of('skip', HANG_WORKER)} in wait_for_peer"
    check_hang(result, culprit, learned[-1])
    print(f"\nlearned {learned}, ended {result['since_hang']:.1f} s after the hang")
