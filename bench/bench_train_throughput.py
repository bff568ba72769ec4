"""Benchmark: training throughput of train_scripts/train_cifar10.py vs the seed's CIFAR-10 train.py.

Both train the same network on the same in-memory synthetic images (``--synthetic N``; the bench
checks that the two scripts hold identical pixels and labels) with the same batch size per process
(16, the seed's default) and 2 processes under torchrun (gloo, CPU; torchrun sets
``OMP_NUM_THREADS=1``). The seed copy is ``bench/seed_cifar10_train.py`` (see its header); it keeps
its DataLoader with ``--workers`` (default 2) and its per-sample PIL transform.

What is timed: the steady epochs of one run, from the lines each script prints (read unbuffered as
they come), so start-up, the first epoch's warm-up and the final save are left out:

- the seed: from ``Rank 0: Starting epoch 1`` to ``Rank 0: Finished Training`` (epochs 2..E);
- ours: from ``METRIC epoch=1`` to ``METRIC epoch=E`` (epochs 2..E, *with* our per-epoch evaluation
  and checkpoints, which the seed does not do: they count against our script).

Images/s = N * (E - 1) / that wall time. The machine may be shared, so the CPU time the run's whole
process tree (ranks and DataLoader workers) spent in the same window is also read from /proc:
images per CPU-second is much less disturbed by other load. Rounds alternate the order of the
scripts; ratios are the medians of the per-round ratios.

    .venv/bin/python bench/bench_train_throughput.py [--rounds 5] [--images 2000] [--epochs 3] [--variants]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = os.path.join(REPO, "train_scripts", "train_cifar10.py")
SEED = os.path.join(REPO, "bench", "seed_cifar10_train.py")
TICKS = os.sysconf("SC_CLK_TCK")


def check_same_data(images: int) -> None:
    """Both scripts' synthetic data sets hold the same pixels and labels (HWC vs CHW aside)."""
    sys.path[:0] = [os.path.join(REPO, "train_scripts"), os.path.join(REPO, "bench")]
    import seed_cifar10_train
    import train_cifar10

    ours = train_cifar10.synthetic(images)
    for train, (x, y) in ((True, ours[:2]), (False, ours[2:])):
        seed = seed_cifar10_train.SyntheticCIFAR10(images, train=train)
        assert (seed.data == x.permute(0, 2, 3, 1).numpy()).all() and seed.targets == y.tolist()


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SM_", "SAGEMAKER_", "LAUNCHER_", "TORCHELASTIC_", "PET_", "DDP_UTILS_"))}
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 for both
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive when printed (the launcher sets this too)
    return env


