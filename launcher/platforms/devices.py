"""What accelerators and fabrics a host shows, read from device files (no driver calls)."""

from __future__ import annotations

import os
import re

_NVIDIA = re.compile(r"nvidia\d+$")


def count_gpus(dev_dir: str = "/dev") -> int:
    """Number of NVIDIA GPUs (``/dev/nvidia0``, ``/dev/nvidia1``, ...)."""
    try:
        return sum(1 for name in os.listdir(dev_dir) if _NVIDIA.match(name))
    except OSError:
        return 0


def has_efa(dev_dir: str = "/dev") -> bool:
    """True where an EFA (or other verbs) device exists: ``/dev/infiniband/uverbs*``."""
    try:
        return any(name.startswith("uverbs") for name in os.listdir(os.path.join(dev_dir, "infiniband")))
    except OSError:
        return False
