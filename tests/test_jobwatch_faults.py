"""Transient faults do not stop a job; a host really lost still does (issue 16, §1).

Two SageMaker hosts on namespaced hosts (``simulate --network netns --platform-stop off``: simulate stops
no host, so what happens is the launchers' own doing), one rank each, tests/scripts/ddp_allreduce.py
all-reducing every 0.25 s. At the launcher's default settings:

- transient faults (simulate's ``--fault HOST:KIND:step=N:SECONDS``) leave the job running: it trains
  to its last step after the faults have ended, and every host exits 0: a link down for 2, then 10 s on
  either host (the master's too), a launcher paused for 10 s, every process of a host paused for 5 s, a
  host starved to 0.1 % of a CPU for 10 s, every CPU saturated by busy loops for 40 s (longer than the
  loss timeout) (one job per host meets them all in turn);
- a host that is really gone (power off, a partition that never heals) still ends the job on every host
  within the loss timeout + 2 s, every report naming the lost host, exit code 137: those two are in
  tests/test_jobwatch_netns.py, with the other definite ends (a worker's exit, its SIGKILL).

Every test proves that nothing is left: every process of both hosts (the machine's PIDs, read from their
network namespaces before the fault), simulate, the lab, the fault's own leftovers (the cgroup, the busy
loops, by PID). Skipped, with the reason, where network namespaces are not permitted.
"""

from __future__ import annotations

import glob
import os
import re
import time
from typing import Any

import pytest
from conftest import assert_gone, launcher_env
from test_jobwatch_netns import started
from test_simulate import Simulate, job_pids, processes_inside, rank_records, read_json
from test_simulate_netns import ALLREDUCE, _cmdline, _ppid, machine  # noqa: F401  (machine: a fixture)

from launcher.simulate import faults, netns

WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}"),
              pytest.mark.usefixtures("machine"), pytest.mark.job, pytest.mark.lab]

STEP_SLEEP = 0.25  # seconds between all-reduces: a cheap DDP loop, 4 collectives a second
FAULT_STEP = 5  # the fault fires when the faulted host's worker prints this step
AFTER = 4.0  # seconds of training the job still has when the fault ends (at least)


def simulate(tmp_path: Any, name: str, specs: list[str], steps: int, deadline: float) -> tuple[Simulate, str]:
    workdir = str(tmp_path / name)
    args = ["--hosts", "2", "--nproc-per-node", "1", "--platform-stop", "off", "--deadline", f"{deadline:g}",
            "--workdir", workdir, "--job-name", name, *(w for spec in specs for w in ("--fault", spec)),
            "--", ALLREDUCE, "--steps", str(steps), "--step-sleep", str(STEP_SLEEP)]
    return Simulate(args, str(tmp_path), launcher_env()), workdir


