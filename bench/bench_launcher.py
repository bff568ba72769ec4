"""Benchmark: our launcher vs plain torchrun on the same one-host, two-process job.

Prints the median wall time of each over alternating pairs and their ratio (target <= 1.03), and the
launcher process's own start-up: its import time (``python -X importtime``), the wall time of a
``--dry-run``, and whether torch was imported (it must not be).

    .venv/bin/python bench/bench_launcher.py [--pairs 15] [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import bench_tmpdir  # bench/ is the script's directory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "scripts", "launcher_worker.py")


def environment(record_dir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "LAUNCHER_", "SAGEMAKER_"))}
    env.update(PYTHONPATH=REPO, WORKER_RECORD_DIR=record_dir, OMP_NUM_THREADS="1", TMPDIR=bench_tmpdir())
    return env


def timed(argv: list[str], env: dict[str, str]) -> float:
    return measured(argv, env)[0]


def measured(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process tree: every descendant is reaped by its parent)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


RUN_PATH = "import launcher.cli, launcher.supervise, launcher.failure"  # all a launch imports


def startup(env: dict[str, str]) -> tuple[float, float, float, bool]:
    """(run-path import ms by -X importtime, dry-run wall ms over a bare interpreter, bare ms, torch?)."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", RUN_PATH], env=env, check=True,
                         capture_output=True, text=True).stderr
    ours_us = 0
    torch_seen = False
    for line in err.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _self, cumulative, raw_name = line[len("import time:"):].split("|")
        name = raw_name.strip()
        torch_seen = torch_seen or name.startswith("torch")
        if name.startswith("launcher") and raw_name.startswith(" launcher"):  # top level: not indented
            ours_us += int(cumulative)
    dry = statistics.median(timed([sys.executable, "-m", "launcher", "--dry-run", WORKER], env) for _ in range(15))
    bare = statistics.median(timed([sys.executable, "-c", "pass"], env) for _ in range(15))
    return ours_us / 1000, (dry - bare) * 1000, bare * 1000, torch_seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as records:
        env = environment(records)
        job = [WORKER, "--steps", str(args.steps)]
        ours_cmd = [sys.executable, "-m", "launcher", "--nproc-per-node", "2", *job]
        plain_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *job]
        timed(plain_cmd, env)  # warm the page cache once
        runs: dict[str, list[tuple[float, float]]] = {"ours": [], "plain": []}
        for i in range(args.pairs):
            order = ["ours", "plain"] if i % 2 == 0 else ["plain", "ours"]
            for name in order:
                runs[name].append(measured(ours_cmd if name == "ours" else plain_cmd, env))
        ours, plain = [w for w, _ in runs["ours"]], [w for w, _ in runs["plain"]]
        ours_cpu, plain_cpu = [c for _, c in runs["ours"]], [c for _, c in runs["plain"]]
        import_ms, startup_ms, bare_ms, torch_seen = startup(env)
    ratios = [o / p for o, p in zip(ours, plain)]
    print(f"one host, 2 processes, {args.steps} DDP steps, {args.pairs} alternating pairs")
    print("| measure | ddp-launcher | plain torchrun | ratio |")
    print("|---|---|---|---|")
    print(f"| median wall time | {statistics.median(ours):.2f} s | {statistics.median(plain):.2f} s | "
          f"{statistics.median(ours) / statistics.median(plain):.3f} (median of pair ratios "
          f"{statistics.median(ratios):.3f}) |")
    print(f"| median CPU time of the whole process tree | {statistics.median(ours_cpu):.2f} s | "
          f"{statistics.median(plain_cpu):.2f} s | {statistics.median(ours_cpu) / statistics.median(plain_cpu):.3f} |")
    print(f"| launcher imports on the launch path (-X importtime) | {import_ms:.1f} ms | | |")
    print(f"| start-up: `--dry-run` wall time minus a bare interpreter ({bare_ms:.0f} ms) | {startup_ms:.0f} ms "
          "| | |")
    print(f"| torch imported by the launcher process | {'YES' if torch_seen else 'no'} | | |")


if __name__ == "__main__":
    main()
