"""Benchmark ``ddp-launcher simulate`` against plain torchrun on the same small DDP script.

1. Wall time: ``simulate --hosts 2 --nproc-per-node 1`` against ``torchrun --standalone
   --nproc-per-node 2`` (2 ranks both), in alternating pairs (the order flips every pair); the median
   of the per-pair ratios. Two workloads: a short job (start-up and tear-down dominate) and a job of
   about 5 s.
2. Time from one host's death to the last host's exit: ``simulate --fault algo-2:SIGKILL:step=N``
   (from the fault to the last exit, from ``summary.json``) against two torchrun processes joined by
   the static rendezvous, where node 1 (torchrun and its worker) is killed with SIGKILL after its
   worker printed ``step=N``, timed until node 0's torchrun exits. Two cases: the survivors are in
   a collective (0.1 s between all-reduces), or busy between collectives (20 s between them).

Usage: ``.venv/bin/python bench/bench_simulate.py [--pairs 5] [--repeats 3]``. Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchlib import clean_env, free_port  # noqa: E402  (bench/ is the script's directory)

from launcher import proctree  # noqa: E402  (after the path is set)

PYTHON = sys.executable
SCRIPT = os.path.join(REPO, "tests", "scripts", "ddp_allreduce.py")
TARGET_RATIO = 1.10
TARGET_DEATH = 10.0
PLAIN_TORCHRUN_CAP = 120.0
DEATH_CASES = {"survivors in a collective (all-reduce every 0.1 s)": ("5", "0.1"),
               "survivors busy between collectives (all-reduce every 20 s)": ("1", "20")}
WORKLOADS = {"short (3 steps)": ["--steps", "3", "--step-sleep", "0.01"],
             "about 5 s (50 steps x 0.1 s)": ["--steps", "50", "--step-sleep", "0.1"]}






def timed(argv: Sequence[str], env: dict[str, str], cwd: str) -> float:
    """Run to the end, fail loudly on a non-zero exit; returns the wall time."""
    start = time.monotonic()
    proc = subprocess.run(list(argv), env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr.decode()[-2000:]}")
    return time.monotonic() - start


def run_simulate(args: Sequence[str], tmp: str) -> float:
    workdir = tempfile.mkdtemp(dir=tmp)
    os.rmdir(workdir)
    return timed([PYTHON, "-m", "launcher", "simulate", "--hosts", "2", "--nproc-per-node", "1",
                  "--workdir", workdir, "--", SCRIPT, *args], clean_env(), tmp)


def run_torchrun(args: Sequence[str], tmp: str) -> float:
    out = tempfile.mkdtemp(dir=tmp)
    return timed([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  SCRIPT, *args], clean_env(SM_OUTPUT_DATA_DIR=out, SM_MODEL_DIR=out), tmp)


def wall_time_pairs(args: Sequence[str], pairs: int, tmp: str) -> list[tuple[float, float]]:
    """(simulate, torchrun) wall times; the order alternates from pair to pair."""
    results = []
    for i in range(pairs):
        if i % 2 == 0:
            sim = run_simulate(args, tmp)
            plain = run_torchrun(args, tmp)
        else:
            plain = run_torchrun(args, tmp)
            sim = run_simulate(args, tmp)
        results.append((sim, plain))
        print(f"  pair {i + 1}: simulate {sim:.2f} s, torchrun {plain:.2f} s, ratio {sim / plain:.3f}",
              flush=True)
    return results


def simulate_death(tmp: str, step: str, pause: str) -> float:
    """simulate with a lost host: seconds from the fault to the last host's exit."""
    workdir = os.path.join(tempfile.mkdtemp(dir=tmp), "job")
    subprocess.run([PYTHON, "-m", "launcher", "simulate", "--hosts", "2", "--workdir", workdir,
                    "--fault", f"algo-2:SIGKILL:step={step}", "--", SCRIPT, "--steps", "0",
                    "--step-sleep", pause], env=clean_env(), cwd=tmp, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=300)
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as fh:
        return float(json.load(fh)["fault_to_last_exit"])


