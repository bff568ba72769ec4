"""The job watch with a real job on 16 namespaced hosts (issue 16 §3).

Sixteen SageMaker hosts, each in a network namespace of its own, one rank each: 16 launchers, 16
torchruns, 16 workers that import torch and all-reduce with gloo (tests/scripts/ddp_allreduce.py).

- The job finishes: every host exits 0 and every rank all-reduced the same sum.
- One host is powered off (its link down, then every process of it SIGKILLed at once) with
  ``--platform-stop off``: what ends the job is the launchers' own watch. All 15 others exit 137,
  every report starts with the same root cause (that host lost), and every process of every host
  has exited within the loss timeout + 2 s (+ a margin for 48 processes on 2 cores).

Each test proves nothing is left: no process in any of the 16 namespaces, simulate and the lab gone.
Skipped, with the reason, where network namespaces are not permitted.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest
from conftest import assert_gone, is_alive
from test_simulate import job_pids, processes_inside, rank_records, read_json
from test_simulate_netns import machine, start  # noqa: F401  (machine: a fixture used below)

from launcher import jobwatch
from launcher.simulate import netns

WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}"),
              pytest.mark.usefixtures("machine"), pytest.mark.job, pytest.mark.lab]

HOSTS = 16
LOSS_TIMEOUT = 10.0  # seconds (the default is 30 s: tests/test_jobwatch_netns.py runs it)
LOST_BOUND = LOSS_TIMEOUT + 2 + 15.0  # the loss timeout + 2 s, and 15 s for 48 processes ending on 2 cores
LOST = "algo-9"


def namespaces(workdir: str) -> set[int]:
    """The network namespaces (inodes) of the 16 hosts, read from their running workers."""
    found = set()
    for recs in rank_records(workdir, HOSTS).values():
        for rec in recs:
            found.add(int(re.sub(r"\D", "", os.readlink(f"/proc/{rec['pid']}/ns/net"))))
    return found


def finish(sim: Any, workdir: str) -> tuple[int, dict[str, Any], dict[str, list[dict[str, Any]]]]:
    code = sim.finish(timeout=600)
    summary = read_json(os.path.join(workdir, "summary.json"))
    records = rank_records(workdir, HOSTS)
    assert_gone(job_pids(records, sim.proc.pid, summary))
    assert processes_inside(workdir) == []
    assert summary["network"] == "netns", sim.stderr
    return code, summary, records


def test_sixteen_hosts_train_to_the_end(tmp_path: Any) -> None:
    sim, workdir = start(tmp_path, "sixteen", HOSTS, "--nproc-per-node", "1", "--deadline", "600",
                         script_args=("--steps", "3"))
    code, summary, records = finish(sim, workdir)
    assert code == 0 and summary["exit_code"] == 0, sim.stderr[-3000:]
    assert sorted(h["exit_code"] for h in summary["hosts"]) == [0] * HOSTS
    ranks = sorted(r["rank"] for recs in records.values() for r in recs)
    assert ranks == list(range(HOSTS))
    assert {(r["steps"], r["sum"], r["world_size"]) for recs in records.values() for r in recs} == {
        (3, HOSTS * (HOSTS + 1) / 2, HOSTS)}
    assert records["algo-1"][0]["rank"] == 0


def test_one_lost_host_stops_all_sixteen_with_one_root_cause(tmp_path: Any) -> None:
    sim, workdir = start(tmp_path, "sixteen-lost", HOSTS, "--nproc-per-node", "1", "--platform-stop", "off",
                         "--deadline", "600", "--fault", f"{LOST}:poweroff:step=5",
                         script_args=("--steps", "0", "--step-sleep", "0.1",
                                      "--launcher-loss-timeout", f"{LOSS_TIMEOUT:g}"))
    try:
        sim.wait_for("[algo-16] [rank15]:step=1", timeout=400)
        inodes = namespaces(workdir)
        assert len(inodes) == HOSTS
        processes = netns.namespace_pids(inodes)  # launchers, watchdogs, torchruns, workers
        assert len(processes) >= 4 * HOSTS, processes
        deadline = time.monotonic() + 120  # simulate logs right after the deed (polled every 10 ms)
        while not any(f"fault: poweroff of {LOST}" in line for line in list(sim.err)):
            assert time.monotonic() < deadline and sim.proc.poll() is None, sim.stderr[-3000:]
            time.sleep(0.01)
        fault = time.monotonic()
        deadline = fault + 300
        while any(is_alive(p) for p in processes):
            assert time.monotonic() < deadline, [p for p in processes if is_alive(p)]
            time.sleep(0.05)
        ended = time.monotonic() - fault
        code, summary, _records = finish(sim, workdir)
    finally:
        if sim.proc.poll() is None:
            sim.abort()
    assert netns.namespace_pids(inodes) == []
    assert code == jobwatch.LOST_CODE, sim.stderr[-3000:]
    hosts = {h["host"]: h for h in summary["hosts"]}
    assert hosts[LOST]["outcome"].startswith("lost: poweroff by --fault")
    survivors = [f"algo-{i}" for i in range(1, HOSTS + 1) if f"algo-{i}" != LOST]
    cause = f"{LOST} lost: no heartbeat for {LOSS_TIMEOUT:g} s"
    for host in survivors:
        assert hosts[host]["exit_code"] == jobwatch.LOST_CODE, (host, hosts[host])
        with open(os.path.join(workdir, host, "output", "failure"), encoding="utf-8") as fh:
            report = fh.read()
        assert report.startswith(f"{cause}\nthen {host}: "), (host, report)
    assert ended <= LOST_BOUND, ended
    print(f"\n16 hosts, {LOST} powered off: every process of every host exited {ended:.1f} s after the fault "
          f"(loss timeout {LOSS_TIMEOUT:g} s)")
