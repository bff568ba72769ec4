"""The run's context: what every step of a run shares once it has started (:class:`Run`).

:func:`launcher.cli.run` makes one :class:`Run` from the plan (:mod:`launcher.plan`) and the services it started
(the watchdog, the job watch, hang detection) and hands it to :func:`launcher.supervise.supervise`,
:func:`launcher.generations.run_generations` and :func:`launcher.report.judge`. The services are typed by what
those steps need of them (:class:`JobWatch`, :class:`Hangs`), as supervise types its own (``JobWatch``,
``HangHook`` in :mod:`launcher.supervise`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol

if TYPE_CHECKING:
    from launcher.command import Launch
    from launcher.jobwatch import Event
    from launcher.plan import Plan
    from launcher.proctree import Watchdog
    from launcher.progress import Progress

StopHook = Callable[[float, str], None]


class JobWatch(Protocol):
    """What a run needs of the job watch (:class:`launcher.jobwatch.Watch`): the stop hook, this host's end,
    each generation's end and node 0's decision, and what it did (stopped the workers, learned the training
    world ended)."""

    stopped_job: bool  # the watch stopped this generation's workers (another host failed)
    stop_at: Optional[float]  # when it did (monotonic)
    off: str  # why this host runs without the watch ("" when it runs with it)
    training_ended: bool  # a host outside the training world: every training host is done
    decisions: dict[int, dict]  # node 0's decision at the end of each generation
    events: list[Event]  # the failures and losses heard, in the order heard

    def attach(self, request: Optional[StopHook]) -> None: ...

    def set_policy(self, rules: Optional[Callable[[int, list[dict], Optional[float]], dict]]) -> None: ...

    def new_generation(self) -> None: ...

    def finish(self, code: int, head: str, primary: bool) -> Optional[Event]: ...

    def end_generation(self, end: dict, timeout: float) -> Optional[dict]: ...

    def close(self) -> None: ...


class Hangs(Protocol):
    """What a run needs of hang detection (:class:`launcher.hangwatch.HangWatch`): the output, the stop hook, the
    steps seen, and its verdict."""

    verdict: Optional[str]  # the culprit sentence once a hang was decided
    culprit: tuple[Optional[int], Optional[str]]  # the rank that stands out, and its host
    progress: Progress

    def feed(self, chunk: bytes, stderr: bool = False) -> None: ...

    def attach(self, request: Optional[StopHook], pid: Optional[int] = None,
               hold: Optional[Callable[[Optional[float]], None]] = None) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Run:
    """One run on this host: its plan, environment, log, watchdog, job watch and hang detection (None: off).

    Frozen: a restart's new generation makes a new :class:`Run` (:meth:`with_generation`)."""

    plan: Plan
    environ: Mapping[str, str]
    log: Callable[[str], None]
    watchdog: Watchdog
    watch: Optional[JobWatch] = None
    hangs: Optional[Hangs] = None
    generation: Optional[Launch] = None  # the current generation's launch, when a restart made one

    @property
    def launch(self) -> Launch:
        """What the current generation started (the plan's launch, until a restart)."""
        return self.generation if self.generation is not None else self.plan.launch

    @property
    def grace_period(self) -> float:
        """Seconds between the stop signal to the workers and killing what is left (the plan's)."""
        return self.plan.grace_period

    @property
    def direct(self) -> bool:
        """The launch is the script itself, not torchrun: a host outside the training world."""
        return self.plan.outside

    @property
    def rendezvous_bound(self) -> Optional[float]:
        """Seconds after torchrun's start by which a worker must exist (None: no bound); the plan's."""
        return self.plan.rendezvous_bound

    def with_generation(self, launch: Launch, hangs: Optional[Hangs]) -> Run:
        """This run in another generation: its launch and its hang detection."""
        return Run(self.plan, self.environ, self.log, self.watchdog, self.watch, hangs, launch)
