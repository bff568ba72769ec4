"""Jobs whose hosts form groups of which only some train (:class:`~launcher.cluster.Role`): the hosts
outside the training world run the script once, without torchrun, under the same supervision.

Such a host's script gets the launcher's environment, plus the role's variables where unset (the
platform's own, e.g. SageMaker's ``SM_CURRENT_INSTANCE_GROUP``, and the training world's master as
``MASTER_ADDR`` and ``MASTER_PORT``), minus the variables that would make it look like a rank of the
training world (``RANK``, ``WORLD_SIZE``, ...). Signals, the grace period, the job watch and the
failure report work as for torchrun; the exit code is the script's own (128+N for signal N).

The job watch numbers every host of the job (``Role.job_hosts``; node 0 holds the hub). When every
training host has said ``done``, it stops the other hosts with SIGTERM and their configured grace
period: a script that exits 0 on SIGTERM, or dies of that SIGTERM, ends its host cleanly (exit 0);
any other exit is that host's failure. Stopped because another host failed, it exits with the job's
root cause like every other host, whatever its script did.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Optional

from launcher.cluster import Cluster
from launcher.command import INHERITED_PREFIXES, Launch, address_of, master_port
from launcher.options import Options
from launcher.outcome import Outcome

# What torchrun gives a rank: a script outside the training world must not mistake itself for one.
RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"})
TAIL_LINES = 12  # of the script's stderr in the report


def outside(cluster: Cluster) -> bool:
    """True on a host that does not train: it runs the script once, without torchrun."""
    return cluster.role is not None and not cluster.role.trains


def watch_place(cluster: Cluster) -> tuple[int, int, str]:
    """This host's node in the job watch, the number of nodes, and the hub's host.

    The whole job's hosts when only some train (the hub on the job's first host), else the training world.
    """
    role = cluster.role
    if role is None:
        return cluster.node_rank, cluster.nnodes, cluster.master_addr or ""
    return role.job_hosts.index(cluster.current_host), len(role.job_hosts), role.job_hosts[0]


def training_nodes(cluster: Cluster) -> Optional[frozenset[int]]:
    """The job watch's nodes that train, when not every host does (None: all train)."""
    role = cluster.role
    if role is None or set(cluster.hosts) == set(role.job_hosts):
        return None
    return frozenset(role.job_hosts.index(h) for h in cluster.hosts)


def script_launch(cluster: Cluster, options: Options, script: str, script_args: Sequence[str],
                  environ: Mapping[str, str], run_dir: str, python: Optional[str] = None) -> Launch:
    """``python script args...`` with the role's variables (set where unset) and no rank variables. Pure.

    ``MASTER_ADDR`` and ``MASTER_PORT`` are the training world's as torchrun gets them (``--resolve``,
    ``--master-port`` applied)."""
    role = cluster.role
    wanted = dict(role.env) if role is not None else {}
    if "MASTER_ADDR" in wanted:
        wanted["MASTER_ADDR"] = address_of(wanted["MASTER_ADDR"], options.resolve)
        wanted["MASTER_PORT"] = str(master_port(cluster, options))
    wanted.setdefault("PYTHONUNBUFFERED", "1")
    changes, notes = {}, []
    for name, value in wanted.items():
        if name in environ and environ[name] != value and not name.startswith("MASTER_"):
            notes.append(f"kept {name}={environ[name]} (already set) instead of {value}")
        else:
            changes[name] = value
    removed = tuple(sorted(k for k in environ if (k in RANK_VARIABLES or k.startswith(INHERITED_PREFIXES))
                           and k not in changes))
    return Launch((python or sys.executable, script, *script_args), changes, removed, run_dir,
                  os.path.join(run_dir, "error.json"), os.path.join(run_dir, "logs"), tuple(notes))


def exit_code(outcome: Outcome, training_ended: bool, stopped_by_failure: bool = False) -> int:
    """The script's code (128+N for signal N); 0 when the stop at the training world's end ended it.

    ``stopped_by_failure``: the job watch stopped it because another host failed: even a clean exit
    is then no success (128+N), so that the job's root cause decides the code."""
    code = outcome.returncode
    if training_ended and (code == 0 or (code == -signal.SIGTERM and not outcome.killed_after_grace)):
        return 0
    if code == 0:
        return 128 + outcome.stop_signal if stopped_by_failure and outcome.stop_signal else 0
    if outcome.stop_signal is not None and not training_ended:
        return 128 + outcome.stop_signal
    return code if code > 0 else 128 - code


def report(cluster: Cluster, outcome: Outcome, code: int, limit: int) -> str:
    """The failure report of a host outside the training world: who, how, the exception, stderr's tail."""
    group = cluster.role.group if cluster.role is not None else "?"
    who = f"{cluster.current_host} (group {group}, outside the training world): the script"
    if outcome.killed_after_grace:
        head = f"{who} was killed after the grace period (exit code {code})"
    elif outcome.returncode < 0:
        head = f"{who} was killed by {signal.Signals(-outcome.returncode).name} (exit code {code})"
    else:
        head = f"{who} exited with code {code}"
    lines = [line for line in outcome.stderr_tail if line.strip()][-TAIL_LINES:]
    exception = next((line for line in reversed(lines) if not line.startswith((" ", "\t"))), "")
    text = "\n".join([head, exception[:300], *lines] if exception else [head, *lines])
    return text[:limit]


def describe_lines(cluster: Cluster) -> list[str]:
    """The dry run's lines: which groups train and why, and what this host does."""
    role = cluster.role
    if role is None:
        return []
    lines = [f"groups:    this host is in group {role.group}; {role.why}"]
    if not role.trains:
        lines.append(f"outside:   not in the training world ({cluster.nnodes} host(s), master {cluster.master_addr}): "
                     "the script runs once, without torchrun; SIGTERM when every training host is done")
    return lines
