"""Benchmark: how long a failure costs, side by side: the launcher's job-wide restart in place, plain torchrun's
``--max-restarts``, and a whole new launch of the job (every host started again, as a platform retry does).

N hosts (2 and 4), each its own network namespace on a private bridge, one rank each, running
tests/scripts/restart_worker.py: rank 1 exits 3 at step 60 (``--fail-step``; 0.3 s a step: the job trains for about
20 s first, as a real one trains minutes or hours before a failure) of the first generation and trains normally
in any later one; every rank resumes from rank 0's checkpoint (written after every step). Measured, per round:

- **restart**: seconds from the fault (the failing rank's own clock, written just before it exits) until every
  rank of the new generation took a step (each rank's record);
- **own start**: the script's own start and checkpoint load in the new generation: from the slowest rank's
  script start (its first line, before it imports torch) to its first step. A generation started ahead
  (launcher/ahead.py) imported torch before the script's first line: its own start is then shorter than a
  fresh start's.

Contenders:

- ``launcher``: ``simulate --hosts N --nproc-per-node 1 --platform-stop off`` with ``LAUNCHER_MAX_RESTARTS=1``;
- ``launcher-at-end``: the same with ``DDP_LAUNCHER_AHEAD=end``: the next generation started ahead (met and held
  before the script, torch imported) only once this host's generation ended, while the hosts stop, not at the
  generation's first step (launcher/ahead.py);
- ``launcher-not-ahead``: the same with ``DDP_LAUNCHER_AHEAD=0``: the next generation started after node 0's
  decision;
- ``torchrun``: plain ``python -m torch.distributed.run`` static rendezvous (``--node-rank``, rank 0 on
  algo-1) with ``--max-restarts 3`` on every host, in the same kind of lab. Its count is per host and only
  the failed host restarts first (pytorch#146371): ``never`` when no generation after the fault had every
  rank take a step within the cap;
- ``relaunch``: the launcher without restarts (the job fails on every host), then the whole job started again
  at once (a second ``simulate``) from the same checkpoint; a platform would first provision the instances
  and pull the image again (minutes on SageMaker, not counted here);
- ``ft_launcher``: NVIDIA nvidia-resiliency-ext's ``ft_launcher`` (a torchrun with in-job restarts of the whole
  worker group, c10d rendezvous on algo-1) with ``--max-restarts 3`` on every host, in the same kind of lab;
  from ``.nvrx/`` (``make .nvrx/.installed``: kept out of .venv, whose every ``import torch`` its dependency
  pynvml would make print a warning), or left out when it is not there.

For the launcher, each restart's phases on every host (the outcome file's ``restarts[].phases``: detection, stop,
barrier, new torchrun, first step) are printed too: per phase, the median over the rounds of the slowest host; and
``beyond``: per round, the restart less a fresh start's own start in the same round (the relaunch's, else the
not-ahead contender's, else its own): the launcher's part (the goal: at most 2 s).

Usage: ``.venv/bin/python bench/bench_restart.py [--rounds 2] [--hosts 2,4] [--cap 120] [--only launcher,...]
[--fail-step 60]``
(``--hosts 2,4,8,16`` for the phases at every size).
Needs network namespaces (root or unprivileged user namespaces); only the lab's private addresses are used.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchlib import clean_env  # noqa: E402  (bench/ is the script's directory)

from launcher.simulate import netns  # noqa: E402  (after the path is set)

PYTHON = sys.executable
SCRIPT = os.path.join(REPO, "tests", "scripts", "restart_worker.py")
PORT = 29500  # inside the lab's private namespaces: no clash with anything on the machine
FAIL_STEP = 60  # the fault's step (--fail-step): the job trains a while first (0.3 s a step), as real ones do
FAULT = ["--fail", "exit", "--fail-rank", "1", "--fail-in", "0"]
CONTENDERS = ("launcher", "launcher-at-end", "launcher-not-ahead", "torchrun", "relaunch", "ft_launcher")
PHASES = ("detection", "stop", "barrier", "new_torchrun", "first_step")
FT_LAUNCHER = "nvidia_resiliency_ext.fault_tolerance.launcher"
NVRX = os.path.join(REPO, ".nvrx")  # where make puts it (see the Makefile)


def steps() -> list[str]:
    """The script's steps: the fault's, then a few more after the restart."""
    return ["--steps", str(FAIL_STEP + 5), "--fail-step", str(FAIL_STEP)]


def read(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def records(out: str) -> list[dict]:
    """Every rank's record of every generation."""
    found = []
    for path in glob.glob(os.path.join(out, "g*.r*.json")):
        with contextlib.suppress(OSError, ValueError):  # being replaced right now: its next version counts
            found.append(read(path))
    return found


