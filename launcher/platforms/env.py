"""A plain torchrun-style environment: Docker Compose, Volcano, bare metal, any hand-made cluster.

Reads, per host (the plain name first, torchrun's own ``PET_*`` name second; both set and different is
an error): ``MASTER_ADDR``/``PET_MASTER_ADDR``, ``MASTER_PORT``/``PET_MASTER_PORT``,
``NNODES``/``PET_NNODES`` (else ``WORLD_SIZE`` counted as nodes, when ``NODE_RANK`` is given),
``NODE_RANK``/``PET_NODE_RANK``, and ``NPROC_PER_NODE``/``PET_NPROC_PER_NODE`` (torchrun's words
``auto``/``gpu``/``cpu`` or a number). These are the names torchrun itself reads
(``torch/distributed/run.py``: every flag also as ``PET_<FLAG>``) and the ones the Compose and Slurm
recipes in PyTorch's documentation export. A ``RANK`` without a node rank is ambiguous (torchrun's
``RANK`` is a process's global rank; Kubeflow's one-process-per-pod ``RANK`` is a pod index): refused.
"""

from __future__ import annotations

from collections.abc import Mapping

from launcher.cluster import Cluster
from launcher.errors import ConfigError, shown
from launcher.platforms.base import (
    HostView,
    Platform,
    first_set,
    node_count,
    node_rank_in,
    nproc_per_node,
    port_number,
    torchrun_nproc,
    whole_number,
)

ADDRESSES = ("MASTER_ADDR", "PET_MASTER_ADDR")
# A cluster shows a node rank or a count; MASTER_ADDR alone (often exported on a workstation for
# single-machine scripts) is not one, and leaves the host to `local`.
SHAPES = ("NODE_RANK", "PET_NODE_RANK", "NNODES", "PET_NNODES", "RANK", "WORLD_SIZE")


class TorchrunEnvironment(Platform):
    """Hosts that export MASTER_ADDR, MASTER_PORT, NNODES and NODE_RANK (or torchrun's PET_* names)."""

    name = "env"
    fixed_port = True  # MASTER_PORT: whoever set the variables chose it (a firewall may allow only it)
    reads = ("MASTER_ADDR, MASTER_PORT, NNODES (or WORLD_SIZE of nodes), NODE_RANK, NPROC_PER_NODE, "
             "or torchrun's PET_* names for them")

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        if not any(environ.get(name) for name in SHAPES):
            return ()
        return tuple(f"{name} is set" for name in ADDRESSES + SHAPES if environ.get(name))

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        evidence: list[str] = []
        rank_name = first_set(environ, ("NODE_RANK", "PET_NODE_RANK"))
        count_name = first_set(environ, ("NNODES", "PET_NNODES"))
        if rank_name is None and environ.get("RANK", "").strip():
            raise ConfigError(f"RANK={shown(environ['RANK'])} without NODE_RANK is ambiguous (a process's global "
                              "rank, or a node's index?): set NODE_RANK (this host's index) and NNODES for the "
                              "launcher, or --platform local for one machine")
        if count_name:
            nnodes = node_count(environ, count_name) or 1
        elif rank_name and environ.get("WORLD_SIZE", "").strip():
            count_name = "WORLD_SIZE"
            nnodes = whole_number(environ, "WORLD_SIZE", minimum=1) or 1
            evidence.append(f"WORLD_SIZE={nnodes} taken as the number of nodes (NNODES is not set)")
        else:
            raise ConfigError(f"{rank_name or 'MASTER_ADDR'}={shown(environ.get(rank_name or 'MASTER_ADDR', ''))} "
                              "without NNODES: set NNODES (the number of hosts) and NODE_RANK on every host")
        rank = node_rank_in(nnodes, whole_number(environ, rank_name) if rank_name else None,
                            "NODE_RANK", count_name)
        master_name = first_set(environ, ("MASTER_ADDR", "PET_MASTER_ADDR"))
        master = environ[master_name].strip() if master_name else None
        if nnodes > 1 and not master:
            raise ConfigError(f"MASTER_ADDR is not set (needed with {count_name}={nnodes})")
        port_name = first_set(environ, ("MASTER_PORT", "PET_MASTER_PORT"))
        port = port_number(environ, port_name) if port_name else None
        evidence.append(f"{count_name}={nnodes}, {rank_name}={rank}, master {master}:{port or 'default'}")
        nproc_name = first_set(environ, ("NPROC_PER_NODE", "PET_NPROC_PER_NODE"))
        if nproc_name:
            nproc = torchrun_nproc(environ[nproc_name], nproc_name, host, evidence)
        else:
            nproc = nproc_per_node(host, evidence)
        return Cluster(platform=self.name, nnodes=nnodes, node_rank=rank, nproc_per_node=nproc,
                       current_host=host.name, master_addr=master, master_port=port, evidence=tuple(evidence))


PLATFORM = TorchrunEnvironment()
