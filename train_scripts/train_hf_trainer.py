"""Hugging Face ``transformers.Trainer`` on several hosts under the launcher.

A tiny BERT (``BertForSequenceClassification`` built from a ``BertConfig``: random weights, nothing
downloaded) learns whether a random sequence of token ids holds token 1; gloo on the CPU. The Trainer
(through accelerate) reads torchrun's variables itself: the script passes no rank, world or address.

Checkpoints: ``TrainingArguments(output_dir=--checkpoint-dir, save_strategy="steps", save_steps=1)`` writes
``checkpoint-<step>/``; the script resumes from the latest one there (``get_last_checkpoint``), so a
restarted job (``--max-restarts``) goes on from it (the directory must be one that every host reads).

Each rank writes what it saw to ``--out``: ``hf_trainer.g<generation>.r<rank>.json`` (world size, the
global step it started from and ended at). Faults for the tests, in the user's own ``compute_loss`` on
rank ``--fault-rank`` in generation 0 only: ``--fail-at-step K`` raises a ValueError; ``--hang-at-step K``
blocks for ever (the other ranks wait in the gradient all-reduce).

Run: ``HF_HUB_OFFLINE=1 python -m launcher simulate --hosts 2 -- train_scripts/train_hf_trainer.py --out /tmp/seen``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, Optional

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

GENERATION = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # the launcher's job-wide restart count
VOCAB, LENGTH = 50, 16


class Sequences(torch.utils.data.Dataset):
    """``size`` random sequences of token ids (the same on every rank); label 1 when token 1 is in one."""

    def __init__(self, size: int = 256, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, VOCAB, (size, LENGTH), generator=generator)
        marked = torch.rand(size, generator=generator) < 0.5
        self.ids[marked, torch.randint(0, LENGTH, (int(marked.sum()),), generator=generator)] = 1
        self.labels = marked.long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


class FaultyTrainer(Trainer):
    """The Trainer with the user's own loss: where the tests' faults happen."""

    def __init__(self, *args: Any, fail_at: int = -1, hang_at: int = -1, fault_rank: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at, self.hang_at, self.fault_rank = fail_at, hang_at, fault_rank

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                     num_items_in_batch: Optional[torch.Tensor] = None) -> Any:
        step, rank = self.state.global_step, self.args.process_index
        faulty = rank == self.fault_rank and GENERATION == 0
        if faulty and step == self.fail_at:
            raise ValueError(f"bad batch at step {step} on rank {rank}")
        if faulty and step == self.hang_at:
            threading.Event().wait()  # a deadlock: the other ranks wait for this one's gradients
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


class Seen(TrainerCallback):
    """Writes what this rank saw when training starts and when it ends."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.facts: dict[str, Any] = {}

    def _write(self, args: TrainingArguments) -> None:
        path = os.path.join(self.out, f"hf_trainer.g{GENERATION}.r{args.process_index}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(self.facts, fh)
        os.replace(path + ".tmp", path)

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.facts = {"world_size": args.world_size, "rank": args.process_index, "pid": os.getpid(),
                      "generation": GENERATION, "start_step": state.global_step, "end_step": None}
        self._write(args)

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.facts["end_step"] = state.global_step
        self._write(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for what each rank saw")
    parser.add_argument("--checkpoint-dir", help="the Trainer's output_dir (default: OUT/hf-ckpt)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps in all (max_steps)")
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--fail-at-step", type=int, default=-1, help="raise a ValueError at this step (generation 0)")
    parser.add_argument("--hang-at-step", type=int, default=-1, help="block for ever at this step (generation 0)")
    parser.add_argument("--fault-rank", type=int, default=1, help="the rank that fails or hangs")
    args = parser.parse_args(argv)

    output_dir = args.checkpoint_dir or os.path.join(args.out, "hf-ckpt")
    training = TrainingArguments(output_dir=output_dir, max_steps=args.steps,
                                 per_device_train_batch_size=args.batch_size, learning_rate=1e-3,
                                 save_strategy="steps", save_steps=1, save_total_limit=2,
                                 logging_steps=1, report_to=[], use_cpu=True, ddp_backend="gloo", seed=0,
                                 disable_tqdm=True, dataloader_num_workers=0)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=LENGTH, num_labels=2)
    trainer = FaultyTrainer(model=BertForSequenceClassification(config), args=training, train_dataset=Sequences(),
                            callbacks=[Seen(args.out)], fail_at=args.fail_at_step, hang_at=args.hang_at_step,
                            fault_rank=args.fault_rank)
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        print(f"hf_trainer: trained to step {trainer.state.global_step} on {training.world_size} processes",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
