"""The cluster description every platform produces, and the command builder consumes."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

MAX_NPROC = 1024  # more processes per host than any machine has cores or devices: a typo, not a plan


class Cluster(NamedTuple):
    """What one host knows about the job's cluster.

    ``hosts`` is in rank order (the same on every host), so ``hosts[0]`` is the master and
    ``hosts.index(current_host) == node_rank``. Platforms that only publish a node count and a master
    address (Kubeflow, SageMaker SDK v3) leave ``hosts`` empty and set ``master_addr`` directly.
    """

    platform: str
    nnodes: int
    node_rank: int
    nproc_per_node: int
    current_host: str
    master_addr: Optional[str]
    master_port: Optional[int] = None  # the platform's; the --master-port option wins
    hosts: tuple[str, ...] = ()
    local_addr: Optional[str] = None  # the address torchrun advertises for this node (several nodes)
    network_interface: Optional[str] = None
    instance_type: Optional[str] = None
    job_name: Optional[str] = None
    evidence: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (used by ``--dry-run --json``)."""
        data = self._asdict()
        data["hosts"] = list(self.hosts)
        data["evidence"] = list(self.evidence)
        return data
