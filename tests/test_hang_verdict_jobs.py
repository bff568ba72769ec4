"""The verdict names the culprit in the shapes of hang that issue 26 found missed: real gloo jobs on
namespaced hosts (``simulate --network netns``), tests/scripts/hang_worker.py hanging on purpose.

- ``preinit``: one rank blocks on a read before ``init_process_group`` while the other waits inside it
  (torch's ``_create_gloo_process_group``), while busy loops (started and ended here, by PID) hold the
  machine at four per core from the moment the ranks block: every stack comes in, the blocked rank is
  named, the other is "in init_process_group" (one job for both: the suite's time);
- ``noabort``: one rank ignores SIGABRT (so it gives no stack) and sleeps while the others wait in the
  all-reduce: it is named as the likely culprit, with why it gave no stack, from another host than node 0.

Each proves exit code 124 on every host, the report's sentence, and that nothing is left (run_job).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from typing import Any

import pytest
from conftest import PYTHON, assert_gone
from test_hang_jobs import WHY_NOT, host_of, line_of, others
from test_simulate import job_pids, processes_inside, rank_records, read_json
from test_simulate_netns import machine, start  # noqa: F401  (machine: a fixture used below)

from launcher import codes

pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}"),
              pytest.mark.usefixtures("machine"), pytest.mark.job, pytest.mark.lab]

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "hang_worker.py")
TIMEOUT = 8.0  # --hang-timeout: the worker beats until it blocks (its start is no silence), then steps or hangs


def hung_ranks(workdir: str, hosts: int) -> int:
    """How many ranks recorded that they stopped progressing (no record yet: 0)."""
    count = 0
    for i in range(1, hosts + 1):
        data = os.path.join(workdir, f"algo-{i}", "output", "data")
        for name in os.listdir(data) if os.path.isdir(data) else ():
            if name.startswith("rank") and name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError, KeyError):  # being replaced right now
                    count += read_json(os.path.join(data, name))["hung_at"] is not None
    return count


def run_job(tmp_path: Any, hosts: int, nproc: int, *script_args: str, busy: int = 0) -> dict[str, Any]:
    """Run the job to its end (with ``busy`` busy loops from when every rank blocked); prove nothing is
    left; return the exit codes and each host's report."""
    name = f"v{script_args[1]}-{hosts}x{nproc}{'-busy' if busy else ''}"
    sim, workdir = start(tmp_path, name, hosts, "--nproc-per-node", str(nproc), "--platform-stop", "off",
                         "--deadline", "240", script=SCRIPT,
                         script_args=(*script_args, "--launcher-hang-timeout", f"{TIMEOUT:g}"))
    loops: list[subprocess.Popen] = []
    try:
        if busy:
            deadline = time.monotonic() + 180
            while hung_ranks(workdir, hosts) < hosts * nproc and sim.proc.poll() is None:
                assert time.monotonic() < deadline, sim.stderr[-3000:]
                time.sleep(0.1)
            loops = [subprocess.Popen([PYTHON, "-c", "while True: pass"]) for _ in range(busy)]
        code = sim.finish(timeout=300)  # simulate's --deadline 240 ends it first
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
        if sim.proc.poll() is None:
            sim.abort()
    if loops:
        assert_gone([loop.pid for loop in loops])
    summary = read_json(os.path.join(workdir, "summary.json"))
    records = rank_records(workdir, hosts)
    assert_gone(job_pids(records, sim.proc.pid, summary))
    assert processes_inside(workdir) == []
    assert not summary["deadline_reached"], sim.stderr[-3000:]
    assert code == codes.HANG_CODE, sim.stderr[-4000:]
    assert [h["exit_code"] for h in summary["hosts"]] == [codes.HANG_CODE] * hosts, sim.stderr[-3000:]
    reports = {}
    for host in (h["host"] for h in summary["hosts"]):
        with open(os.path.join(workdir, host, "output", "failure"), encoding="utf-8") as fh:
            reports[host] = fh.read()
    return {"reports": reports, "stderr": sim.stderr}


def check_verdict(result: dict[str, Any], body: str) -> None:
    """Every host's report starts with ``hang: no progress for N s; `` and then ``body``."""
    for host, report in result["reports"].items():
        head, _, rest = report.partition("; ")
        assert head.startswith("hang: no progress for ") and rest.startswith(body), (host, report,
                                                                                      result["stderr"][-3000:])
    print(f"\n{next(iter(result['reports'].values())).splitlines()[0]}")


def test_a_rank_blocked_before_init_process_group_is_named_with_every_stack_under_heavy_cpu_load(
        tmp_path: Any) -> None:
    result = run_job(tmp_path, 2, 1, "--mode", "preinit", "--rank", "1", busy=4 * (os.cpu_count() or 1))
    check_verdict(result, f"rank 1 ({host_of(1, 1)}) at hang_worker.py:{line_of('read')} in read_input; "
                          f"rank 0 in init_process_group (hang_worker.py:{line_of('init')})")
    assert not [r for r in result["reports"].values() if "no stack" in r]


def test_a_rank_that_ignores_sigabrt_is_the_likely_culprit(tmp_path: Any) -> None:
    result = run_job(tmp_path, 2, 2, "--mode", "noabort", "--rank", "3")
    check_verdict(result, f"rank 3 ({host_of(3, 2)}) gave no stack (SIGABRT ignored), likely the culprit: every "
                          f"other rank waits for the others; {others(3, 4)} in all_reduce "
                          f"(hang_worker.py:{line_of('all_reduce')})")
    node0 = result["reports"]["algo-1"]
    assert "rank 0 (algo-1): hang_worker.py:" in node0 and "rank 3" not in node0.split("\n", 1)[1]
    assert "rank 3 (algo-2): no stack (SIGABRT ignored)" in result["reports"]["algo-2"]
