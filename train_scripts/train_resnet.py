"""Fine-tune ResNet-18 with PyTorch DDP on an ImageFolder data set (e.g. Hymenoptera ants and bees).

Data: ``train/<class>/*.jpg`` and ``val/<class>/*.jpg``, from ``--train-dir`` / ``--val-dir``, else
``--data-dir``'s ``train`` and ``val`` folders, else the channels ``train`` and ``val`` (SageMaker's
``SM_CHANNEL_TRAIN`` / ``SM_CHANNEL_VAL``, else ``DDP_CHANNEL_TRAIN`` / ``DDP_CHANNEL_VAL``, else
``$DDP_DATA_DIR/train`` and ``$DDP_DATA_DIR/val``). Starting weights: ``--weights PATH`` (a state_dict
file, e.g. torchvision's ``resnet18-f37072fd.pth``; a classifier of another shape is left out), or
torchvision's ImageNet weights with ``--pretrained-download true``; otherwise random. Nothing is
downloaded unless asked.

Run: ``python -m launcher --nproc-per-node 2 train_scripts/train_resnet.py --data-dir hymenoptera_data``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Optional

import ddp_utils
import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, models, transforms

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def data_dirs(args: argparse.Namespace) -> tuple[str, str]:
    """The train and validation folders: ``--train-dir``/``--val-dir``, ``--data-dir``, then the channels."""
    base = args.data_dir
    train = args.train_dir or (os.path.join(base, "train") if base else ddp_utils.channel("train"))
    val = args.val_dir or (os.path.join(base, "val") if base else ddp_utils.channel("val"))
    if not train or not val:
        raise SystemExit("no data: give --data-dir (with train/ and val/) or --train-dir and --val-dir, "
                         "or set DDP_DATA_DIR (with train/ and val/), or run with the channels 'train' and 'val'")
    return train, val


def image_folders(train_dir: str, val_dir: str, size: int) -> tuple[datasets.ImageFolder, ...]:
    """The two ImageFolder data sets with the usual fine-tuning transforms."""
    train_tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    val_tf = transforms.Compose([transforms.Resize(round(size * 256 / 224)), transforms.CenterCrop(size),
                                 transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_set, val_set = datasets.ImageFolder(train_dir, train_tf), datasets.ImageFolder(val_dir, val_tf)
    if train_set.classes != val_set.classes:
        raise SystemExit(f"train and val classes differ: {train_set.classes} vs {val_set.classes}")
    return train_set, val_set


def build_model(job: ddp_utils.Job, num_classes: int, weights: Optional[str], download: bool) -> nn.Module:
    """ResNet-18 with a ``num_classes`` classifier and the requested starting weights."""
    model = models.resnet18(weights=None)
    if download:  # one process per host downloads into the torch hub cache, then the others read it
        error = None
        if job.local_rank == 0:
            try:
                models.ResNet18_Weights.DEFAULT.get_state_dict(progress=False)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        error = ddp_utils.first_error(job, error)
        if error:
            raise RuntimeError(f"the ImageNet weights could not be downloaded ({error})")
        model.load_state_dict(models.ResNet18_Weights.DEFAULT.get_state_dict(progress=False))
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    if weights:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        state = state.get("model", state.get("state_dict", state))
        own = model.state_dict()
        skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
        result = model.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=False)
        missing = [k for k in result.missing_keys if not k.startswith("fc.")]
        if missing or result.unexpected_keys:
            raise SystemExit(f"{weights}: not ResNet-18 weights (missing {missing[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]})")
        job.log(f"weights from {weights}" + (f" (new classifier: {', '.join(skipped)} left out)"
                                             if skipped else ""))
    return model


def build_parser() -> argparse.ArgumentParser:
    parser = ddp_utils.add_common_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--data-dir", default=None, help="folder with train/<class>/ and val/<class>/")
    parser.add_argument("--train-dir", default=None, help="training ImageFolder (default the train channel)")
    parser.add_argument("--val-dir", default=None, help="validation ImageFolder (default the val channel)")
    parser.add_argument("--image-size", type=int, default=224, help="input size of the network")
    parser.add_argument("--weights", default=None, help="a local state_dict file to start from")
    parser.add_argument("--pretrained-download", type=ddp_utils.str2bool, default=False,
                        help="start from torchvision's ImageNet weights (downloads them)")
    parser.add_argument("--step-size", type=int, default=7, help="epochs between learning-rate decays")
    parser.add_argument("--gamma", type=float, default=0.1, help="learning-rate decay factor")
    parser.set_defaults(epochs=25, batch_size=32, workers=2, learning_rate=0.001, momentum=0.9)
    return parser


@record
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = ddp_utils.resolve_paths(build_parser().parse_args(argv))
    settings = ddp_utils.FitSettings.from_args(args)
    train_dir, val_dir = data_dirs(args)
    job = ddp_utils.start(args.backend, args.timeout)
    try:
        torch.manual_seed(args.seed)
        train_set, val_set = image_folders(train_dir, val_dir, args.image_size)
        job.log(f"classes {train_set.classes}: {len(train_set)} training and {len(val_set)} validation "
                f"images; world size {job.world_size}, backend {job.backend}, device {job.device}")
        job.log(args.paths.describe())
        model = ddp_utils.wrap(job, build_model(job, len(train_set.classes), args.weights,
                                                args.pretrained_download), args.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=ddp_utils.scaled_lr(job, args),
                                    momentum=args.momentum)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=args.gamma)
        train_sampler = ddp_utils.sampler(job, len(train_set), seed=args.seed)
        options = ddp_utils.loader_options(job, args.workers)
        train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, **options)
        val_loader = DataLoader(Subset(val_set, ddp_utils.shard(job, len(val_set))),
                                batch_size=args.batch_size, shuffle=False, **options)
        result = ddp_utils.fit(job, settings, model, optimizer, scheduler=scheduler,
                               train_sampler=train_sampler, train_batches=lambda: train_loader,
                               evaluate_fn=lambda: ddp_utils.evaluate(job, model, val_loader, args.bf16))
        if result.stopped:
            job.log("stopped by a signal; the checkpoint resumes it")
            return 0
        if ddp_utils.save_model(job, args.model_dir, model, "model.pt"):
            with open(os.path.join(args.model_dir, "classes.json"), "w", encoding="utf-8") as fh:
                json.dump(train_set.classes, fh)
    finally:
        ddp_utils.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
