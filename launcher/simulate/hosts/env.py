"""A plain torchrun-style cluster (Docker Compose, Volcano, bare metal): hosts ``node-0`` ..
``node-<N-1>`` that know only ``MASTER_ADDR`` (the first host's name), ``MASTER_PORT``, ``NNODES`` and
their ``NODE_RANK`` -- the variables ``torchrun``'s own documentation has users export by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from launcher.simulate.hosts.base import HostSpec, plain_hosts
from launcher.simulate.job import Config

NAME = "env"
SUMMARY_NOTE = "each host's files stay in its directory"
HOSTS_HELP = "node-i: MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK"


def host_names(job_name: str, count: int) -> tuple[str, ...]:
    """``node-0`` .. ``node-<N-1>`` (Compose service names, say)."""
    return tuple(f"node-{i}" for i in range(count))


def node_variables(count: int, index: int, port: int, nproc: Optional[int]) -> dict[str, str]:
    """Host ``index``'s variables; ``--nproc-per-node`` goes in ``LAUNCHER_NPROC_PER_NODE``."""
    env = {"MASTER_ADDR": host_names("", count)[0], "MASTER_PORT": str(port), "NNODES": str(count),
           "NODE_RANK": str(index)}
    if nproc:
        env["LAUNCHER_NPROC_PER_NODE"] = str(nproc)
    return env


def make_hosts(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write each host's directory; the hosts run ``python -m launcher script.py args...``."""
    count = len(config.hosts)
    return plain_hosts(config, environ, lambda i, _base: node_variables(count, i, port, config.nproc_per_node),
                       resolve=config.hosts)
