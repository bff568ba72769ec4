"""The cluster description every platform produces, and the command builder consumes."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

MAX_NPROC = 1024  # more processes per host than any machine has cores or devices: a typo, not a plan


class Role(NamedTuple):
    """This host's place in a job where only some hosts train (SageMaker's heterogeneous clusters).

    The :class:`Cluster` around it is the training world; ``job_hosts`` is every host of the job, the
    job watch's node order (node 0 holds the hub). A host that does not train runs the script once,
    without torchrun, with ``env`` added where the environment does not set it already.
    """

    job_hosts: tuple[str, ...]
    trains: bool
    group: str
    why: str  # which groups train, and why (the dry run shows it)
    env: tuple[tuple[str, str], ...] = ()


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
    role: Optional[Role] = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (used by ``--dry-run --json``)."""
        data = self._asdict()
        data["hosts"] = list(self.hosts)
        data["evidence"] = list(self.evidence)
        if self.role is not None:
            data["role"] = {**self.role._asdict(), "job_hosts": list(self.role.job_hosts),
                            "env": dict(self.role.env)}
        return data
