"""A single machine with no cluster manager: one node, this host as its own master."""

from __future__ import annotations

from collections.abc import Mapping

from launcher.cluster import Cluster
from launcher.platforms.base import HostView, Platform, nproc_per_node


class Local(Platform):
    """One machine, no cluster manager: ``torchrun --standalone``."""

    name = "local"
    reads = "nothing: one node, --nproc-per-node or one process per GPU"
    grace_period = 30.0

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        return ("always: one machine",)

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        evidence: list[str] = []
        nproc = nproc_per_node(host, evidence)
        return Cluster(platform=self.name, nnodes=1, node_rank=0, nproc_per_node=nproc,
                       current_host=host.name, master_addr=None, evidence=tuple(evidence))


PLATFORM = Local()
