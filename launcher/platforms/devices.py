"""What accelerators and fabrics a host shows, read from device files and sysfs (no driver calls)."""

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


def rdma_drivers(sys_dir: str = "/sys") -> dict[str, str]:
    """RDMA device -> its kernel driver (``rdmap0s31 -> efa``, ``mlx5_0 -> mlx5_core``), from sysfs."""
    root = os.path.join(sys_dir, "class", "infiniband")
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return {}
    drivers = {}
    for name in names:
        try:
            drivers[name] = os.path.basename(os.readlink(os.path.join(root, name, "device", "driver")))
        except OSError:
            drivers[name] = ""
    return drivers
