"""Benchmark: the cost per training step of the bootstrap's main-thread sampler, side by side.

The same loop runs in rounds that alternate with the sampler off and on (launcher/bootstrap.py's
``start_sampler``, beating a real UNIX datagram socket that a thread drains as the launcher would):

- ``torch``: a small CPU model's forward, backward and optimizer step (a few ms per step: the sampler's
  10 looks a second meet many steps);
- ``python``: a step of pure Python calls (the worst case: every look takes the GIL from the step).

Per round: the mean time per step. Reported: the median over the rounds of each side, their ratio, and
the noise: the ratio between the two halves of the rounds without the sampler (the same code twice).
The cost is inside the noise when the on/off ratio is within the off/off ratio's distance from 1.

Usage: ``.venv/bin/python bench/bench_sampling.py [--rounds 10] [--seconds 2]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchlib import markdown_table  # noqa: E402  (bench/ is the script's directory)

from launcher import bootstrap  # noqa: E402  (after the path is set)
from launcher.progress import BeatSocket, Progress  # noqa: E402


def torch_step() -> Callable[[], None]:
    """A CPU model's training step."""
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data, target = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        optimizer.step()
    return step


def python_step() -> Callable[[], None]:
    """A step of pure Python calls."""
    def leaf(i: int) -> int:
        return i * 3 % 7

    def step() -> None:
        total = 0
        for i in range(2000):
            total += leaf(i)
    return step


def timed_round(step: Callable[[], None], seconds: float) -> float:
    """The mean seconds per step over ``seconds``."""
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        count += 1
    return (time.perf_counter() - start) / count


def look_cost(looks: int = 20000) -> float:
    """Seconds of one look at this (the main) thread, the sampler's work every PERIOD s."""
    sampler = bootstrap.Sampler(threading.main_thread().ident)
    start = time.perf_counter()
    for _ in range(looks):
        sampler.look()
    return (time.perf_counter() - start) / looks


def measure(step: Callable[[], None], rounds: int, seconds: float, path: str) -> dict[str, list[float]]:
    """Alternate rounds without and with the sampler; seconds per step of each round."""
    found: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(2 * rounds):
        side = "off" if i % 2 == 0 else "on"
        stop = threading.Event()
        thread = bootstrap.start_sampler({bootstrap.BEAT_VARIABLE: path, "RANK": "0"}, stop) if side == "on" else None
        try:
            found[side].append(timed_round(step, seconds))
        finally:
            stop.set()
            if thread is not None:
                thread.join()
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run both loops, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-sampling-") as tmp:
        beats, progress, done = BeatSocket(tmp), Progress(), threading.Event()

        def drain() -> None:
            while not done.wait(0.2):
                beats.drain(progress)
        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        rows = []
        try:
            for name, make in (("torch", torch_step), ("python", python_step)):
                step = make()
                timed_round(step, 1.0)  # warm up
                found = measure(step, args.rounds, args.seconds, beats.path)
                off, on = statistics.median(found["off"]), statistics.median(found["on"])
                half = args.rounds // 2
                noise = statistics.median(found["off"][:half]) / statistics.median(found["off"][half:])
                rows.append((name, f"{off * 1e3:.3f} ms", f"{on * 1e3:.3f} ms", f"{on / off:.4f}",
                             f"{noise:.4f}", f"{min(found['off']) * 1e3:.3f}-{max(found['off']) * 1e3:.3f} ms"))
        finally:
            done.set()
            drainer.join()
            beats.close()
    cost = look_cost()
    print(f"\none look at the main thread: {cost * 1e6:.1f} us; {1 / bootstrap.PERIOD:g} looks a second: "
          f"{cost / bootstrap.PERIOD:.4%} of one core")
    print(f"sampler off/on, {args.rounds} rounds of {args.seconds:g} s each side, alternating; "
          f"{progress.last() and 'beats arrived' or 'no beat arrived'}")
    header = ("loop", "per step, off", "per step, on", "on/off", "noise (off/off)", "off rounds min-max")
    print(markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
