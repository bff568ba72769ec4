"""``simulate --instance-groups NAME=TYPE:COUNT,...``: a SageMaker heterogeneous cluster.

SageMaker's API takes at most 5 instance groups (``ResourceConfig.InstanceGroups``), each with a name
(1-64 characters), an instance type and a count. The simulated hosts are ``algo-1`` .. ``algo-N`` in the
order the groups are given; each host's ``resourceconfig.json`` lists every group, its own first
(:func:`launcher.simulate.hosts.sagemaker_files.resource_config`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from launcher.errors import ConfigError, shown

MAX_GROUPS = 5
GROUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SPEC = re.compile(r"^(?P<name>[^=]+)=(?P<type>ml\.[a-z0-9.-]+):(?P<count>[0-9]+)$")

Groups = tuple[tuple[str, str, tuple[str, ...]], ...]


def parse_instance_groups(text: str, max_hosts: int) -> tuple[tuple[str, str, int], ...]:
    """``train=ml.g5.xlarge:2,data=ml.c5.xlarge:1`` as (name, instance type, count); ConfigError if bad."""
    groups: list[tuple[str, str, int]] = []
    for part in text.split(","):
        match = SPEC.match(part.strip())
        if match is None or not GROUP_NAME.match(match["name"]):
            raise ConfigError(f"--instance-groups: {shown(part)} is not NAME=ml.TYPE:COUNT (NAME: letters, digits, "
                              "'.', '_', '-', at most 64)")
        count = int(match["count"])
        if count < 1:
            raise ConfigError(f"--instance-groups: group {match['name']!r} needs at least 1 instance: {shown(part)}")
        if any(g[0] == match["name"] for g in groups):
            raise ConfigError(f"--instance-groups: group {match['name']!r} is given twice")
        groups.append((match["name"], match["type"], count))
    if len(groups) > MAX_GROUPS:
        raise ConfigError(f"--instance-groups: at most {MAX_GROUPS} groups (SageMaker's limit): {len(groups)}")
    total = sum(g[2] for g in groups)
    if total > max_hosts:
        raise ConfigError(f"--instance-groups: {total} hosts, more than {max_hosts}")
    return tuple(groups)


def assign_hosts(groups: Sequence[tuple[str, str, int]], hosts: Sequence[str]) -> Groups:
    """The hosts of each group, in the order given: the first group gets ``algo-1`` ..."""
    assigned, start = [], 0
    for name, kind, count in groups:
        assigned.append((name, kind, tuple(hosts[start:start + count])))
        start += count
    return tuple(assigned)