def _start_node(rank: int, port: int, tmp: str, pause: str) -> subprocess.Popen:
    out = tempfile.mkdtemp(dir=tmp)
    argv = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--rdzv-backend", "static", "--local-addr", "127.0.0.1", SCRIPT, "--steps", "0",
            "--step-sleep", pause]
    return subprocess.Popen(argv, env=clean_env(SM_OUTPUT_DATA_DIR=out, SM_MODEL_DIR=out), cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)


def _when_printed(proc: subprocess.Popen, text: bytes) -> threading.Event:
    seen = threading.Event()

    def read() -> None:
        for line in iter(proc.stdout.readline, b""):  # type: ignore[union-attr]
            if text in line:
                seen.set()
    threading.Thread(target=read, daemon=True).start()
    return seen


def torchrun_death(tmp: str, step: str, pause: str) -> Optional[float]:
    """Two static-rendezvous torchruns; node 1 killed (tree) at a step; node 0's time to exit."""
    port = free_port()
    nodes = [_start_node(rank, port, tmp, pause) for rank in (0, 1)]
    try:
        if not _when_printed(nodes[1], f"step={step} ".encode()).wait(timeout=120):
            raise SystemExit(f"plain torchrun never reached step {step}")
        killed = time.monotonic()
        proctree.kill_tree([nodes[1].pid])
        try:
            nodes[0].wait(timeout=PLAIN_TORCHRUN_CAP)
            return time.monotonic() - killed
        except subprocess.TimeoutExpired:
            return None
    finally:
        for node in nodes:
            proctree.kill_tree([node.pid])
            node.wait()


def repeat(measure: Callable[..., Optional[float]], times: int, tmp: str, name: str,
           case: tuple[str, str]) -> list:
    values = []
    for i in range(times):
        value = measure(tmp, *case)
        values.append(value)
        shown = "did not exit" if value is None else f"{value:.2f} s"
        print(f"  {name} {i + 1}: {shown}", flush=True)
    return values


def median_text(values: Sequence[Optional[float]]) -> str:
    known = [v for v in values if v is not None]
    if len(known) < len(values):
        return f"> {PLAIN_TORCHRUN_CAP:g} s ({len(values) - len(known)} of {len(values)} never exited)"
    return f"{statistics.median(known):.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    tmp = tempfile.mkdtemp(prefix="bench-simulate-")
    try:
        for name, script_args in WORKLOADS.items():
            print(f"wall time, {name}:", flush=True)
            pairs = wall_time_pairs(script_args, args.pairs, tmp)
            ratio = statistics.median(s / p for s, p in pairs)
            rows.append((f"wall time, {name}, median of {args.pairs} pairs",
                         f"{statistics.median(s for s, _ in pairs):.2f} s",
                         f"{statistics.median(p for _, p in pairs):.2f} s",
                         f"ratio {ratio:.3f} (target <= {TARGET_RATIO:.2f}: "
                         f"{'met' if ratio <= TARGET_RATIO else 'NOT met'})"))
        for name, case in DEATH_CASES.items():
            print(f"death of one host -> last host's exit, {name}:", flush=True)
            sim = repeat(simulate_death, args.repeats, tmp, "simulate", case)
            plain = repeat(torchrun_death, args.repeats, tmp, "torchrun", case)
            worst = max(sim)
            rows.append((f"host death -> last exit, {name}, median of {args.repeats}",
                         median_text(sim), median_text(plain),
                         f"worst simulate {worst:.2f} s (target <= {TARGET_DEATH:g} s: "
                         f"{'met' if worst <= TARGET_DEATH else 'NOT met'})"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    return 0


def print_table(rows: Sequence[tuple[str, str, str, str]]) -> None:
    header = ("measure", "simulate (2 hosts x 1)", "plain torchrun", "verdict")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    print()
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))


if __name__ == "__main__":
    sys.exit(main())
