"""Shared helpers of the DDP training scripts (a source bundle ships this file beside them).

The sections follow the order a script uses them:

1. **Arguments and paths**: :func:`add_common_arguments` (the options every script shares; SageMaker
   passes booleans as ``--flag True``, see :func:`str2bool`), then :func:`resolve_paths`: where the model,
   the metrics and the checkpoints go, and :func:`channel`: where an input channel's data is. Each comes
   from the first of these that is set (an empty variable counts as unset):

   - model dir: ``--model-dir`` (alias ``--output-dir``) > ``SM_MODEL_DIR`` > ``AIP_MODEL_DIR`` (Vertex AI)
     > ``OCI__SYNC_DIR`` (OCI ADS) > ``DDP_MODEL_DIR`` > ``./outputs``;
   - output data dir (``metrics.json``, plots): ``--output-data-dir`` > ``SM_OUTPUT_DATA_DIR``
     > ``AIP_TENSORBOARD_LOG_DIR`` (Vertex AI) > ``DDP_OUTPUT_DIR`` > the model dir;
   - checkpoint dir: ``--checkpoint-dir`` > SageMaker's checkpoint directory > ``AIP_CHECKPOINT_DIR``
     (Vertex AI) > ``DDP_CHECKPOINT_DIR`` > ``<output data dir>/checkpoints``;
   - input channel ``name`` (:func:`channel`; a script's own options such as ``--data-dir`` come first):
     ``SM_CHANNEL_<NAME>`` > ``DDP_CHANNEL_<NAME>`` > ``$DDP_DATA_DIR/<name>`` > the script's default.

   That is: option > SageMaker variable > platform variable > neutral ``DDP_*`` variable > default.

   SageMaker's checkpoint directory is ``LocalPath`` of ``<base>/input/config/checkpointconfig.json``,
   else ``<base>/checkpoints`` on a SageMaker host (``SAGEMAKER_BASE_DIR`` set, or ``/opt/ml/input/config``
   present). Vertex AI sets its three ``AIP_*`` variables when the job has a ``baseOutputDirectory``
   (``<base>/model/``, ``<base>/checkpoints/``, ``<base>/logs/``); they are Cloud Storage URIs, and a
   ``gs://bucket/key`` value anywhere in this table is read as ``/gcs/bucket/key``, where Cloud Storage FUSE
   mounts every bucket in a Vertex custom training job. OCI ADS's distributed-training containers copy
   ``OCI__SYNC_DIR`` to Object Storage (with ``SYNC_ARTIFACTS=1``): the model goes there, and so do the
   metrics and checkpoints unless something else says otherwise. Kubeflow, SLURM and plain torchrun
   clusters have no such variables: set the ``DDP_*`` ones (or pass the options). Any other URI
   (``s3://``...) is not a local path: the script prints one line naming the variable and exits 2.
   ``DDP_DATA_DIR`` holds one folder per channel, as SageMaker's ``/opt/ml/input/data``.
2. **Start**: :func:`start` gives a :class:`Job`: rank, device and backend from torchrun's variables
   (``nccl`` on GPU, ``gloo`` on CPU); a plain ``python script.py`` runs as a world of one without a
   process group. It catches SIGTERM/SIGINT (see :func:`fit`). :func:`first_error` shares one rank's
   failure (a download) with every rank.
3. **Speed settings**: bf16 autocast where the device computes bf16 in hardware (:func:`use_bf16`),
   channels_last images on GPU and oneDNN CPUs (:func:`use_channels_last`), and glibc's malloc kept from
   returning every step's activations to the OS (:func:`keep_freed_memory`, called by :func:`start`).
4. **Wrap and sampler**: :func:`wrap` (device, memory format, DDP), :func:`sampler` (a
   :class:`ResumableSampler`, a ``DistributedSampler`` re-seeded every epoch), :func:`shard` (this rank's
   evaluation share), :func:`loader_options`.
5. **Fit**: :func:`fit` trains with the settings of a :class:`FitSettings` (``FitSettings.from_args(args)``):
   automatic resume (mid-epoch too), a checkpoint written atomically by rank 0 after every epoch and on
   SIGTERM, holding every rank's random number generators (:func:`rng_state`: a resumed run, or a
   restarted generation, draws the same dropout masks and shuffles as an uninterrupted one), a stop vote
   at every step (SIGTERM: all ranks stop after the same step, at most two steps later, save and exit 0),
   one ``METRIC`` line per epoch and ``metrics.json``.
6. **Evaluate**: :func:`evaluate` on every rank with exact totals over all ranks.
7. **Checkpoints and the model**: :func:`save_checkpoint`, :func:`load_latest_checkpoint`,
   :func:`save_model` (rank 0 writes the ``state_dict`` into the model dir).
8. **Shutdown**: :func:`shutdown` leaves the process group once no collective holds our tensors.
9. **Progress beats**: :func:`beat` tells the launcher's hang detection that this rank is alive (at most
   once a second: one datagram to the socket named by ``DDP_LAUNCHER_PROGRESS``; nothing when it is
   unset or nobody listens). :func:`fit` beats every step, :func:`evaluate` every batch, and a checkpoint
   write beats from a thread while it lasts (:func:`beating`).

Test hooks: with ``DDP_UTILS_PID_DIR`` set every rank writes ``<rank>.pid`` there; with
``DDP_UTILS_HASH_DIR`` set every rank writes ``<rank>.sha256``, a hash of its final weights.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import glob
import hashlib
import io
import itertools
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

PID_DIR_ENV = "DDP_UTILS_PID_DIR"
HASH_DIR_ENV = "DDP_UTILS_HASH_DIR"
MODEL_DIR_ENV, OUTPUT_DIR_ENV, CHECKPOINT_DIR_ENV = "DDP_MODEL_DIR", "DDP_OUTPUT_DIR", "DDP_CHECKPOINT_DIR"
DATA_DIR_ENV, CHANNEL_ENV_PREFIX = "DDP_DATA_DIR", "DDP_CHANNEL_"
GCS_FUSE_ROOT = "/gcs"  # where Vertex AI mounts Cloud Storage buckets with Cloud Storage FUSE
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
METRIC_NAMES = ("epoch", "train_loss", "val_loss", "val_accuracy", "images_per_sec")
_NUMBER = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
#: For an estimator's ``metric_definitions``: one regex per value of the ``METRIC`` lines.
METRIC_DEFINITIONS = [{"Name": name, "Regex": rf"METRIC .*\b{name}={_NUMBER}"} for name in METRIC_NAMES]
CHECKPOINT_GLOB = "checkpoint-e*-s*.pt"
_CHECKPOINT_NAME = re.compile(r"checkpoint-e(\d+)-s(\d+)\.pt$")
_TEMP_PREFIX = ".tmp-"
_stop_signal: list[int] = []  # the stop signal received, if any
BEAT_ENV = "DDP_LAUNCHER_PROGRESS"  # the launcher's progress socket (launcher/progress.py)
BEAT_EVERY = 1.0  # seconds: beats closer together carry no news
_beat_state: dict[str, Any] = {"sock": None, "last": 0.0}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameters (malloc.h)
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo: bf16 arithmetic in hardware
#: id -> tensor given to a collective, while it lives (a WeakSet would compare tensors with ==)
_in_collectives: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


# ---------------------------------------------------------------- arguments and paths


def str2bool(text: str) -> bool:
    """``True/False/true/false/1/0/yes/no`` -> bool, for ``argparse`` (SageMaker passes ``--flag True``)."""
    lowered = str(text).strip().lower()
    if lowered in ("true", "1", "yes", "y", "t"):
        return True
    if lowered in ("false", "0", "no", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def auto_bool(text: str) -> Optional[bool]:
    """``auto`` -> None (decided by the device), else :func:`str2bool`."""
    return None if str(text).strip().lower() == "auto" else str2bool(text)


def add_common_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every script shares; each script sets its own defaults with ``set_defaults``."""
    add = parser.add_argument
    add("--epochs", type=int, default=10, help="number of epochs")
    add("--batch-size", type=int, default=32, help="mini-batch size per process")
    add("--workers", type=int, default=0, help="data loading worker processes per process")
    add("--learning-rate", "--lr", type=float, default=0.01, help="learning rate (before --scale-lr)")
    add("--momentum", type=float, default=0.9, help="SGD momentum")
    add("--scale-lr", type=str2bool, default=False, help="multiply the learning rate by the world size")
    add("--model-dir", "--output-dir", dest="model_dir", default=None,
        help="where rank 0 saves the model (default SM_MODEL_DIR, AIP_MODEL_DIR, OCI__SYNC_DIR or "
             "DDP_MODEL_DIR, else ./outputs)")
    add("--output-data-dir", default=None,
        help="metrics.json and plots (default SM_OUTPUT_DATA_DIR, AIP_TENSORBOARD_LOG_DIR or DDP_OUTPUT_DIR, "
             "else the model dir)")
    add("--checkpoint-dir", default=None,
        help="checkpoints (default SageMaker's checkpoint dir, AIP_CHECKPOINT_DIR or DDP_CHECKPOINT_DIR, "
             "else <output-data-dir>/checkpoints)")
    add("--resume", type=str2bool, default=True, help="resume from the latest checkpoint")
    add("--print-freq", type=int, default=0, help="print the running loss every N steps (0: never)")
    add("--backend", default=None, help="gloo, nccl or mpi (default nccl on GPU, gloo on CPU)")
    add("--timeout", type=float, default=30, help="minutes to wait for the other processes")
    add("--seed", type=int, default=0, help="random seed (weights, shuffling, augmentation)")
    add("--channels-last", type=auto_bool, default=None,
        help="channels_last memory format: auto (GPU, and CPU with oneDNN), true or false")
    add("--bf16", type=auto_bool, default=None,
        help="bf16 autocast: auto (where the GPU or CPU computes bf16 natively), true or false")
    return parser