def measure(outs: Sequence[str], world: int) -> tuple[Optional[float], Optional[float]]:
    """(restart, own start) from the records: every rank's first step after the fault, in any generation
    that started after it; None when some rank never took one."""
    try:
        fault = read(os.path.join(outs[0], "fault.json"))["at"]
    except OSError:
        return None, None
    firsts: dict[int, dict] = {}
    for out in outs:
        for rec in records(out):
            if rec["started"] > fault and rec.get("first_step_at") is not None:
                best = firsts.get(rec["rank"])
                if best is None or rec["first_step_at"] < best["first_step_at"]:
                    firsts[rec["rank"]] = rec
    if len(firsts) < world:
        return None, None
    return (max(r["first_step_at"] for r in firsts.values()) - fault,
            max(r["first_step_at"] - r["started"] for r in firsts.values()))


def simulate(tmp: str, name: str, hosts: int, out: str, cap: float, script_args: Sequence[str],
             environ: Optional[dict[str, str]] = None, **options: str) -> int:
    env = clean_env(**{f"LAUNCHER_{k.upper()}": v for k, v in options.items()}, **(environ or {}))
    argv = [PYTHON, "-m", "launcher", "simulate", "--hosts", str(hosts), "--nproc-per-node", "1", "--network",
            "netns", "--platform-stop", "off", "--workdir", os.path.join(tmp, name), "--job-name", name,
            "--deadline", str(cap), "--", SCRIPT, "--out", out, *steps(), *script_args]
    with open(os.path.join(os.environ.get("BENCH_KEEP", tmp), f"{name}.log"), "w") as log:
        return subprocess.run(argv, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=cap + 60).returncode


def phases(workdir: str, hosts: int) -> dict[str, Optional[float]]:
    """The restart's phases, each the slowest host's (None where a host has none: the restart never came)."""
    found: dict[str, list[float]] = {name: [] for name in PHASES}
    for i in range(hosts):
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            spans = read(os.path.join(workdir, f"algo-{i + 1}", "output", "data", "outcome.json"))["restarts"][0]
            for name in PHASES:
                if spans["phases"].get(name) is not None:
                    found[name].append(spans["phases"][name])
    return {name: max(values) if len(values) == hosts else None for name, values in found.items()}


# (hosts, contender) -> each round's phases, and the restart less the own start ("beyond")
PHASES_SEEN: dict[tuple[int, str], list[dict[str, Optional[float]]]] = {}


def launcher(tmp: str, hosts: int, cap: float, name: str = "launcher",
             environ: Optional[dict[str, str]] = None) -> tuple[Optional[float], Optional[float]]:
    out = os.path.join(tmp, "out")
    os.mkdir(out)
    simulate(tmp, "restart", hosts, out, cap, FAULT, environ, max_restarts="1")
    restart, own = measure([out], hosts)
    seen = phases(os.path.join(tmp, "restart"), hosts)
    seen["restart"], seen["own"] = restart, own  # "beyond" is filled when the round is over (fresh_beyond)
    PHASES_SEEN.setdefault((hosts, name), []).append(seen)
    return restart, own


def launcher_at_end(tmp: str, hosts: int, cap: float) -> tuple[Optional[float], Optional[float]]:
    return launcher(tmp, hosts, cap, "launcher-at-end", {"DDP_LAUNCHER_AHEAD": "end"})


def launcher_not_ahead(tmp: str, hosts: int, cap: float) -> tuple[Optional[float], Optional[float]]:
    return launcher(tmp, hosts, cap, "launcher-not-ahead", {"DDP_LAUNCHER_AHEAD": "0"})


def relaunch(tmp: str, hosts: int, cap: float) -> tuple[Optional[float], Optional[float]]:
    first, second = os.path.join(tmp, "first-out"), os.path.join(tmp, "second-out")
    os.mkdir(first)
    os.mkdir(second)
    simulate(tmp, "first", hosts, first, cap, FAULT)  # fails on every host: the platform's retry starts now
    shutil.copy(os.path.join(first, "ckpt.json"), os.path.join(second, "ckpt.json"))
    simulate(tmp, "second", hosts, second, cap, [])
    return measure([first, second], hosts)


def torchrun(tmp: str, hosts: int, cap: float) -> tuple[Optional[float], Optional[float]]:
    return in_lab(tmp, hosts, cap, lambda i: [
        PYTHON, "-m", "torch.distributed.run", "--nnodes", str(hosts), "--nproc-per-node", "1", "--node-rank", str(i),
        "--master-addr", "algo-1", "--master-port", str(PORT), "--max-restarts", "3"])


def ft_launcher(tmp: str, hosts: int, cap: float) -> tuple[Optional[float], Optional[float]]:
    return in_lab(tmp, hosts, cap, lambda i: [
        PYTHON, "-m", FT_LAUNCHER, "--nnodes", str(hosts), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"algo-1:{PORT}", "--rdzv-id", "bench", "--max-restarts", "3",
        "--ignore-missing-fault-tol-cfg"])


