"""CIFAR-10 with PyTorch DDP: the network and command line of Oracle ADS's example ``train.py``.

Differences from that script, for speed on CPUs and for SageMaker:

- the data set is read once into a uint8 tensor (50,000 x 3 x 32 x 32 = 150 MB); batches are cut
  from it, augmented (random crop with 4 pixels of padding, horizontal flip) and normalised as
  whole-batch tensor operations: no PIL image and no DataLoader worker per sample;
- it is downloaded only when ``--data-dir`` (default the ``train`` channel: ``SM_CHANNEL_TRAIN``, else
  ``DDP_CHANNEL_TRAIN``, else ``$DDP_DATA_DIR/train``, else ``./data``) does not hold it yet, by one process
  per host while the others wait;
- ``ddp_utils``' speed defaults: bf16 autocast where the CPU or GPU computes bf16 in hardware,
  channels_last images, malloc that keeps freed memory (``--bf16 false`` for fp32 everywhere);
- evaluation runs every epoch on all ranks; checkpoints, resume, SIGTERM and metrics come from
  ``ddp_utils``; ``--synthetic N`` trains on N random in-memory images (tests, benchmarks);
- ``--workers`` is accepted for compatibility and unused: the in-memory pipeline needs no workers.

Run: ``python -m launcher --nproc-per-node 2 train_scripts/train_cifar10.py --epochs 2``
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections.abc import Iterator, Sequence
from typing import Optional

import ddp_utils
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

BATCHES_DIR = "cifar-10-batches-py"  # torchvision's layout of the "python version" archive
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
CLASSES = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class Net(nn.Module):
    """The seed script's network (``flatten`` instead of ``view`` so channels_last works too)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.conv3 = nn.Conv2d(64, 128, 3)
        self.fc1 = nn.Linear(128 * 6 * 6, 120)
        self.dropout = nn.Dropout(p=0.2)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = self.pool(F.relu(self.conv2(x)))
        x = self.pool(F.relu(self.conv3(x)))
        x = torch.flatten(x, 1)
        x = self.dropout(F.relu(self.fc1(x)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def find_batches(data_dir: str) -> Optional[str]:
    """The folder holding the ``data_batch_*`` / ``test_batch`` pickles, if complete."""
    for folder in (os.path.join(data_dir, BATCHES_DIR), data_dir):
        if all(os.path.isfile(os.path.join(folder, name)) for name in TRAIN_FILES + TEST_FILES):
            return folder
    return None


def read_batches(folder: str, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N x 3 x 32 x 32, uint8) and labels (int64) from the pickles, as torchvision reads them."""
    images, labels = [], []
    for name in names:
        with open(os.path.join(folder, name), "rb") as fh:
            entry = pickle.load(fh, encoding="latin1")
        images.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.extend(entry["labels"] if "labels" in entry else entry["fine_labels"])
    return torch.from_numpy(np.concatenate(images)), torch.tensor(labels, dtype=torch.int64)


def load_cifar10(job: ddp_utils.Job, data_dir: str) -> tuple[torch.Tensor, ...]:
    """Train and test tensors; local rank 0 downloads them first when ``data_dir`` lacks them."""
    error = None
    if find_batches(data_dir) is None and job.local_rank == 0:
        try:
            import torchvision

            for train in (True, False):
                torchvision.datasets.CIFAR10(root=data_dir, train=train, download=True)
        except Exception as exc:  # no internet, a read-only channel...: every rank must learn of it
            error = f"{type(exc).__name__}: {exc}"
    error = ddp_utils.first_error(job, error)
    folder = find_batches(data_dir)
    if error or folder is None:
        raise FileNotFoundError(f"CIFAR-10 ({BATCHES_DIR}/data_batch_1..5, test_batch) is not in "
                                f"{data_dir!r} and could not be downloaded there ({error})")
    return (*read_batches(folder, TRAIN_FILES), *read_batches(folder, TEST_FILES))


def synthetic(count: int, seed: int = 1234) -> tuple[torch.Tensor, ...]:
    """``count`` random training images and ``count // 5`` (at least 10) test images, same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    test = max(count // 5, 10)
    return (torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=gen),
            torch.randint(0, 10, (count,), generator=gen),
            torch.randint(0, 256, (test, 3, 32, 32), dtype=torch.uint8, generator=gen),
            torch.randint(0, 10, (test,), generator=gen))


def random_crop_flip(images: torch.Tensor, gen: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Per-image random crop (zero padding) and horizontal flip of a whole uint8 batch at once."""
    b, _, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    dy, dx = (torch.randint(0, 2 * padding + 1, (b,), generator=gen).to(images.device) for _ in range(2))
    rows = (dy[:, None] + torch.arange(h, device=images.device))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, None, :]
    batch = torch.arange(b, device=images.device)[:, None, None, None]
    chans = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
    out = padded[batch, chans, rows, cols]
    flip = (torch.rand(b, generator=gen) < 0.5).to(images.device)[:, None, None, None]
    return torch.where(flip, out.flip(3), out)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 -> float in [-1, 1]: the seed's ``ToTensor`` + ``Normalize((0.5,)*3, (0.5,)*3)``."""
    return images.float().div_(127.5).sub_(1.0)


def build_parser() -> argparse.ArgumentParser:
    parser = ddp_utils.add_common_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--data-dir", default=None,
                        help="directory containing CIFAR-10 (default SM_CHANNEL_TRAIN, DDP_CHANNEL_TRAIN or "
                             "$DDP_DATA_DIR/train, else ./data)")
    parser.add_argument("--synthetic", type=int, default=0, metavar="N",
                        help="train on N random in-memory images instead (no data, no download)")
    parser.add_argument("--augment", type=ddp_utils.str2bool, default=True,
                        help="random crop and horizontal flip of training batches")
    parser.add_argument("--eval-batch-size", type=int, default=500, help="batch size of evaluation")
    parser.set_defaults(epochs=10, batch_size=16, workers=2, learning_rate=0.001, momentum=0.9,
                        print_freq=200)
    return parser


@record
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = ddp_utils.resolve_paths(build_parser().parse_args(argv))
    settings = ddp_utils.FitSettings.from_args(args)
    args.data_dir = args.data_dir or ddp_utils.channel("train", "data")
    job = ddp_utils.start(args.backend, args.timeout)
    try:
        torch.manual_seed(args.seed)
        x_train, y_train, x_test, y_test = (synthetic(args.synthetic) if args.synthetic
                                            else load_cifar10(job, args.data_dir))
        job.log(f"CIFAR-10: {len(x_train)} training and {len(x_test)} test images; world size "
                f"{job.world_size}, backend {job.backend}, device {job.device}")
        job.log(args.paths.describe())
        model = ddp_utils.wrap(job, Net(), args.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=ddp_utils.scaled_lr(job, args),
                                    momentum=args.momentum)
        train_sampler = ddp_utils.sampler(job, len(x_train), seed=args.seed)
        gen = torch.Generator().manual_seed(args.seed * 7919 + job.rank)  # augmentation differs by rank

        def train_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            order = torch.tensor(list(train_sampler), dtype=torch.int64)
            for sel in order.split(args.batch_size):
                images = x_train[sel].to(job.device, non_blocking=True)
                if args.augment:
                    images = random_crop_flip(images, gen)
                yield normalize(images), y_train[sel]

        test_share = torch.tensor(ddp_utils.shard(job, len(x_test)), dtype=torch.int64)

        def evaluate() -> dict[str, float]:
            batches = ((normalize(x_test[sel].to(job.device)), y_test[sel])
                       for sel in test_share.split(args.eval_batch_size))
            return ddp_utils.evaluate(job, model, batches, args.bf16)

        result = ddp_utils.fit(job, settings, model, optimizer, train_sampler=train_sampler,
                               train_batches=train_batches, evaluate_fn=evaluate)
        if result.stopped:
            job.log("stopped by a signal; the checkpoint resumes it")
            return 0
        ddp_utils.save_model(job, args.model_dir, model, "cifar_net.pt")
    finally:
        ddp_utils.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
