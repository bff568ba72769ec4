"""Benchmark: training throughput of train_scripts/train_cifar10.py vs the seed's CIFAR-10 train.py.

Both train the same network on the same in-memory synthetic images (``--synthetic N``; the bench
checks that the two scripts hold identical pixels and labels) with the same batch size per process
(16, the seed's default) and 2 processes under torchrun (gloo, CPU; torchrun sets
``OMP_NUM_THREADS=1``). The seed copy is ``bench/seed_cifar10_train.py`` (see its header); it keeps
its DataLoader with ``--workers`` (default 2) and its per-sample PIL transform.

Precision: the seed trains in fp32. Ours uses its defaults: bf16 autocast where the CPU computes bf16
natively (AVX512-BF16 or AMX-BF16, e.g. this machine's AMD EPYC; the header says which), else fp32,
and channels_last images. ``--variants`` also times ours in fp32 (``--bf16 false``), with and without
channels_last, so each part of the gain is shown on its own.

What is timed: the steady epochs of one run (epochs 2..E), so start-up, the first epoch's warm-up
and the final save are left out. Two windows, as the scripts do different work between epochs:

- training (the issue's measure): the seed from ``Rank 0: Starting epoch 1`` to ``Rank 0: Finished
  Training``, lines it prints (read unbuffered as they come): it does nothing but train in between
  (its DataLoader workers start again every epoch, and that counts). Ours: the ``train_seconds`` of
  epochs 2..E in its ``metrics.json``, rank 0's own clock from its first batch to its last step of
  each epoch (data, forward, backward, all-reduce, optimizer);
- whole epochs: ours from ``METRIC epoch=1`` to ``METRIC epoch=E``, i.e. *with* the per-epoch
  evaluation and checkpoint that the seed does not do (they count against our script).

Images/s = N * (E - 1) / the window. The machine may be shared, so the CPU time the run's whole
process tree (ranks and DataLoader workers) spent in the lines' window is also read from /proc:
images per CPU-second is much less disturbed by other load. Rounds alternate the order of the
scripts; ratios are the medians of the per-round ratios.

    .venv/bin/python bench/bench_train_throughput.py [--rounds 5] [--images 2000] [--epochs 3] [--variants]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from benchlib import bench_tmpdir  # bench/ is the script's directory

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
    env["TMPDIR"] = bench_tmpdir()
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
    train: float  # seconds spent training: ``wall`` for the seed, the timed epochs' train_seconds for ours


def run_once(script_args: list[str], start_marker: str, end_marker: str, metrics: str | None, *,
             epochs: int, workdir: str) -> Measured:
    """One ``torchrun --standalone --nproc-per-node 2`` run, timed between two output lines.

    With ``metrics`` (our script's ``metrics.json``), the training time is the sum of its
    ``train_seconds`` over epochs 2..``epochs``; without, the lines' window.
    """
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
    train = wall1 - wall0
    if metrics:
        with open(metrics, encoding="utf-8") as fh:
            history = json.load(fh)
        assert [r["epoch"] for r in history] == list(range(1, epochs + 1)), history
        train = sum(r["train_seconds"] for r in history[1:])
    return Measured(wall1 - wall0, cpu1 - cpu0, train)


def variants(args: argparse.Namespace, out: str) -> dict[str, tuple[list[str], str, str, str | None]]:
    """Name -> (script and arguments, start marker, end marker, metrics.json or None)."""
    common = ["--synthetic", str(args.images), "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)]
    seed = ([SEED, *common, "--workers", str(args.seed_workers), "--backend", "gloo", "--output-dir", out],
            "Rank 0: Starting epoch 1", "Rank 0: Finished Training", None)
    ours_args = [OURS, *common, "--resume", "false", "--output-dir", out,
                 "--checkpoint-dir", os.path.join(out, "checkpoints")]
    markers = ("METRIC epoch=1 ", f"METRIC epoch={args.epochs} ", os.path.join(out, "metrics.json"))
    found = {f"seed train.py (--workers {args.seed_workers})": seed,
             "ours train_cifar10.py (defaults)": (ours_args, *markers)}
    if args.variants:  # what the defaults' bf16 autocast and channels_last each bring
        found["ours --bf16 false"] = ([*ours_args, "--bf16", "false"], *markers)
        found["ours --bf16 false --channels-last false"] = (
            [*ours_args, "--bf16", "false", "--channels-last", "false"], *markers)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=2000, help="synthetic training images")
    parser.add_argument("--epochs", type=int, default=3, help="per run; epochs 2.. are timed")
    parser.add_argument("--batch-size", type=int, default=16, help="per process (the seed's default)")
    parser.add_argument("--seed-workers", type=int, default=2, help="the seed's --workers (its default 2)")
    parser.add_argument("--variants", action="store_true",
                        help="also time our script in fp32, and in fp32 without channels_last")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2")
    last_test_batch = max(args.images // 5, 10) % args.batch_size
    if 0 < last_test_batch < 10:  # the seed's evaluate() indexes labels[0..9] of every batch
        parser.error(f"the seed's evaluation fails on a last test batch of {last_test_batch} (< 10) images: "
                     "choose --images so that images // 5 is a multiple of the batch size")
    check_same_data(args.images)
    sys.path.insert(0, os.path.join(REPO, "train_scripts"))
    import ddp_utils

    bf16_flags = sorted(ddp_utils.cpu_flags() & ddp_utils.CPU_BF16_FLAGS)
    print(f"CPU bf16 in hardware: {', '.join(bf16_flags) or 'no'} -> our default precision "
          f"{'bf16 autocast' if bf16_flags else 'fp32'}", flush=True)
    images = args.images * (args.epochs - 1)
    results: dict[str, list[Measured]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        runs = variants(args, os.path.join(tmp, "out"))
        results = {name: [] for name in runs}
        for round_index in range(args.rounds):
            order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
            for name in order:
                out = os.path.join(tmp, f"{round_index}-{list(runs).index(name)}")
                script_args, *timing = variants(args, out)[name]
                m = run_once(script_args, *timing, epochs=args.epochs, workdir=tmp)
                results[name].append(m)
                print(f"round {round_index + 1}: {name}: training {images / m.train:.0f} images/s; whole epochs "
                      f"{m.wall:.1f} s, {m.cpu:.1f} CPU-s -> {images / m.wall:.0f} images/s, "
                      f"{images / m.cpu:.0f} images/CPU-s", flush=True)

    seed = results[next(iter(results))]
    width = max(len(n) for n in results)
    print(f"\n{args.images} synthetic images x {args.epochs - 1} timed epochs, batch {args.batch_size} per "
          f"process, 2 processes (torchrun, gloo, CPU), {args.rounds} rounds (medians of per-round ratios)\n")
    print(f"{'':<{width}}  {'training':>20}  {'whole epochs (ours incl. eval + checkpoint)':>43}")
    print(f"{'script':<{width}}  {'images/s':>9}  {'vs seed':>8}  {'images/s':>9}  {'vs seed':>8}  "
          f"{'images/CPU-s':>12}  {'vs seed':>8}  training ratio per round")
    for name, measured in results.items():
        def median(values: list[float]) -> float:
            return statistics.median(values)

        train_ratios = [s.train / m.train for m, s in zip(measured, seed)]
        print(f"{name:<{width}}  {median([images / m.train for m in measured]):9.0f}  {median(train_ratios):7.2f}x  "
              f"{median([images / m.wall for m in measured]):9.0f}  "
              f"{median([s.wall / m.wall for m, s in zip(measured, seed)]):7.2f}x  "
              f"{median([images / m.cpu for m in measured]):12.0f}  "
              f"{median([s.cpu / m.cpu for m, s in zip(measured, seed)]):7.2f}x  "
              + ", ".join(f"{r:.2f}x" for r in train_ratios))


if __name__ == "__main__":
    main()
