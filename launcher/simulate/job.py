"""The job simulate runs, as every platform has it: hosts, processes, the script, faults, how it ends;
and the chosen platform's own settings (:class:`PlatformOptions`, given by its builder).

A value: nothing here parses a command line (:mod:`launcher.simulate.config` does), writes or starts
anything. Builders (:mod:`launcher.simulate.hosts`) import this module, never the parser.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from launcher.errors import ConfigError

MAX_HOSTS = 64
DEFAULT_DEADLINE = 86400.0  # a day: the default platform's own hard stop (its default maximum run time)
NETWORK_FAULTS = ("partition", "poweroff")  # faults that are not a signal to the launcher and do not end
# Transient faults (HOST:KIND:AFTER:SECONDS): each ends by itself after SECONDS; what each stands for.
TRANSIENT_FAULTS = {"blip": "network blip", "pause": "stalled launcher", "vmpause": "VM pause",
                    "starve": "CPU starvation", "saturate": "CPU saturation"}


@dataclass(frozen=True)
class Fault:
    """A fault of one host, after some time or at a training step: a signal to its launcher
    (``kind`` ``signal``), or ``partition`` (its link goes down) or ``poweroff`` (every process of
    the host killed at once, the link down first); those two have ``signum`` 0. A transient fault
    (a kind of :data:`TRANSIENT_FAULTS`) lasts ``seconds`` and then ends by itself."""

    host: str
    signum: int
    after: Optional[float] = None
    step: Optional[int] = None
    kind: str = "signal"
    seconds: Optional[float] = None  # how long a transient fault lasts

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.kind == "signal" else self.kind

    @property
    def transient(self) -> bool:
        """True for a fault that ends by itself (the host is expected to survive it)."""
        return self.kind in TRANSIENT_FAULTS

    def meaning(self) -> str:
        """What the fault stands for on a cloud platform."""
        if self.kind in TRANSIENT_FAULTS:
            return TRANSIENT_FAULTS[self.kind]
        if self.kind != "signal":
            return {"partition": "network partition", "poweroff": "power loss"}[self.kind]
        return {signal.SIGKILL: "lost instance", signal.SIGTERM: "spot interruption"}.get(
            self.signum, "signal")

    def when(self) -> str:
        return f"step={self.step}" if self.step is not None else f"{self.after:g} s"


@dataclass(frozen=True)
class PlatformOptions:
    """A platform's own settings from its builder's options (none here): each builder with options of its
    own returns a frozen subclass from its ``check_options``."""

    def report(self) -> dict[str, Any]:
        """The platform's own entries of ``summary.json``."""
        return {}

    def started_through(self) -> str:
        """How the hosts' launchers are started, when not directly (the start line's words)."""
        return ""


@dataclass(frozen=True)
class Config:
    """The job simulate runs, decided from its command line before anything is written or started:
    what every platform has, and the chosen platform's own :class:`PlatformOptions`."""

    platform: str
    hosts: tuple[str, ...]
    nproc_per_node: Optional[int]
    workdir: str
    job_name: str
    script: str  # absolute path
    faults: tuple[Fault, ...]
    grace_period: float
    script_args: tuple[str, ...] = ()  # the words after the script, as the builder takes them
    network: Optional[str] = None  # netns or loopback; None: netns where permitted (decided at the start)
    network_note: str = ""  # why this network, when it was not asked for
    platform_stop: bool = True  # stop the other hosts when one fails, as the platform does
    deadline: float = DEFAULT_DEADLINE  # seconds: then every host is stopped
    options: PlatformOptions = field(default_factory=PlatformOptions)  # the platform's own


def plain_script(words: Sequence[str], cwd: str) -> tuple[str, tuple[str, ...]]:
    """``-- script.py args...`` where the job's command is ``python -m launcher script.py args...``."""
    if not words or words[0].startswith("-"):
        raise ConfigError("no training script: give it after '--' (-- script.py args...)")
    path = os.path.abspath(os.path.join(cwd, words[0]))
    if not os.path.isfile(path):
        raise ConfigError(f"training script not found: {words[0]!r}")
    return path, tuple(words[1:])
