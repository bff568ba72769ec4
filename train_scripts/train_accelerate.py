"""Hugging Face ``accelerate`` on several hosts under the launcher: ``Accelerator`` and ``prepare``.

A small classifier on scikit-learn's 8x8 digits (shipped with it: nothing is downloaded), gloo on the
CPU, in the script's own training loop. ``Accelerator`` reads torchrun's variables itself; ``prepare``
wraps the model in DDP and shards the data loader.

Checkpoints: every ``--save-every`` steps, ``accelerator.save_state(<--checkpoint-dir>/step_<N>)`` (model,
optimizer, every rank's random generators); at the start the script loads the newest complete one
(``load_state``) and goes on from its step, so a restarted job (``--max-restarts``) resumes from it (the
directory must be one that every host reads).

Each rank writes what it saw to ``--out``: ``accelerate.g<generation>.r<rank>.json`` (world size, the
step it started from and ended at). Faults for the tests, on rank ``--fault-rank`` in generation 0 only:
``--fail-at-step K`` raises a ValueError in the step; ``--hang-at-step K`` blocks for ever before the
step's forward pass (the other ranks wait in the gradient all-reduce).

Run: ``python -m launcher simulate --hosts 2 -- train_scripts/train_accelerate.py --out /tmp/seen``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

GENERATION = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # the launcher's job-wide restart count
DONE = "complete"  # written into a checkpoint's directory once every rank has saved its part


def digits() -> TensorDataset:
    """The 1,797 digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return TensorDataset(torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target))


def latest_checkpoint(directory: str) -> tuple[int, Optional[str]]:
    """The step and path of the newest complete checkpoint in ``directory``; ``(0, None)`` when there is none."""
    found = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = re.fullmatch(r"step_(\d+)", name)
            if match and os.path.exists(os.path.join(directory, name, DONE)):
                found.append((int(match.group(1)), os.path.join(directory, name)))
    return max(found, default=(0, None))


def forever(loader: DataLoader) -> Iterator[Any]:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def write(out: str, rank: int, facts: dict[str, Any]) -> None:
    path = os.path.join(out, f"accelerate.g{GENERATION}.r{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(facts, fh)
    os.replace(path + ".tmp", path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for what each rank saw")
    parser.add_argument("--checkpoint-dir", help="where save_state writes (default: OUT/accelerate-ckpt)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps in all")
    parser.add_argument("--save-every", type=int, default=1, help="steps between two checkpoints")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--fail-at-step", type=int, default=-1, help="raise a ValueError at this step (generation 0)")
    parser.add_argument("--hang-at-step", type=int, default=-1, help="block for ever at this step (generation 0)")
    parser.add_argument("--fault-rank", type=int, default=1, help="the rank that fails or hangs")
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    rank = accelerator.process_index
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(digits(), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    checkpoints = args.checkpoint_dir or os.path.join(args.out, "accelerate-ckpt")
    step, path = latest_checkpoint(checkpoints)
    if path is not None:
        accelerator.load_state(path)
        accelerator.print(f"accelerate: resumed from {path}")
    facts = {"world_size": accelerator.num_processes, "rank": rank, "pid": os.getpid(), "generation": GENERATION,
             "distributed_type": str(accelerator.distributed_type), "start_step": step, "end_step": None}
    write(args.out, rank, facts)

    batches = forever(loader)
    faulty = rank == args.fault_rank and GENERATION == 0
    model.train()
    while step < args.steps:
        x, y = next(batches)
        if faulty and step == args.fail_at_step:
            raise ValueError(f"bad batch at step {step} on rank {rank}")
        if faulty and step == args.hang_at_step:
            threading.Event().wait()  # a deadlock: the other ranks wait for this one's gradients
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        accelerator.print(f"step {step}: loss {loss.item():.4f}")
        if step % args.save_every == 0 or step == args.steps:
            target = os.path.join(checkpoints, f"step_{step}")
            accelerator.save_state(target)
            accelerator.wait_for_everyone()  # every rank's part is written
            if accelerator.is_main_process:
                open(os.path.join(target, DONE), "w").close()

    facts["end_step"] = step
    write(args.out, rank, facts)
    accelerator.print(f"accelerate: trained to step {step} on {accelerator.num_processes} processes")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
