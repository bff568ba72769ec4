"""The cluster description every platform produces, and the command builder consumes."""

from __future__ import annotations

import re
from typing import Any, NamedTuple, Optional

MAX_NPROC = 1024  # more processes per host than any machine has cores or devices: a typo, not a plan
# RFC 1123 labels (a leading digit allowed), and '_' as Docker Compose service names have it
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")
_IPV6 = re.compile(r"^\[?[0-9A-Fa-f:.]+\]?$")


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


def is_host_name(text: str) -> bool:
    """True for a host name (RFC 1123 labels, at most 253 characters) or an IPv4/IPv6 address.

    Control characters, blanks and shell characters are never part of one: such a "name" cannot
    resolve, and printed raw it would forge lines of output.
    """
    if len(text) > 253:
        return False
    if _HOST_NAME.match(text):
        return True
    if ":" in text and _IPV6.match(text):
        import ipaddress  # only for an IPv6 address

        try:
            ipaddress.IPv6Address(text.strip("[]"))
        except ValueError:
            return False
        return True
    return False


def bad_host(cluster: Cluster) -> Optional[tuple[str, str]]:
    """The first of the cluster's host names that is not one (``(role, name)``), else None."""
    named = [("master", cluster.master_addr), ("this host", cluster.current_host), ("this host's address",
             cluster.local_addr)] + [("host", h) for h in cluster.hosts]
    return next(((role, name) for role, name in named if name is not None and not is_host_name(name)), None)
