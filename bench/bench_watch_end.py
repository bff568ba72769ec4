"""Benchmark: what the job watch adds to a whole job, against the same launcher without it and plain torchrun.

Two hosts on 127.0.0.1 (the ``env`` platform: ``MASTER_ADDR``, ``MASTER_PORT``, ``NNODES``,
``NODE_RANK``), one rank each, ``tests/scripts/ddp_allreduce.py --steps 3`` (a job of about 5 s: the
start-up and the end dominate). Each round runs four jobs, in an order that rotates every round:

- ``watch``: the launcher as it is (its job watch on: node 0's hub, node 1 connects to it);
- ``nowatch`` and ``nowatch2``: the launcher with ``--no-job-watch``, twice: the ratio of two identical
  jobs is this machine's noise;
- ``torchrun``: plain torchrun with the flags the launcher gives it (static rendezvous).

A job's time runs from starting both hosts until both have exited. Printed: each way's median, and the
medians (with the middle half) of the per-round ratios watch/nowatch, nowatch2/nowatch (the noise) and
watch/torchrun, nowatch/torchrun. The job watch costs nothing measurable when watch/nowatch lies within
the noise's middle half.

Usage: ``.venv/bin/python bench/bench_watch_end.py [--rounds 12]``. Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from benchlib import REPO, clean_env, free_port, spread

PYTHON = sys.executable
SCRIPT = os.path.join(REPO, "tests", "scripts", "ddp_allreduce.py")
WAYS = ("watch", "nowatch", "torchrun", "nowatch2")


def job_env(**extra: str) -> dict[str, str]:
    """A clean environment (no platform's variables but those of this job)."""
    env = {k: v for k, v in clean_env().items() if not k.startswith(("SLURM_", "PBS_"))
           and k not in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def argv_for(way: str, rank: int, port: int) -> list[str]:
    script = [SCRIPT, "--steps", "3"]
    if way == "torchrun":
        return [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--rdzv-backend", "static", "--max-restarts", "0", *script]
    flags = ["--nproc-per-node", "1"] + (["--no-job-watch"] if way.startswith("nowatch") else [])
    return [PYTHON, "-m", "launcher", *flags, *script]


def run_job(way: str, tmp: str) -> float:
    """Both hosts of one job; seconds from the first start until the last exit."""
    port = free_port()
    started = time.monotonic()
    procs = []
    for rank in (0, 1):
        env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NNODES="2", NODE_RANK=str(rank),
                        SM_OUTPUT_DATA_DIR=tmp, SM_MODEL_DIR=tmp)
        procs.append(subprocess.Popen(argv_for(way, rank, port), cwd=tmp, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    codes = [proc.wait(timeout=300) for proc in procs]
    took = time.monotonic() - started
    if codes != [0, 0]:
        raise SystemExit(f"bench_watch_end: {way} exited {codes}")
    return took


def main(argv: Sequence[str] = ()) -> int:
    """Run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(list(argv) or None)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="bench-watch-end-") as tmp:
        for i in range(args.rounds):
            order = WAYS[i % len(WAYS):] + WAYS[:i % len(WAYS)]
            for way in order:
                times[way].append(run_job(way, tmp))
            print(f"  round {i + 1}: " + ", ".join(f"{way} {times[way][-1]:.2f} s" for way in WAYS), flush=True)
    ratio = {name: [a / b for a, b in zip(times[top], times[bottom])]
             for name, top, bottom in (("watch/nowatch", "watch", "nowatch"), ("nowatch2/nowatch (noise)", "nowatch2",
                                                                                 "nowatch"),
                                       ("watch/torchrun", "watch", "torchrun"),
                                       ("nowatch/torchrun", "nowatch", "torchrun"))}
    print(f"\n2 hosts x 1 rank on 127.0.0.1, a 3-step job, {args.rounds} rounds; median (middle half)")
    for way in WAYS:
        print(f"| {way} | {spread(times[way])} s |")
    for name, values in ratio.items():
        print(f"| {name} | {spread(values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
