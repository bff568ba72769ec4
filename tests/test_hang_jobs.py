"""Hung jobs end with the culprit named: real gloo jobs on namespaced hosts (``simulate --network netns``).

tests/scripts/hang_worker.py hangs on purpose at step 3: one rank skips a collective and waits for a
message (deadlock), loops for ever in Python, or blocks on a read; or every rank sleeps; or every rank is
silent for a while and the job then finishes (with and without progress beats). Each test of a culprit runs one
job per layout (1 host x 4, 2 x 2, 4 x 1) side by side, as they mostly wait for the timeout; the jobs whose
ranks all do the same run on 2 x 2, the three side by side. Of each job the tests prove:

- the job ended within the hang timeout + 15 s of the hang (the worker records when it stopped
  progressing), every host with exit code 124;
- every host's failure report starts with the culprit sentence, naming the right rank, host and
  ``file:line`` (the line the script marks with ``# at:<mode>``);
- a silent job is not stopped (exit code 0, no hang line);
- nothing is left: every process of the job gone, nothing in the work directory, the machine's network
  as before.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from typing import Any, Callable, Union

import pytest
from conftest import REPO, assert_gone
from test_simulate import job_pids, processes_inside, rank_records, read_json
from test_simulate_netns import machine, machine_state, start  # noqa: F401  (machine: a fixture used below)

from launcher import codes
from launcher.simulate import netns

WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}"),
              pytest.mark.usefixtures("machine"), pytest.mark.job, pytest.mark.lab]

SCRIPT = os.path.join(REPO, "tests", "scripts", "hang_worker.py")
TIMEOUT = 15.0  # --hang-timeout: above a loaded machine's torch import and rendezvous, which print nothing
BOUND = 15.0  # the bound past the timeout
LAYOUTS = [(1, 4), (2, 2), (4, 1)]  # hosts x processes per host
ArgsOf = Callable[[int, int], Sequence[str]]  # the script's arguments for a layout (hosts, processes per host)


def line_of(mark: str) -> int:
    """The script's line carrying ``# at:<mark>``."""
    with open(SCRIPT, encoding="utf-8") as fh:
        return next(i for i, line in enumerate(fh, 1) if line.rstrip().endswith(f"# at:{mark}"))


def start_job(tmp_path: Any, hosts: int, nproc: int, *script_args: str) -> tuple[Any, str, int]:
    """Start the job: its ``simulate``, work directory and host count."""
    name = f"{script_args[1]}-{hosts}x{nproc}"
    sim, workdir = start(tmp_path, name, hosts, "--nproc-per-node", str(nproc), "--platform-stop", "off",
                         "--deadline", "240", script=SCRIPT,
                         script_args=(*script_args, "--launcher-hang-timeout", f"{TIMEOUT:g}"))
    return sim, workdir, hosts


def run_job(tmp_path: Any, hosts: int, nproc: int, *script_args: str) -> dict[str, Any]:
    """Run the job to its end; prove nothing is left; return exit codes, reports, records, timing."""
    return end_job(*start_job(tmp_path, hosts, nproc, *script_args))


def end_job(sim: Any, workdir: str, hosts: int) -> dict[str, Any]:
    """Wait for a started job's end (see :func:`run_job`)."""
    try:
        code = sim.finish()
        ended = time.time()
    finally:
        if sim.proc.poll() is None:
            sim.abort()
    return job_result(sim, workdir, hosts, code, ended)


def job_result(sim: Any, workdir: str, hosts: int, code: int, ended: float) -> dict[str, Any]:
    """An ended job's exit codes, reports, output and the time from the hang to ``ended``, once nothing of it
    is left (every process gone, nothing in the work directory, no deadline reached)."""
    summary = read_json(os.path.join(workdir, "summary.json"))
    records = rank_records(workdir, hosts)
    assert_gone(job_pids(records, sim.proc.pid, summary))
    assert processes_inside(workdir) == []
    assert not summary["deadline_reached"], sim.stderr[-3000:]
    reports = {}
    for host in (h["host"] for h in summary["hosts"]):
        path = os.path.join(workdir, host, "output", "failure")
        reports[host] = None
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                reports[host] = fh.read()
    hung = [r["hung_at"] for recs in records.values() for r in recs if r["hung_at"] is not None]
    return {"code": code, "summary": summary, "reports": reports, "stderr": sim.stderr, "stdout": sim.stdout,
            "since_hang": ended - min(hung) if hung else None}


def host_of(rank: int, nproc: int) -> str:
    return f"algo-{rank // nproc + 1}"


def check_hang(result: dict[str, Any], head: str) -> None:
    """Exit code 124 everywhere, every report starts with ``hang: no progress for N s; `` (N the silence the
    launcher measured: at least the timeout, checked once a second) and then ``head``; the end came in time."""
    assert result["code"] == codes.HANG_CODE, result["stderr"][-4000:]
    for host in result["summary"]["hosts"]:
        assert host["exit_code"] == codes.HANG_CODE, (host, result["stderr"][-3000:])
        report = result["reports"][host["host"]]
        found = re.match(r"hang: no progress for (\d+) s; ", report or "")
        assert found and TIMEOUT <= int(found.group(1)) <= TIMEOUT + 5, (host["host"], report)
        assert report[found.end():].startswith(head), (host["host"], report, result["stderr"][-3000:])
    assert result["since_hang"] <= TIMEOUT + BOUND, result["since_hang"]
    print(f"\nended {result['since_hang']:.1f} s after the hang (timeout {TIMEOUT:g} s): "
          f"{next(iter(result['reports'].values())).splitlines()[0]}")


