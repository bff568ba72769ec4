"""SageMaker's heterogeneous clusters: which instance groups train, and what the other hosts are told.

``resourceconfig.json`` of such a job: ``hosts`` (every host of every group, sorted as strings),
``current_group_name``, ``current_instance_type`` and ``instance_groups``
(``[{instance_group_name, instance_type, hosts}]``, the current group first, a group's hosts not sorted).

The training groups, first found wins:

1. the launcher's option ``--instance-groups`` (hyperparameter ``launcher-instance-groups``);
2. the hyperparameter ``sagemaker_distribution_instance_groups``, which SDK 2.x writes for
   ``distribution={"instance_groups": [...]}`` (MPI and smdistributed only);
3. every group, as in a one-group job (the dry run says so).

The training world is the hosts of the training groups sorted as strings (as ``hosts`` is), so every
host computes the same ranks and the same master, the first of them. The job watch numbers every host
of the job in ``hosts`` order: node 0, the first host of the job, holds the hub.

A host outside the training groups runs the script once, without torchrun, as AWS's toolkit does
with a distribution group. Its script gets AWS's toolkit variables (``Environment.to_env_vars``:
``SM_CURRENT_HOST``, ``SM_HOSTS``, ``SM_CURRENT_INSTANCE_TYPE``, ``SM_CURRENT_INSTANCE_GROUP``,
``SM_CURRENT_INSTANCE_GROUP_HOSTS``, ``SM_INSTANCE_GROUPS``, ``SM_INSTANCE_GROUPS_DICT``,
``SM_DISTRIBUTION_INSTANCE_GROUPS``, ``SM_IS_HETERO``) where they are not set already (SDK 3.x's
drivers set none of them), and the training world's master as ``MASTER_ADDR`` and ``MASTER_PORT``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Optional

from launcher.cluster import Role
from launcher.errors import ConfigError, shown

OPTION = "--instance-groups (hyperparameter launcher-instance-groups)"
DISTRIBUTION_KEY = "sagemaker_distribution_instance_groups"


class Group(NamedTuple):
    """One instance group as ``resourceconfig.json`` lists it."""

    name: str
    instance_type: str
    hosts: tuple[str, ...]  # as listed: not sorted

    def to_json(self) -> dict[str, Any]:
        """The group as AWS's toolkit shows it (``SM_INSTANCE_GROUPS_DICT``)."""
        return {"instance_group_name": self.name, "instance_type": self.instance_type, "hosts": list(self.hosts)}


class World(NamedTuple):
    """The training world's hosts (sorted) and this host's role in the job (None: one group, all train)."""

    hosts: tuple[str, ...]
    role: Optional[Role]
    evidence: str


def read_groups(config: Mapping[str, Any], source: str, hosts: Sequence[str]) -> tuple[Group, ...]:
    """``instance_groups`` checked: names, types, hosts that are the job's; () when the key is absent."""
    listed = config.get("instance_groups")
    if listed is None:
        return ()
    if not isinstance(listed, list):
        raise ConfigError(f"{source}: instance_groups is not a list: {shown(listed)}")
    groups: list[Group] = []
    for entry in listed:
        if not isinstance(entry, dict) or not isinstance(entry.get("instance_group_name"), str) \
                or not entry["instance_group_name"] or not isinstance(entry.get("hosts"), list):
            raise ConfigError(f"{source}: an instance group needs instance_group_name and hosts: {shown(entry)}")
        name = entry["instance_group_name"]
        if any(g.name == name for g in groups):
            raise ConfigError(f"{source}: instance group {shown(name)} is listed twice")
        members = entry["hosts"]
        strange = [h for h in members if not isinstance(h, str) or h not in hosts]
        if strange:
            raise ConfigError(f"{source}: instance group {shown(name)} has host {shown(strange[0])}, which is not "
                              f"in hosts {shown(list(hosts))}")
        kind = entry.get("instance_type")
        groups.append(Group(name, kind if isinstance(kind, str) else "", tuple(members)))
    return tuple(groups)


