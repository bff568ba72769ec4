"""PyTorch Lightning on several hosts: ``Trainer(strategy="ddp", num_nodes=N)`` under the launcher.

A small classifier (a LightningModule) on scikit-learn's 8x8 digits (shipped with it: nothing is
downloaded), gloo on the CPU. Lightning reads torchrun's variables itself (its TorchElastic cluster
environment); the script passes ``num_nodes`` (the hosts: ``WORLD_SIZE // LOCAL_WORLD_SIZE``) and
``devices`` (the processes per host: ``LOCAL_WORLD_SIZE``), which Lightning checks against the world.

Checkpoints: ``ModelCheckpoint(dirpath=--checkpoint-dir, save_last=True, every_n_train_steps=1)``, and
``trainer.fit(..., ckpt_path="last")``: a restarted job (``--max-restarts``) resumes from ``last.ckpt``
(the directory must be one that every host reads: rank 0 writes it, every rank loads it).

Each rank writes what it saw to ``--out``: ``lightning.g<generation>.r<rank>.json`` (world size, the
global step it started from and ended at). Faults for the tests: ``--fail-at-step K`` raises a
ValueError in ``training_step`` on rank ``--fault-rank`` in generation 0 only; ``--hang-at-step K`` blocks
that rank's ``training_step`` for ever (the other ranks wait in the gradient all-reduce).

Run: ``python -m launcher simulate --hosts 2 -- train_scripts/train_lightning.py --out /tmp/seen``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

GENERATION = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # the launcher's job-wide restart count


class DigitsClassifier(L.LightningModule):
    """64 pixels -> 64 -> 10 classes, SGD; the faults of the tests in ``training_step``."""

    def __init__(self, fail_at: int, hang_at: int, fault_rank: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.fail_at, self.hang_at, self.fault_rank = fail_at, hang_at, fault_rank

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        faulty = self.global_rank == self.fault_rank and GENERATION == 0
        if faulty and self.global_step == self.fail_at:
            raise ValueError(f"bad batch {batch_idx} at step {self.global_step} on rank {self.global_rank}")
        if faulty and self.global_step == self.hang_at:
            threading.Event().wait()  # a deadlock: the other ranks wait for this one's gradients
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def digits() -> TensorDataset:
    """The 1,797 digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return TensorDataset(torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target))


class Seen(L.Callback):
    """Writes what this rank saw when training starts and when it ends."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.facts: dict[str, Any] = {}

    def _write(self, trainer: L.Trainer) -> None:
        path = os.path.join(self.out, f"lightning.g{GENERATION}.r{trainer.global_rank}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(self.facts, fh)
        os.replace(path + ".tmp", path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.facts = {"world_size": trainer.world_size, "num_nodes": trainer.num_nodes, "rank": trainer.global_rank,
                      "pid": os.getpid(), "generation": GENERATION, "start_step": trainer.global_step, "end_step": None}
        self._write(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.facts["end_step"] = trainer.global_step
        self._write(trainer)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for what each rank saw")
    parser.add_argument("--checkpoint-dir", help="where last.ckpt goes (default: OUT/lightning-ckpt)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps in all (max_steps)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--fail-at-step", type=int, default=-1, help="raise a ValueError at this step (generation 0)")
    parser.add_argument("--hang-at-step", type=int, default=-1, help="block for ever at this step (generation 0)")
    parser.add_argument("--fault-rank", type=int, default=1, help="the rank that fails or hangs")
    args = parser.parse_args(argv)

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // local
    L.seed_everything(0, workers=True)
    checkpoints = ModelCheckpoint(dirpath=args.checkpoint_dir or os.path.join(args.out, "lightning-ckpt"),
                                  save_last=True, save_top_k=0, every_n_train_steps=1)
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", num_nodes=nodes, devices=local, max_steps=args.steps,
                        callbacks=[checkpoints, Seen(args.out)], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1)
    model = DigitsClassifier(args.fail_at_step, args.hang_at_step, args.fault_rank)
    loader = DataLoader(digits(), batch_size=args.batch_size, shuffle=True)
    trainer.fit(model, loader, ckpt_path="last")
    if trainer.is_global_zero:
        print(f"lightning: trained to step {trainer.global_step} on {trainer.world_size} processes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
