"""What :func:`launcher.cli.plan` decides before anything starts: the :class:`Plan`, its :class:`Switch` es.

A plan is data only: the run (:func:`launcher.cli.run`) reads it and decides nothing again, and the dry run
(:func:`launcher.cli.describe`) prints it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from launcher import platforms
from launcher.cluster import Cluster
from launcher.command import Launch
from launcher.hangtimeout import Policy
from launcher.options import Invocation


class Switch(NamedTuple):
    """One capability of a run, on or off, and why: decided once by :func:`launcher.cli.decide`, said by the dry
    run."""

    on: bool
    why: str


class Plan(NamedTuple):
    """Everything decided before anything starts."""

    invocation: Invocation
    choice: platforms.Choice
    cluster: Cluster
    launch: Launch
    grace_period: float
    notes: tuple[str, ...]
    hang: Optional[Policy]  # hang detection's timeouts; None: off (``hangs`` says why)
    watch: Switch  # the job watch: the hosts watch each other (several nodes)
    hangs: Switch
    restarts: Switch  # job-wide restarts in place (--max-restarts)
    verdict: Switch  # on: node 0 names the job's root cause for every host (the first failure in time)
    outside: bool  # a host outside the training world (launcher/groups.py): the script once, no torchrun
    # seconds after torchrun's start by which a worker must exist (several nodes; None: no bound): torchrun's
    # store client can wait for ever on a port another program holds
    rendezvous_bound: Optional[float]
