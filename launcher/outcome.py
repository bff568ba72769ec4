"""How torchrun ended: the value the process supervisor hands to the failure analysis."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Optional


class Death(NamedTuple):
    """One worker's end as the kernel told it (:mod:`launcher.deaths`)."""

    at: float  # ``time.time()`` when it ended
    code: Optional[int]  # torchrun's way: the exit code, or -N for signal N; None: reaped before it could be read
    rank: Optional[int]  # its RANK and LOCAL_RANK, from the environment torchrun started it with
    local_rank: Optional[int]


class Outcome(NamedTuple):
    """How torchrun ended, as the launcher saw it."""

    returncode: int  # torchrun's; negative: killed by that signal
    pid: int
    stop_signal: Optional[int] = None  # the first stop signal the launcher received
    killed_after_grace: bool = False
    stderr_tail: Sequence[str] = ()
    no_rendezvous: bool = False  # no worker had started when the rendezvous timeout ran out: torchrun was killed
    deaths: Mapping[int, Death] = {}  # each worker's end, by the kernel (pid -> Death): launcher.deaths
    stopped_at: Optional[float] = None  # ``time.time()`` when the stop (stop_signal) was passed to the workers