def tree_cpu(root: int) -> float:
    """CPU seconds used so far by ``root`` and its descendants (children they reaped included)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parents[int(name)] = int(fields[1])
        times[int(name)] = sum(int(f) for f in fields[11:15]) / TICKS  # utime stime cutime cstime
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(times.get(pid, 0.0) for pid in tree)


@dataclass
class Measured:
    wall: float  # seconds between the two markers
    cpu: float  # CPU seconds of the process tree between them


def run_once(script_args: list[str], start_marker: str, end_marker: str, workdir: str) -> Measured:
    """One ``torchrun --standalone --nproc-per-node 2`` run, timed between two output lines."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            *script_args]
    proc = subprocess.Popen(argv, cwd=workdir, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    drain = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    drain.start()
    marks: dict[str, tuple[float, float]] = {}
    out: list[str] = []
    for line in proc.stdout:
        out.append(line)
        for marker in (start_marker, end_marker):
            if marker in line and marker not in marks:
                marks[marker] = (time.perf_counter(), tree_cpu(proc.pid))
    code = proc.wait()
    drain.join(timeout=10)
    if code != 0 or len(marks) != 2:
        raise SystemExit(f"failed ({code}, markers {sorted(marks)}): {' '.join(argv)}\n"
                         f"{''.join(out)[-2000:]}\n{''.join(err)[-3000:]}")
    (wall0, cpu0), (wall1, cpu1) = marks[start_marker], marks[end_marker]
    return Measured(wall1 - wall0, cpu1 - cpu0)


def variants(args: argparse.Namespace, out: str) -> dict[str, tuple[list[str], str, str]]:
    """Name -> (script and arguments, start marker, end marker)."""
    common = ["--synthetic", str(args.images), "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)]
    seed = ([SEED, *common, "--workers", str(args.seed_workers), "--backend", "gloo", "--output-dir", out],
            "Rank 0: Starting epoch 1", "Rank 0: Finished Training")
    ours_args = [OURS, *common, "--resume", "false", "--output-dir", out,
                 "--checkpoint-dir", os.path.join(out, "checkpoints")]
    markers = ("METRIC epoch=1 ", f"METRIC epoch={args.epochs} ")
    found = {f"seed train.py (--workers {args.seed_workers})": seed,
             "ours train_cifar10.py (defaults)": (ours_args, *markers)}
    if args.variants:  # opt-in on CPU: not the defaults (the defaults keep these on GPU only)
        found["ours + --channels-last true"] = ([*ours_args, "--channels-last", "true"], *markers)
        found["ours + --channels-last true --bf16 true"] = (
            [*ours_args, "--channels-last", "true", "--bf16", "true"], *markers)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=2000, help="synthetic training images")
    parser.add_argument("--epochs", type=int, default=3, help="per run; epochs 2.. are timed")
    parser.add_argument("--batch-size", type=int, default=16, help="per process (the seed's default)")
    parser.add_argument("--seed-workers", type=int, default=2, help="the seed's --workers (its default 2)")
    parser.add_argument("--variants", action="store_true",
                        help="also time our script with CPU channels_last and bf16 autocast (opt-in flags)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2")
    last_test_batch = max(args.images // 5, 10) % args.batch_size
    if 0 < last_test_batch < 10:  # the seed's evaluate() indexes labels[0..9] of every batch
        parser.error(f"the seed's evaluation fails on a last test batch of {last_test_batch} (< 10) images: "
                     "choose --images so that images // 5 is a multiple of the batch size")
    check_same_data(args.images)
    images = args.images * (args.epochs - 1)
    results: dict[str, list[Measured]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        runs = variants(args, os.path.join(tmp, "out"))
        results = {name: [] for name in runs}
        for round_index in range(args.rounds):
            order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
            for name in order:
                script_args, start, end = variants(args, os.path.join(tmp, f"{round_index}-{len(results[name])}"
                                                                  f"-{list(runs).index(name)}"))[name]
                m = run_once(script_args, start, end, tmp)
                results[name].append(m)
                print(f"round {round_index + 1}: {name}: {m.wall:.1f} s, {m.cpu:.1f} CPU-s -> "
                      f"{images / m.wall:.0f} images/s, {images / m.cpu:.0f} images/CPU-s", flush=True)

    seed_name = next(iter(results))
    width = max(len(n) for n in results)
    print(f"\n{args.images} synthetic images x {args.epochs - 1} timed epochs, batch {args.batch_size} per "
          f"process, 2 processes (torchrun, gloo, CPU), {args.rounds} rounds (medians)\n")
    print(f"{'script':<{width}}  {'images/s':>9}  {'vs seed':>8}  {'images/CPU-s':>12}  {'vs seed':>8}  "
          "wall ratio per round")
    for name, measured in results.items():
        rates = [images / m.wall for m in measured]
        ratios = [images / m.wall / (images / s.wall) for m, s in zip(measured, results[seed_name])]
        cpu_ratios = [s.cpu / m.cpu for m, s in zip(measured, results[seed_name])]
        print(f"{name:<{width}}  {statistics.median(rates):9.0f}  {statistics.median(ratios):7.2f}x  "
              f"{statistics.median(images / m.cpu for m in measured):12.0f}  "
              f"{statistics.median(cpu_ratios):7.2f}x  " + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