def others(culprit: int, world: int) -> str:
    from launcher.hang import ranges

    rest = [r for r in range(world) if r != culprit]
    return f"rank {rest[0]}" if len(rest) == 1 else f"ranks {ranges(rest)}"


def run_layouts(tmp_path: Any, modes: dict[str, ArgsOf]) -> dict[str, list[dict[str, Any]]]:
    """For each mode, one job per layout of :data:`LAYOUTS`, all side by side (they mostly wait for the timeout),
    with the script arguments ``args_of(hosts, nproc)``; every job is ended before any is judged."""
    jobs: list[tuple[str, tuple[Any, str, int]]] = []
    try:
        for mode, args_of in modes.items():
            for hosts, nproc in LAYOUTS:
                jobs.append((mode, start_job(tmp_path, hosts, nproc, *args_of(hosts, nproc))))
        ended = [(mode, end_job(*job)) for mode, job in jobs]
        return {mode: [result for m, result in ended if m == mode] for mode in modes}
    finally:
        for _, (sim, _, _) in jobs:
            if sim.proc.poll() is None:
                sim.abort()


@pytest.fixture(scope="module")
def blocked(tmp_path_factory: Any) -> dict[str, list[dict[str, Any]]]:
    """The jobs whose culprit blocks (no CPU used): a skipped collective (the last rank) and a read (rank 2), every
    layout of each, the six side by side; then the machine's network is as it was."""
    before = machine_state()
    modes = {"skip": lambda hosts, nproc: ("--mode", "skip", "--rank", str(hosts * nproc - 1)),
             "read": lambda hosts, nproc: ("--mode", "read", "--rank", "2")}
    results = run_layouts(tmp_path_factory.mktemp("blocked"), modes)
    assert machine_state() == before
    return results


def test_rank_skips_a_collective(blocked: dict[str, list[dict[str, Any]]]) -> None:
    for result, (hosts, nproc) in zip(blocked["skip"], LAYOUTS):
        culprit = hosts * nproc - 1
        check_hang(result, f"rank {culprit} ({host_of(culprit, nproc)}) at "
                           f"hang_worker.py:{line_of('skip')} in wait_for_peer (in recv); "
                           f"{others(culprit, hosts * nproc)} in all_reduce (hang_worker.py:{line_of('all_reduce')})")


def test_rank_loops_for_ever(tmp_path: Any) -> None:
    results = run_layouts(tmp_path, {"loop": lambda hosts, nproc: ("--mode", "loop", "--rank", "1")})["loop"]
    for result, (hosts, nproc) in zip(results, LAYOUTS):
        check_hang(result, f"rank 1 ({host_of(1, nproc)}) at "
                           f"hang_worker.py:{line_of('loop')} in spin; {others(1, hosts * nproc)} in all_reduce")


def test_rank_blocks_on_a_read(blocked: dict[str, list[dict[str, Any]]]) -> None:
    for result, (hosts, nproc) in zip(blocked["read"], LAYOUTS):
        check_hang(result, f"rank 2 ({host_of(2, nproc)}) at "
                           f"hang_worker.py:{line_of('read')} in read_input; {others(2, hosts * nproc)} in all_reduce")


# Jobs whose ranks all do the same: where they are does not depend on the layout, so one layout (2 hosts x 2
# processes: ranks on two hosts and two ranks per host) runs each, all three side by side.
SILENT = {"silent": TIMEOUT / 2, "beat": TIMEOUT * 1.5}  # seconds without a word (beat: with a beat every second)
ALIKE = {"sleep": ("--mode", "sleep"),
         **{mode: ("--mode", mode, "--silent", f"{silent:g}") for mode, silent in SILENT.items()}}


@pytest.fixture(scope="module")
def alike(tmp_path_factory: Any) -> dict[str, Union[dict[str, Any], BaseException]]:
    """The :data:`ALIKE` jobs, run side by side on 2 x 2, each to its end: its result, or what it raised (raised
    again by the test that looks at it); then the machine's network is as it was."""
    before = machine_state()
    jobs, results = {}, {}
    try:
        for mode, args in ALIKE.items():
            jobs[mode] = start_job(tmp_path_factory.mktemp(f"alike-{mode}"), 2, 2, *args)
        for mode, job in jobs.items():
            try:
                results[mode] = end_job(*job)
            except Exception as exc:  # noqa: BLE001  (the test of that job raises it)
                results[mode] = exc
    finally:
        for sim, _, _ in jobs.values():
            if sim.proc.poll() is None:
                sim.abort()
    assert machine_state() == before
    return results


def result_of(results: dict[str, Union[dict[str, Any], BaseException]], mode: str) -> dict[str, Any]:
    """The job's result; what it raised, raised again here."""
    result = results[mode]
    if isinstance(result, BaseException):
        raise result
    return result


def test_every_rank_sleeps_no_odd_one_out(alike: dict[str, Union[dict[str, Any], BaseException]]) -> None:
    check_hang(result_of(alike, "sleep"),
               f"no rank stands out: every rank at hang_worker.py:{line_of('sleep')} in wait_forever")


@pytest.mark.parametrize("mode", sorted(SILENT))
def test_a_silent_job_finishes(alike: dict[str, Union[dict[str, Any], BaseException]], mode: str) -> None:
    # Half the timeout without a word; or longer than the timeout, with a progress beat every second.
    result = result_of(alike, mode)
    assert result["code"] == 0, result["stderr"][-4000:]
    assert all(h["exit_code"] == 0 for h in result["summary"]["hosts"])
    assert "hang:" not in result["stderr"] and set(result["reports"].values()) == {None}
    assert result["since_hang"] >= SILENT[mode]