def in_lab(tmp: str, hosts: int, cap: float, launch: Callable[[int], list[str]]) -> tuple[Optional[float],
                                                                                          Optional[float]]:
    """Run ``launch(i)`` and the script on every host of a lab until every rank stepped after the fault."""
    out = os.path.join(tmp, "out")
    os.mkdir(out)
    with netns.Lab(tmp) as lab:
        for i in range(hosts):
            lab.add_host(f"algo-{i + 1}", netns.host_address(i))
        procs = []
        for i in range(hosts):
            argv = [*launch(i), SCRIPT, "--out", out, *steps(), *FAULT]
            env = clean_env(PYTHONPATH=f"{NVRX}{os.pathsep}{REPO}") if FT_LAUNCHER in argv else clean_env()
            procs.append(subprocess.Popen(lab.command(f"algo-{i + 1}", argv), cwd=tmp, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + cap
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if measure([out], hosts)[0] is not None:
                break
            time.sleep(0.2)
        result = measure([out], hosts)
        lab.close()  # kills whatever still runs in the hosts
        for proc in procs:
            proc.wait()
    return result


def fresh_beyond(hosts: int, results: dict[str, list[tuple[Optional[float], Optional[float]]]]) -> None:
    """The round's ``beyond`` for the launcher's contenders: the restart less a fresh start's own start in this
    round (the relaunch's second job, else the not-ahead restart's), else less its own."""
    fresh = next((results[name][-1][1] for name in ("relaunch", "launcher-not-ahead")
                  if results.get(name) and results[name][-1][1] is not None), None)
    for name in ("launcher", "launcher-at-end", "launcher-not-ahead"):
        seen = PHASES_SEEN.get((hosts, name))
        if seen and "beyond" not in seen[-1]:
            restart, own = seen[-1]["restart"], fresh if fresh is not None else seen[-1]["own"]
            seen[-1]["beyond"] = None if restart is None or own is None else round(restart - own, 3)


def cell(values: Sequence[Optional[float]]) -> str:
    done = [v for v in values if v is not None]
    if not done:
        return "never"
    text = f"{statistics.median(done):.1f} s" + (f" ({min(done):.1f}-{max(done):.1f})" if len(done) > 1 else "")
    return text + (f", {len(values) - len(done)} of {len(values)} never" if len(done) < len(values) else "")


def main(argv: Optional[Sequence[str]] = None) -> int:
    global FAIL_STEP
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--cap", type=float, default=120.0)
    parser.add_argument("--only", default=",".join(CONTENDERS))
    parser.add_argument("--fail-step", type=int, default=FAIL_STEP)
    args = parser.parse_args(argv)
    FAIL_STEP = args.fail_step
    why = netns.unavailable()
    if why:
        print(f"network namespaces unavailable: {why}", file=sys.stderr)
        return 2
    runners = {"launcher": launcher, "launcher-at-end": launcher_at_end, "launcher-not-ahead": launcher_not_ahead,
               "torchrun": torchrun,
               "relaunch": relaunch, "ft_launcher": ft_launcher}
    chosen = [c for c in args.only.split(",") if c]
    if "ft_launcher" in chosen and not os.path.isdir(os.path.join(NVRX, "nvidia_resiliency_ext")):
        print(f"ft_launcher left out: nvidia-resiliency-ext is not in {NVRX} (make .nvrx/.installed)", file=sys.stderr)
        chosen.remove("ft_launcher")
    rows = []
    for hosts in (int(h) for h in args.hosts.split(",")):
        results: dict[str, list[tuple[Optional[float], Optional[float]]]] = {c: [] for c in chosen}
        for _ in range(args.rounds):
            for name in chosen:  # side by side: each round runs every contender once, in turn
                with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
                    results[name].append(runners[name](tmp, hosts, args.cap))
                print(f"{hosts} hosts, {name}: {results[name][-1]}", file=sys.stderr, flush=True)
            fresh_beyond(hosts, results)
        for name in chosen:
            rows.append(f"| {hosts} | {name} | {cell([r[0] for r in results[name]])} | "
                        f"{cell([r[1] for r in results[name]])} |")
    print("| hosts | contender | fault -> every rank's first step after it | own start + checkpoint load |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    if PHASES_SEEN:
        columns = (*PHASES, "beyond")
        print("\n| hosts | contender | " + " | ".join(name.replace("_", " ") for name in columns) + " |")
        print("|---|---|" + "---|" * len(columns))
        for (hosts, name), seen in sorted(PHASES_SEEN.items()):
            cells = [cell([round_[column] for round_ in seen]) for column in columns]
            print(f"| {hosts} | {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
