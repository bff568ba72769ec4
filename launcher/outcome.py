"""How torchrun ended: the value the process supervisor hands to the failure analysis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional


class Outcome(NamedTuple):
    """How torchrun ended, as the launcher saw it."""

    returncode: int  # torchrun's; negative: killed by that signal
    pid: int
    stop_signal: Optional[int] = None  # the first stop signal the launcher received
    killed_after_grace: bool = False
    stderr_tail: Sequence[str] = ()
    no_rendezvous: bool = False  # no worker had started when the rendezvous timeout ran out: torchrun was killed