def parse_names(value: Any, source: str) -> tuple[str, ...]:
    """Group names as a hyperparameter holds them: a JSON list, or text with commas."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",")]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{source} is not a list of instance group names: {shown(value)}")
    return tuple(value)


def distribution_groups(hyperparameters: Optional[Mapping[str, Any]], source: str) -> Optional[tuple[str, ...]]:
    """``sagemaker_distribution_instance_groups`` from ``hyperparameters.json`` (JSON-encoded), if written."""
    if not hyperparameters or DISTRIBUTION_KEY not in hyperparameters:
        return None
    raw = hyperparameters[DISTRIBUTION_KEY]
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        value = raw
    return parse_names(value, f"{source}: {DISTRIBUTION_KEY}")


def _choose(groups: Sequence[Group], chosen: Optional[Sequence[str]], distribution: Optional[Sequence[str]],
            source: str) -> tuple[tuple[str, ...], str]:
    """The training groups' names and why."""
    names = [g.name for g in groups]
    if chosen is not None:
        picked, why, origin = tuple(chosen), "named by", OPTION
    elif distribution is not None:
        picked, why, origin = tuple(distribution), "named by the hyperparameter", DISTRIBUTION_KEY
    else:
        return tuple(names), (f"every group trains ({', '.join(names)}): neither {OPTION} nor the hyperparameter "
                              f"{DISTRIBUTION_KEY} names the training groups")
    for name in picked:
        if name not in names:
            raise ConfigError(f"{origin} names instance group {shown(name)}, which this job does not have "
                              f"(its groups: {shown(', '.join(names))}; {source})")
    return picked, f"training groups {', '.join(picked)} {why} {origin}"


def training_world(config: Mapping[str, Any], hosts: tuple[str, ...], current: str, source: str,
                   chosen: Optional[Sequence[str]], distribution: Optional[Sequence[str]],
                   master_port: int) -> World:
    """Which hosts train, and this host's role; raises a one-line :class:`ConfigError` on a bad configuration."""
    groups = read_groups(config, source, hosts)
    if not groups:
        if chosen is not None:
            raise ConfigError(f"{OPTION} needs a job with instance groups; {source} lists none")
        return World(hosts, None, "")
    mine = [g for g in groups if current in g.hosts]
    if not mine:
        raise ConfigError(f"{source}: current host {shown(current)} is in no instance group "
                          f"({shown(', '.join(g.name for g in groups))})")
    picked, why = _choose(groups, chosen, distribution, source)
    for group in groups:
        if group.name in picked and not group.hosts:
            raise ConfigError(f"{source}: training instance group {shown(group.name)} has no host")
    if len(groups) == 1:
        return World(hosts, None, "")
    train = tuple(sorted({h for g in groups if g.name in picked for h in g.hosts}))
    group = mine[0]
    trains = current in train
    env = toolkit_variables(config, groups, group, hosts, current, distribution) if not trains else {}
    if not trains:
        env.update({"MASTER_ADDR": train[0], "MASTER_PORT": str(master_port)})
    role = Role(job_hosts=hosts, trains=trains, group=group.name, why=why, env=tuple(env.items()))
    place = (f"node {train.index(current)} of the training world" if trains else
             "outside the training world: runs the script once, without torchrun")
    evidence = (f"instance group {group.name!r} ({len(groups)} groups); {why}; {len(train)} training host(s) of "
                f"{len(hosts)}; this host: {place}")
    return World(train, role, evidence)


def _json(value: Any) -> str:
    """The toolkit's format for a variable's value (``mapping.to_env_vars``): compact, sorted JSON."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def toolkit_variables(config: Mapping[str, Any], groups: Sequence[Group], group: Group, hosts: Sequence[str],
                      current: str, distribution: Optional[Sequence[str]]) -> dict[str, str]:
    """The ``SM_*`` variables AWS's toolkit gives a host of a heterogeneous job, in its format."""
    return {
        "SM_CURRENT_HOST": current,
        "SM_HOSTS": _json(list(hosts)),
        "SM_CURRENT_INSTANCE_TYPE": str(config.get("current_instance_type") or group.instance_type or "local"),
        "SM_CURRENT_INSTANCE_GROUP": group.name,
        "SM_CURRENT_INSTANCE_GROUP_HOSTS": _json(list(group.hosts)),
        "SM_INSTANCE_GROUPS": _json([g.name for g in groups]),
        "SM_INSTANCE_GROUPS_DICT": _json({g.name: g.to_json() for g in groups}),
        "SM_DISTRIBUTION_INSTANCE_GROUPS": _json(list(distribution or [])),
        "SM_IS_HETERO": _json(len(groups) > 1),
    }