def fault_line(sim: Simulate, text: str, nth: int = 0, timeout: float = 150.0) -> str:
    """simulate's ``nth`` log line containing ``text``, once it came (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in list(sim.err) if text in line]
        if len(found) > nth:
            return found[nth]
        assert time.monotonic() < deadline and sim.proc.poll() is None, sim.stderr[-3000:]
        time.sleep(0.01)


def nothing_left(sim: Simulate, workdir: str, processes: list[int], holder: list[int], inodes: set[int]) -> dict:
    """Every process of both hosts, simulate and the lab are gone; returns the summary."""
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert_gone(processes)
    assert_gone(job_pids(rank_records(workdir, 2), sim.proc.pid, summary))
    assert_gone([sim.proc.pid, *holder])  # the lab's holder gone: the namespaces are freed
    assert netns.namespace_pids(inodes) == [] and processes_inside(workdir) == []
    assert summary["network"] == "netns" and not summary["deadline_reached"], sim.stderr[-3000:]
    if faults.starve_unavailable() is None:  # no cgroup of this run is left
        parent = faults.cgroup_parent()[1]
        assert glob.glob(os.path.join(parent, f"ddp-simulate-{sim.proc.pid}-*")) == []
    return summary


# ------------------------------------------------------------------------------------------------
# Transient faults: the job survives
# ------------------------------------------------------------------------------------------------
# One job per host meets every kind of fault in turn (a real job meets several), each AFTER s of training
# after the end of the one before: a job per host, not per kind, spares seven start-ups of torch.
# Each kind at the ends of its range below the loss timeout (30 s): a link down for 2 s and for 10 s, a launcher
# paused for 10 s; CPUs saturated for longer than the loss timeout (the heartbeats must still get through).
TRANSIENT = {"algo-1": (("blip", (2, 10)), ("pause", (10,)), ("vmpause", (5,)), ("starve", (10,))),
             "algo-2": (("blip", (2, 10)), ("pause", (10,)), ("vmpause", (5,)), ("starve", (10,)),
                        ("saturate", (40,)))}
STALLING = ("blip", "vmpause", "starve")  # the workers wait in a collective while it lasts


def fault_steps(in_turn: list[tuple[str, int]]) -> tuple[list[int], int]:
    """The step at which each fault fires, and the job's number of steps: after each fault the job trains
    at least AFTER s more (the steps go on during a fault unless it stalls the workers)."""
    triggers, step = [], FAULT_STEP
    for kind, seconds in in_turn:
        triggers.append(step)
        step += int(((0 if kind in STALLING else seconds) + AFTER) / STEP_SLEEP)
    return triggers, step


@pytest.mark.parametrize("host", sorted(TRANSIENT), ids=[
    f"{h}-" + "-".join(f"{k}{'+'.join(map(str, s))}s" for k, s in TRANSIENT[h]) for h in sorted(TRANSIENT)])
def test_transient_faults_the_job_survives_and_every_host_exits_0(tmp_path: Any, host: str) -> None:
    kinds = [(k, s) for k, s in TRANSIENT[host] if k != "starve" or faults.starve_unavailable() is None]
    if len(kinds) < len(TRANSIENT[host]):
        print(f"\nno CPU quota here, no starvation: {faults.starve_unavailable()}")
    in_turn = [(kind, seconds) for kind, lengths in kinds for seconds in lengths]
    triggers, steps = fault_steps(in_turn)
    specs = [f"{host}:{kind}:step={step}:{seconds}" for step, (kind, seconds) in zip(triggers, in_turn)]
    sim, workdir = simulate(tmp_path, f"faults-{host}", specs, steps,
                            deadline=sum(seconds for _kind, seconds in in_turn) + 400)
    fired, ended = [], []
    try:
        processes, holder, inodes = started(sim, workdir)
        for i, (kind, seconds) in enumerate(in_turn):
            nth = [k for k, _s in in_turn[:i]].count(kind)
            fired.append(fault_line(sim, f"fault: {kind} of {host} at ", nth=nth))
            ended.append(fault_line(sim, f"fault: {kind} of {host} ended at ", nth=nth, timeout=seconds + 150))
        code = sim.finish()
    finally:
        if sim.proc.poll() is None:
            sim.abort()
    summary = nothing_left(sim, workdir, processes, holder, inodes)
    for (kind, _seconds), began, done in zip(in_turn, fired, ended):
        if kind == "saturate":  # the busy loops, by their PIDs
            loops = [int(p) for p in re.findall(r"\d+", began.split("pid ")[1].split(", pinned")[0])]
            assert len(loops) >= 1 and f"busy loop(s) {', '.join(map(str, loops))} killed" in done, (began, done)
            assert_gone(loops)
    hosts = {h["host"]: h for h in summary["hosts"]}
    assert code == 0 and [h["exit_code"] for h in hosts.values()] == [0, 0], sim.stderr[-4000:]
    transient = hosts[host]["transient_faults"]
    assert [(t["kind"], t["seconds"]) for t in transient] == in_turn, hosts[host]
    for t in transient:
        assert t["seconds"] <= t["ended"] - t["at"] <= t["seconds"] + 2, transient  # simulate turns every 50 ms
    for name, h in hosts.items():  # the job went on after the last fault, to its last step, on every host
        assert h["ended"] > transient[-1]["ended"] + 1, (name, h, transient)
        assert h["failure"] == "" and not os.path.exists(os.path.join(workdir, name, "output", "failure"))
    records = rank_records(workdir, 2)
    assert [r["steps"] for recs in records.values() for r in recs] == [steps, steps], records
    assert os.path.exists(os.path.join(workdir, "algo-1", "model", "model.json"))
    last = max(h["ended"] for h in hosts.values())
    print(f"\n{host}: survived {', '.join(f'{k} {s} s' for k, s in in_turn)}; {steps} steps, the job ended "
          f"{last - transient[-1]['ended']:.1f} s after the last fault ended ({last:.1f} s in all)")

