"""A single machine with no cluster manager: one node, this host as its own master."""

from __future__ import annotations

import os
from typing import Optional

from launcher.cluster import Cluster
from launcher.platforms.devices import count_gpus

NAME = "local"


def resolve(requested_nproc: Optional[int] = None, dev_dir: str = "/dev") -> Cluster:
    """One node; processes: the option, else one per GPU, else 1."""
    if requested_nproc is not None:
        nproc, why = requested_nproc, f"--nproc-per-node {requested_nproc}"
    else:
        gpus = count_gpus(dev_dir)
        nproc = gpus or 1
        why = f"{gpus} GPU device(s) in {dev_dir}" if gpus else "no GPU device: 1 process (CPU, gloo)"
    return Cluster(
        platform=NAME,
        nnodes=1,
        node_rank=0,
        nproc_per_node=nproc,
        current_host=os.uname().nodename,
        master_addr=None,
        evidence=("no cluster manager found (no SageMaker files or SM_* variables)", why),
    )