def scaled_lr(job: Job, args: argparse.Namespace) -> float:
    """The learning rate, times the world size with ``--scale-lr true``."""
    return args.learning_rate * (job.world_size if args.scale_lr else 1)


def bad_input(message: str) -> NoReturn:
    """One line on stderr naming the bad value, then exit 2 (bad input: nothing was started)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def local_path(source: str, value: str) -> str:
    """``value`` (from the option or variable ``source``) as a local path.

    ``gs://bucket/key`` becomes ``/gcs/bucket/key``: Vertex AI mounts Cloud Storage there with Cloud
    Storage FUSE, and its ``AIP_*_DIR`` variables are ``gs://`` URIs. Any other URI exits 2 (:func:`bad_input`).
    """
    found = _URI.match(value)
    if not found:
        return value
    if found.group(1).lower() == "gs":
        return f"{GCS_FUSE_ROOT}/{value[found.end():].strip('/')}"
    bad_input(f"{source}={value[:200]!r}: only local paths and gs:// URIs (read under {GCS_FUSE_ROOT}/) are "
              f"supported; give a local directory")


@dataclass(frozen=True)
class Location:
    """A directory and the option or variable it came from (``default`` and the like when none was set)."""

    path: str
    source: str


def first_location(*candidates: tuple[str, Optional[str]]) -> Optional[Location]:
    """The first ``(source, value)`` whose value is set (not None, not empty), as a local :class:`Location`."""
    for source, value in candidates:
        if value:
            return Location(local_path(source, value), source)
    return None


@dataclass(frozen=True)
class Paths:
    """Where a script writes: the model, the metrics and plots, the checkpoints (see the module's table)."""

    model_dir: Location
    output_data_dir: Location
    checkpoint_dir: Location

    def describe(self) -> str:
        """``model dir X (SOURCE), output data dir Y (SOURCE), checkpoint dir Z (SOURCE)``, for the log."""
        return ", ".join(f"{name.replace('_', ' ')} {loc.path} ({loc.source})" for name, loc in
                         (("model_dir", self.model_dir), ("output_data_dir", self.output_data_dir),
                          ("checkpoint_dir", self.checkpoint_dir)))


def locate_paths(model_dir: Optional[str] = None, output_data_dir: Optional[str] = None,
                 checkpoint_dir: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Paths:
    """The three output directories from the options given, else the variables of ``environ`` (default
    ``os.environ``): option > SageMaker > Vertex AI / OCI ADS > ``DDP_*`` > default."""
    env = os.environ if environ is None else environ
    model = first_location(("--model-dir", model_dir), ("SM_MODEL_DIR", env.get("SM_MODEL_DIR")),
                           ("AIP_MODEL_DIR", env.get("AIP_MODEL_DIR")), ("OCI__SYNC_DIR", env.get("OCI__SYNC_DIR")),
                           (MODEL_DIR_ENV, env.get(MODEL_DIR_ENV)), ("default", "outputs"))
    assert model is not None
    output = first_location(("--output-data-dir", output_data_dir),
                            ("SM_OUTPUT_DATA_DIR", env.get("SM_OUTPUT_DATA_DIR")),
                            ("AIP_TENSORBOARD_LOG_DIR", env.get("AIP_TENSORBOARD_LOG_DIR")),
                            (OUTPUT_DIR_ENV, env.get(OUTPUT_DIR_ENV))) or Location(model.path, "the model dir")
    checkpoints = first_location(
        ("--checkpoint-dir", checkpoint_dir), ("SageMaker's checkpoint dir", sagemaker_checkpoint_dir(env)),
        ("AIP_CHECKPOINT_DIR", env.get("AIP_CHECKPOINT_DIR")), (CHECKPOINT_DIR_ENV, env.get(CHECKPOINT_DIR_ENV)),
    ) or Location(os.path.join(output.path, "checkpoints"), "<output data dir>/checkpoints")
    return Paths(model, output, checkpoints)


def resolve_paths(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """Fill ``args.model_dir``, ``args.output_data_dir`` and ``args.checkpoint_dir`` (:func:`locate_paths`);
    ``args.paths`` keeps the :class:`Paths` with the source of each, for the log."""
    args.paths = locate_paths(args.model_dir, args.output_data_dir, args.checkpoint_dir, environ)
    args.model_dir = args.paths.model_dir.path
    args.output_data_dir = args.paths.output_data_dir.path
    args.checkpoint_dir = args.paths.checkpoint_dir.path
    return args


def channel(name: str, default: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Input channel ``name``'s folder: ``SM_CHANNEL_<NAME>`` (SageMaker), else ``DDP_CHANNEL_<NAME>``, else
    ``$DDP_DATA_DIR/<name>``, else ``default``. A script's own option, when given, comes before all of them."""
    env = os.environ if environ is None else environ
    key = name.upper()
    root = env.get(DATA_DIR_ENV)
    found = first_location((f"SM_CHANNEL_{key}", env.get(f"SM_CHANNEL_{key}")),
                           (f"{CHANNEL_ENV_PREFIX}{key}", env.get(f"{CHANNEL_ENV_PREFIX}{key}")),
                           (DATA_DIR_ENV, os.path.join(local_path(DATA_DIR_ENV, root), name) if root else None))
    return found.path if found else default


def sagemaker_base_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """``SAGEMAKER_BASE_DIR``, else ``/opt/ml``."""
    return (os.environ if environ is None else environ).get("SAGEMAKER_BASE_DIR") or "/opt/ml"


def sagemaker_checkpoint_dir(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``LocalPath`` of ``checkpointconfig.json``, else ``<base>/checkpoints`` on SageMaker, else None."""
    env = os.environ if environ is None else environ
    base = sagemaker_base_dir(env)
    config = os.path.join(base, "input", "config", "checkpointconfig.json")
    with contextlib.suppress(OSError, ValueError, AttributeError):
        with open(config, encoding="utf-8") as fh:
            saved = json.load(fh).get("LocalPath")
        if saved:
            return str(saved)
    if env.get("SAGEMAKER_BASE_DIR") or os.path.isdir(os.path.join(base, "input", "config")):
        return os.path.join(base, "checkpoints")
    return None


# ---------------------------------------------------------------- start


def log(message: str) -> None:
    """A line on stdout, flushed (print it on rank 0 only: see :attr:`Job.is_main`)."""
    print(message, flush=True)


@dataclass(frozen=True)
class Job:
    """This process's place in the job."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def log(self, message: str) -> None:
        """Print on rank 0 only."""
        if self.is_main:
            log(message)


def start(backend: Optional[str] = None, timeout_minutes: float = 30.0) -> Job:
    """Pick the device, join the process group (under torchrun) and catch SIGTERM/SIGINT."""
    rank, world_size, local_rank = (int(os.environ.get(k, d)) for k, d in
                                    (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    if os.environ.get(PID_DIR_ENV):
        os.makedirs(os.environ[PID_DIR_ENV], exist_ok=True)
        with open(os.path.join(os.environ[PID_DIR_ENV], f"{rank}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_stop_signal)
    keep_freed_memory()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if cuda else "gloo")
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    if not dist.is_initialized():  # a plain process: a world of one, whatever the environment says
        rank, world_size = 0, 1
    return Job(rank, local_rank, world_size, device, backend)


def _on_stop_signal(signum: int, _frame: object) -> None:
    if _stop_signal:  # a second signal: stop now, the default way
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _stop_signal.append(signum)
    os.write(2, f"rank {os.environ.get('RANK', '0')}: received {signal.Signals(signum).name}: "
                f"finishing this step, then checkpoint and exit\n".encode())


def collective(function: Callable[..., Any], tensor: torch.Tensor, /, **kwargs: Any) -> Any:
    """``function(tensor, **kwargs)``, a ``torch.distributed`` collective, with ``tensor`` remembered
    for :func:`shutdown`."""
    _in_collectives[id(tensor)] = tensor
    return function(tensor, **kwargs)


def first_error(job: Job, error: Optional[str]) -> Optional[str]:
    """Every rank learns the first rank's error as ``"rank N: ..."``, or None if there was none.

    Use it instead of a barrier after work only some ranks do (a download): the others then fail
    with the real reason instead of waiting in a collective.
    """
    errors: list[Optional[str]] = [error]
    if job.distributed:
        errors = [None] * job.world_size
        dist.all_gather_object(errors, error)
    return next((f"rank {rank}: {text}" for rank, text in enumerate(errors) if text), None)


# ---------------------------------------------------------------- speed settings: precision, memory format, malloc


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none, e.g. macOS); read once."""
    with contextlib.suppress(OSError), open(cpuinfo, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):
                return frozenset(value.split())
    return frozenset()


def native_bf16(job: Job) -> bool:
    """Does the device compute bf16 in hardware: a GPU of the Ampere generation or newer, or a CPU
    with AVX512-BF16 or AMX-BF16 (Cooper Lake, Sapphire Rapids and newer Xeons, AMD Zen 4 and newer)?"""
    if job.cuda:
        return torch.cuda.get_device_capability(job.device)[0] >= 8
    return bool(CPU_BF16_FLAGS & cpu_flags())


def use_bf16(job: Job, flag: Optional[bool] = None) -> bool:
    """``--bf16``: as told, else where the device computes bf16 natively (:func:`native_bf16`)."""
    return native_bf16(job) if flag is None else flag


def autocast(job: Job, bf16: Optional[bool] = None) -> contextlib.AbstractContextManager:
    """bf16 autocast where :func:`use_bf16` says so, else nothing (fp32)."""
    if use_bf16(job, bf16):
        return torch.autocast(device_type=job.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def use_channels_last(job: Job, flag: Optional[bool] = None) -> bool:
    """``--channels-last``: as told, else on GPU and on CPUs with oneDNN (its NHWC convolutions are faster)."""
    if flag is not None:
        return flag
    return job.cuda or torch.backends.mkldnn.is_available()


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Let glibc's malloc keep freed activation buffers for reuse instead of returning them to the OS.

    PyTorch allocates CPU tensors with plain ``malloc``. glibc serves blocks above its mmap threshold
    (128 KiB at first) with fresh ``mmap`` pages and unmaps them on ``free``, so every training step
    page-faults its activations and gradients in anew: measured here, 3,600 faults and 8 ms of
    kernel time in a 48 ms CIFAR-10 step. Raising the mmap threshold (to glibc's 64-bit maximum,
    32 MiB) and the trim threshold makes steps reuse the same memory, as PyTorch's CUDA caching
    allocator does on GPU; the process then keeps up to ``trim_threshold`` bytes of freed heap.
    Skipped (False) without glibc or when ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
    are set: the user has chosen.
    """
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    return all([mallopt(_M_MMAP_THRESHOLD, mmap_threshold), mallopt(_M_TRIM_THRESHOLD, trim_threshold)])


# ---------------------------------------------------------------- wrap and sampler


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (or the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def wrap(job: Job, model: nn.Module, channels_last: Optional[bool] = None) -> nn.Module:
    """Move to the device (in channels_last, see :func:`use_channels_last`) and wrap in DDP under a process group."""
    model = model.to(job.device)
    if use_channels_last(job, channels_last):
        model = model.to(memory_format=torch.channels_last)
    if not job.distributed:
        return model
    ids = [job.device.index] if job.cuda else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start an epoch part way (after a mid-epoch checkpoint)."""

    start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:  # type: ignore[override]
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


def sampler(job: Job, size: int, seed: int = 0) -> ResumableSampler:
    """A shuffling sampler over ``range(size)`` for this rank (padded so every rank has as many)."""
    return ResumableSampler(range(size), num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=seed)


def shard(job: Job, size: int) -> range:
    """This rank's share of ``range(size)`` for evaluation: ``rank::world_size``, no padding."""
    return range(job.rank, size, job.world_size)


def loader_options(job: Job, workers: int) -> dict[str, Any]:
    """DataLoader keywords: pinned memory on GPU, persistent workers only when there are workers."""
    return {"num_workers": workers, "pin_memory": job.cuda, "persistent_workers": workers > 0}


# ---------------------------------------------------------------- fit: the training loop


@dataclass(frozen=True)
class FitSettings:
    """What :func:`fit` is told besides the model: usually ``FitSettings.from_args(args)``."""

    epochs: int
    batch_size: int  # per process
    checkpoint_dir: str
    output_data_dir: str  # metrics.json
    resume: bool = True  # from the newest checkpoint in checkpoint_dir
    print_freq: int = 0  # print the running loss every N steps (0: never)
    bf16: Optional[bool] = None  # None: where the device computes bf16 natively (use_bf16)
    channels_last: Optional[bool] = None  # None: on GPU and oneDNN CPUs (use_channels_last)

    def __post_init__(self) -> None:
        for name, value, least in (("epochs", self.epochs, 0), ("batch_size", self.batch_size, 1),
                                   ("print_freq", self.print_freq, 0)):
            if value < least:
                raise ValueError(f"{name}={value}: must be at least {least}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FitSettings:
        """From :func:`add_common_arguments`' options, once :func:`resolve_paths` has filled the directories.

        Call it before :func:`start`: a bad value (``--batch-size 0``) exits 2 with one line, nothing started.
        """
        if args.checkpoint_dir is None or args.output_data_dir is None:
            raise ValueError("FitSettings.from_args: call ddp_utils.resolve_paths(args) first")
        try:
            return cls(epochs=args.epochs, batch_size=args.batch_size, checkpoint_dir=args.checkpoint_dir,
                       output_data_dir=args.output_data_dir, resume=args.resume, print_freq=args.print_freq,
                       bf16=args.bf16, channels_last=args.channels_last)
        except ValueError as exc:
            bad_input(f"--{exc}".replace("_", "-", 1))


@dataclass
class FitResult:
    history: list[dict[str, Any]]
    stopped: bool  # True: a stop signal ended it early (a checkpoint was saved)


def fit(job: Job, settings: FitSettings, model: nn.Module, optimizer: torch.optim.Optimizer, *,
        train_sampler: ResumableSampler, train_batches: Callable[[], Iterable[tuple[torch.Tensor, ...]]],
        evaluate_fn: Callable[[], dict[str, float]], scheduler: Optional[Any] = None,
        loss_fn: Callable[..., torch.Tensor] = F.cross_entropy) -> FitResult:
    """Train ``settings.epochs`` epochs: resume, checkpoint each epoch, stop cleanly on SIGTERM.

    ``train_batches()`` iterates one epoch's batches in the order of ``train_sampler`` (which this
    function positions with ``set_epoch``). ``evaluate_fn()`` returns :func:`evaluate`'s dict.
    """
    if not isinstance(settings, FitSettings):
        raise TypeError(f"fit() takes a FitSettings (FitSettings.from_args(args)), not {type(settings).__name__}")
    state: dict[str, Any] = {"epoch": 0, "step": 0, "history": [], "loss_sum": 0.0, "samples": 0,
                             "train_time": 0.0}
    found = load_latest_checkpoint(settings.checkpoint_dir) if settings.resume and job.is_main else None
    box = [found]
    if job.distributed:
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        path, saved = box[0]
        unwrap(model).load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if scheduler is not None and saved.get("scheduler") is not None:
            scheduler.load_state_dict(saved["scheduler"])
        state.update({k: saved[k] for k in state})
        if saved.get("world_size") != job.world_size and state["step"]:
            state.update(step=0, loss_sum=0.0, samples=0, train_time=0.0)  # another split: redo the epoch
        if saved.get("world_size") == job.world_size and saved.get("rng"):
            set_rng_state(job, saved["rng"][job.rank])
        job.log(f"resuming from {path}: epoch {state['epoch'] + 1} of {settings.epochs}, step {state['step']}")
    del found, box

    def checkpoint() -> None:
        rngs: list[Any] = [rng_state(job)]
        if job.distributed:  # every rank's generators, in rank order (all ranks call this together)
            mine, rngs = rngs[0], [None] * job.world_size
            dist.all_gather_object(rngs, mine)
        if job.is_main:
            with beating("checkpoint"):
                saved = save_checkpoint(settings.checkpoint_dir, {
                    **state, "model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "world_size": job.world_size, "rng": rngs})
            log(f"checkpoint saved: {saved}")

    bf16 = use_bf16(job, settings.bf16)
    channels_last = use_channels_last(job, settings.channels_last)
    job.log(f"precision {'bf16 autocast' if bf16 else 'fp32'} (--bf16), "
            f"{'channels_last' if channels_last else 'contiguous'} images (--channels-last)")
    model.train()
    vote = StopVote(job)
    for epoch in range(state["epoch"], settings.epochs):
        state["epoch"] = epoch
        train_sampler.set_epoch(epoch, start=state["step"] * settings.batch_size)
        total_steps = math.ceil(train_sampler.num_samples / settings.batch_size)
        loss_sum = torch.zeros((), dtype=torch.float64, device=job.device)
        tic = time.perf_counter()
        for inputs, targets in train_batches():
            inputs = inputs.to(job.device, non_blocking=True)
            targets = targets.to(job.device, non_blocking=True)
            if channels_last and inputs.dim() == 4:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            with autocast(job, bf16):
                loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            beat()
            loss_sum += loss.detach().double() * targets.shape[0]
            state["samples"] += targets.shape[0]
            state["step"] += 1
            if settings.print_freq and state["step"] % settings.print_freq == 0:
                job.log(f"epoch {epoch + 1} step {state['step']}/{total_steps} loss {loss.item():.4f}")
            _progress(job, epoch + 1, state["step"], total_steps, loss)
            if vote.poll():
                state["loss_sum"] += float(loss_sum)
                state["train_time"] += time.perf_counter() - tic
                checkpoint()
                return FitResult(state["history"], stopped=True)
        state["train_time"] += time.perf_counter() - tic
        late_stop = vote.drain()  # the last step's vote: the epoch is complete either way
        totals = torch.tensor([state["loss_sum"] + float(loss_sum), state["samples"]],
                              dtype=torch.float64, device=job.device)
        if job.distributed:
            collective(dist.all_reduce, totals)
        if scheduler is not None:
            scheduler.step()
        sync_buffers(job, model)
        record = {"epoch": epoch + 1, "train_loss": float(totals[0] / totals[1]), **evaluate_fn(),
                  "images_per_sec": float(totals[1]) / max(state["train_time"], 1e-9),
                  "lr": optimizer.param_groups[0]["lr"], "train_seconds": state["train_time"]}
        state["history"] = [*state["history"], record]
        state.update(epoch=epoch + 1, step=0, loss_sum=0.0, samples=0, train_time=0.0)
        if job.is_main:
            log(metric_line(record))
            write_metrics(settings.output_data_dir, state["history"])
        checkpoint()
        if late_stop | stop_agreed(job):  # no short cut: every rank must take part in the vote
            return FitResult(state["history"], stopped=epoch + 1 < settings.epochs)
    if os.environ.get(HASH_DIR_ENV):
        os.makedirs(os.environ[HASH_DIR_ENV], exist_ok=True)
        with open(os.path.join(os.environ[HASH_DIR_ENV], f"{job.rank}.sha256"), "w") as fh:
            fh.write(state_hash(model))
    return FitResult(state["history"], stopped=False)


def stop_agreed(job: Job) -> bool:
    """True on every rank when any rank was asked to stop (one tiny all_reduce)."""
    flag = torch.tensor([1.0 if _stop_signal else 0.0], device=job.device)
    if job.distributed:
        collective(dist.all_reduce, flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


class StopVote:
    """The stop vote of :func:`stop_agreed`, cast at every step without waiting for it.

    ``poll()`` starts this step's all_reduce in the background and returns the result of the
    previous step's: every rank gets the same answer at the same step, one step late, and the
    collective overlaps the next step's compute instead of adding a wait to every step.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self.pending: Optional[tuple[Any, torch.Tensor]] = None

    def poll(self) -> bool:
        if self.drain():
            return True  # every rank returns here at the same step: no vote is left in flight
        flag = torch.tensor([1.0 if _stop_signal else 0.0], device=self.job.device)
        work = (collective(dist.all_reduce, flag, op=dist.ReduceOp.MAX, async_op=True)
                if self.job.distributed else None)
        self.pending = (work, flag)
        return False

    def drain(self) -> bool:
        """Wait for the vote in flight; True if it said stop."""
        if self.pending is None:
            return False
        work, flag = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        return bool(flag.item() > 0)


def sync_buffers(job: Job, model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm statistics drift apart during training)."""
    if job.distributed:
        for buf in unwrap(model).buffers():
            collective(dist.broadcast, buf, src=0)


def metric_line(record: dict[str, Any]) -> str:
    """``METRIC epoch=3 train_loss=0.1234 val_loss=0.2000 val_accuracy=0.9712 images_per_sec=1234.5``."""
    formats = {"epoch": "{:d}", "images_per_sec": "{:.1f}"}
    parts = [f"{name}={formats.get(name, '{:.4f}').format(record[name])}"
             for name in METRIC_NAMES if record.get(name) is not None]
    return "METRIC " + " ".join(parts)


def write_metrics(directory: str, history: list[dict[str, Any]]) -> str:
    """``<directory>/metrics.json``: the list of per-epoch records (written atomically)."""
    path = os.path.join(directory, "metrics.json")
    write_atomic(path, lambda fh: fh.write(json.dumps(history, indent=1).encode()))
    return path


def _progress(job: Job, epoch: int, step: int, total: int, loss: torch.Tensor) -> None:
    """A progress bar on rank 0, only when stderr is a terminal."""
    if job.is_main and sys.stderr.isatty():
        done = int(30 * step / max(total, 1))
        sys.stderr.write(f"\repoch {epoch} [{'#' * done}{'.' * (30 - done)}] {step}/{total} "
                         f"loss {float(loss):.4f}")
        if step >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


# ---------------------------------------------------------------- evaluate


@torch.no_grad()
def evaluate(job: Job, model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
             bf16: Optional[bool] = None) -> dict[str, float]:
    """Loss and accuracy over this rank's batches, summed over all ranks: exact dataset totals.

    Give each rank a disjoint shard (:func:`shard`); the result is what one process gets on the
    whole data set. Uses the unwrapped model, so ranks may see different numbers of batches.
    """
    net = unwrap(model)
    was_training = net.training
    net.eval()
    bf16 = use_bf16(job, bf16)  # decided once, not per batch
    totals = torch.zeros(3, dtype=torch.float64, device=job.device)  # loss sum, correct, count
    for inputs, targets in batches:
        inputs, targets = inputs.to(job.device, non_blocking=True), targets.to(job.device, non_blocking=True)
        with autocast(job, bf16):
            outputs = net(inputs)
        totals[0] += F.cross_entropy(outputs.float(), targets, reduction="sum").double()
        totals[1] += (outputs.argmax(dim=1) == targets).sum()
        totals[2] += targets.numel()
        beat("eval")
    if job.distributed:
        collective(dist.all_reduce, totals)
    net.train(was_training)
    loss, correct, count = totals.tolist()
    return {"val_loss": loss / max(count, 1), "val_accuracy": correct / max(count, 1),
            "val_correct": int(correct), "val_count": int(count)}


# ---------------------------------------------------------------- checkpoints and the model


def write_atomic(path: str, write: Callable[[io.BufferedWriter], None]) -> None:
    """Write via a temp file in the same directory, fsync, then ``os.replace``: all or nothing."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=".part", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def rng_state(job: Job) -> dict[str, Any]:
    """This rank's random number generators as a checkpoint holds them: torch's (CPU, and the rank's CUDA
    device), Python's ``random``. numpy's is not kept: nothing here draws from it."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if job.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(job.device)
    return state


def set_rng_state(job: Job, state: Mapping[str, Any]) -> None:
    """Put back what :func:`rng_state` returned (after a checkpoint's round trip)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and job.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], job.device)


def save_checkpoint(directory: str, state: dict[str, Any], keep: int = 2) -> str:
    """Save ``state`` as ``checkpoint-e<epoch>-s<step>.pt`` atomically; keep the newest ``keep``."""
    path = os.path.join(directory, f"checkpoint-e{state['epoch']:04d}-s{state['step']:07d}.pt")
    write_atomic(path, lambda fh: torch.save(state, fh))
    for old in list_checkpoints(directory)[:-keep]:
        with contextlib.suppress(OSError):
            os.unlink(old)
    for stale in glob.glob(os.path.join(directory, _TEMP_PREFIX + "*")):  # left by a crashed writer
        with contextlib.suppress(OSError):
            os.unlink(stale)
    return path


def list_checkpoints(directory: str) -> list[str]:
    """Checkpoint files, oldest first (by epoch, then step)."""
    found = [(tuple(map(int, m.groups())), p) for p in glob.glob(os.path.join(directory, CHECKPOINT_GLOB))
             if (m := _CHECKPOINT_NAME.search(os.path.basename(p)))]
    return [p for _, p in sorted(found)]


def load_latest_checkpoint(directory: str) -> Optional[tuple[str, dict[str, Any]]]:
    """The newest checkpoint that loads, as ``(path, state)``; unreadable ones are skipped."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: fall back to an older one
            log(f"warning: skipping unreadable checkpoint {path}: {type(exc).__name__}: {exc}")
    return None


def save_model(job: Job, model_dir: str, model: nn.Module, name: str = "model.pt") -> Optional[str]:
    """Rank 0 writes the model's ``state_dict`` to ``<model_dir>/<name>`` (atomically); returns the path there."""
    if not job.is_main:
        return None
    path = os.path.join(model_dir, name)
    state = unwrap(model).state_dict()
    write_atomic(path, lambda fh: torch.save(state, fh))
    log(f"model saved: {path}")
    return path


def state_hash(model: nn.Module) -> str:
    """sha256 of every parameter and buffer, in order: equal hashes mean equal weights."""
    digest = hashlib.sha256()
    for name, tensor in unwrap(model).state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- shutdown


def _release_collectives(timeout: float) -> None:
    """Wait until gloo's worker threads have let go of the tensors of our collectives.

    A gloo worker thread drops its reference to a finished collective's tensor a moment after the
    caller's ``wait()`` returned, and dropping it takes the GIL (the tensor has a Python object). A
    rank that leaves right after its last collective (every rank but 0, while rank 0 saves the
    model) can reach interpreter shutdown first: the thread then dies in ``PyEval_AcquireThread`` and
    the process with SIGABRT ("terminate called without an active exception") after a successful
    run; 3 of 31 runs of train_cifar10.py here. ``destroy_process_group`` does not prevent it: the
    threads live as long as the group, which DDP keeps. ``_use_count() > 1``: C++ still holds it.
    """
    deadline = time.monotonic() + timeout
    while any(t._use_count() > 1 for t in list(_in_collectives.values())) and time.monotonic() < deadline:
        time.sleep(0.001)  # gives the GIL to the worker thread


def shutdown(timeout: float = 5.0) -> None:
    """Leave the process group (safe to call when there is none), once no collective holds our tensors."""
    if dist.is_available() and dist.is_initialized():
        _release_collectives(timeout)
        dist.destroy_process_group()


# ---------------------------------------------------------------- progress beats


def beat(note: str = "", force: bool = False) -> None:
    """Tell the launcher's hang detection this rank progresses: one datagram, at most once a second.

    Never blocks, never raises, prints nothing; costs a clock read when it is not due.
    """
    now = time.monotonic()
    state = _beat_state
    path = os.environ.get(BEAT_ENV)
    if not path or (not force and now - state["last"] < BEAT_EVERY):
        return
    state["last"] = now
    try:
        if state["sock"] is None:
            import socket

            state["sock"] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            state["sock"].setblocking(False)
        address = "\0" + path[1:] if path.startswith("@") else path  # "@": Linux's abstract namespace
        state["sock"].sendto(f"{os.environ.get('RANK', '0')} {note}".encode()[:64], address)
    except OSError:
        pass  # nobody listens, or the queue is full: the next beat tries again


@contextlib.contextmanager
def beating(note: str, every: float = 10.0) -> Iterator[None]:
    """Beat from a thread every ``every`` s while the body runs (a long checkpoint write)."""
    import threading

    done = threading.Event()

    def run() -> None:
        while not done.wait(every):
            beat(note, force=True)

    beat(note, force=True)
    thread = threading.Thread(target=run, name="progress-beat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
