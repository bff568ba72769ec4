"""Job-wide restarts in place: one generation of workers after another, on the same hosts.

A *generation* is one torchrun per host with the same world (generation 0 is the first start). With
``--max-restarts N`` (N >= 1) a failure anywhere ends the generation on every host, and node 0 decides
for all (:func:`Policy.decide`, carried by the job watch, :mod:`launcher.jobwatch`): restart, or end the
job. The rules, in order:

1. a lost host: never restarted (the platform cannot hand the job a new host): the job ends, 137;
2. every host succeeded: the job is done;
3. a stop signal from the platform on any host: never restarted;
4. the root cause's class is not in ``--restart-on`` (default :data:`launcher.options.DEFAULT_RESTART_ON`):
   the job ends with it;
5. the budget (``--max-restarts``, job-wide) is used up: the job ends with the root cause's class and code;
6. *no progress*, only with evidence of it: a restarted generation failed with the same root cause as the
   generation before it (:func:`root_key`: the exception's type and the script's ``file:line``, or the
   signal, or ``hang``), every host's ranks were watched (sampled, or beating) and no rank of any host made
   a step: the job ends with class ``no_progress``, exit code 93, which retry policies do not retry;
7. else every host starts the next generation.

The root cause is the first failure in time across the job, whatever its text says: node 0 stamps each
host's first failure on its own clock (each host sends its record's and death's ``time.time()``, node 0 places
them by ``Hub.clock_offset``; :func:`failed_at`), and a
failure is a consequence of another only with evidence: another failed first by that clock, or its
workers were stopped by the job watch (``primary`` False). When every failure looks secondary, the
earliest is the cause. Every host gets the same decision, so every host agrees on the class and the code.

Progress is what hang detection sees as a step (:mod:`launcher.progress`): an explicit beat of a rank
(``train_scripts/ddp_utils.py`` beats at every step) or the bootstrap's sampler's ``~step`` (the main
thread went round a loop of the script's own code). A generation that stepped made progress; a script
whose ranks were never heard by the sampler or a beat (``DDP_LAUNCHER_SAMPLE=0``) gives no evidence either
way, and is restarted until the budget is spent.

Bad input (exit 2 before anything starts) and the launcher's own error (70) never reach this module.
"""

from __future__ import annotations

import re
import select
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional

from launcher import codes
from launcher.failuretime import FailedAt, earlier
from launcher.progress import BeatSocket, Progress

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


class End(NamedTuple):
    """How one host's generation ended (sent to node 0 as the job watch's ``gen_end``)."""

    node: int
    host: str
    code: int  # 0: every worker succeeded
    klass: str  # the host's own class (launcher/codes.py)
    key: str  # the root cause's identity (root_key); "" on success
    head: str  # the first lines of its report
    primary: bool  # False: its workers were stopped because another host failed (or torchrun itself failed)
    progress: bool  # a rank of this host made a step during the generation (a beat, or a sampled step)
    stopped: bool = False  # a stop signal from the platform ended it
    age: float = 0.0  # seconds from this host's first failure (its first worker's end) to this message
    at: float = 0.0  # when that failure was, on node 0's clock (node 0 sets it on arrival: now - age)
    watched: bool = True  # the sampler or a beat heard a rank of this host: "no step" is evidence
    steps: int = 0  # step-like events of this host's ranks in the generation
    record_at: Optional[float] = None  # that first failure by its two clocks (launcher/failuretime.py): its exit
    death_at: Optional[float] = None  # record's and its death's time.time(), None: unknown (node 0's clock at node 0)
    ahead_gone: bool = False  # its next generation, started ahead (launcher/ahead.py), has ended meanwhile

    def message(self) -> dict:
        """As the job watch carries it."""
        return self._asdict()


def end_of(message: dict) -> End:
    """An ``End`` from a job watch message; raises (KeyError, TypeError, ValueError) on a malformed one."""
    return End(int(message["node"]), str(message["host"])[:100], int(message["code"]), str(message["klass"])[:40],
               str(message["key"])[:300], str(message["head"])[:600], bool(message["primary"]),
               bool(message["progress"]), bool(message["stopped"]), _seconds(message.get("age", 0.0)),
               float(message.get("at", 0.0)), bool(message.get("watched", True)), int(message.get("steps", 0)),
               _maybe_time(message.get("record_at")), _maybe_time(message.get("death_at")),
               bool(message.get("ahead_gone", False)))


def _maybe_time(value: object) -> Optional[float]:
    """A ``time.time()`` from a message, or None (raises ValueError on a bad one)."""
    if value is None:
        return None
    seconds = float(value)  # type: ignore[arg-type]
    if not 0.0 <= seconds < 1e11:
        raise ValueError("not a time")
    return seconds


def _seconds(value: object) -> float:
    """A duration from a message: a finite number of seconds, at least 0 (raises ValueError otherwise)."""
    seconds = float(value)  # type: ignore[arg-type]
    if not 0.0 <= seconds < 1e9:
        raise ValueError("not a duration")
    return seconds


class Decision(NamedTuple):
    """Node 0's decision at the end of a generation, the same on every host."""

    generation: int  # the generation that ended
    restart: bool
    why: str  # restart, success, lost, stopped, class, budget, no_progress, no_decision
    used: int  # restarts used so far, this one included
    cause: Optional[End] = None
    fresh: bool = False  # a host's next generation started ahead has ended: every host starts it afresh

    def message(self) -> dict:
        """As the job watch carries it."""
        return {"generation": self.generation, "restart": self.restart, "why": self.why, "used": self.used,
                "cause": None if self.cause is None else self.cause.message(), "fresh": self.fresh}

    def sentence(self, budget: int) -> str:
        """Why the job ends here (empty when it restarts or succeeded)."""
        cause = self.cause
        what = f"{cause.head.splitlines()[0]}" if cause is not None and cause.head else "a failure"
        return {
            "lost": "a lost host is never restarted",
            "stopped": "a stop signal from the platform is never restarted",
            "class": f"its class {cause.klass if cause else '?'} is not restarted (--restart-on)",
            "budget": f"the restart budget is used up ({self.used} of {budget} job-wide restarts)",
            "no_progress": (f"restarting does not help: generation {self.generation} failed with the same root "
                            f"cause as generation {self.generation - 1} ({cause.key if cause else '?'}) and made no "
                            f"progress (no step from any rank: no beat, no sampled step) since the restart: {what}"),
            "no_decision": "node 0 decided nothing in time: no restart",
        }.get(self.why, "")


def decision_of(message: dict) -> Decision:
    """A ``Decision`` from a job watch message; raises on a malformed one."""
    cause = message.get("cause")
    return Decision(int(message["generation"]), bool(message["restart"]), str(message["why"])[:20],
                    int(message["used"]), None if cause is None else end_of(cause), bool(message.get("fresh", False)))


class Policy:
    """Node 0's (or a single node's) rules: the budget, the classes restarted, the last root cause."""

    def __init__(self, budget: int, restart_on: Sequence[str]) -> None:
        self.budget, self.restart_on = budget, frozenset(restart_on)
        self.used = 0
        self.previous: Optional[str] = None  # the root key of the generation before

    def decide(self, generation: int, ends: Sequence[End], lost: bool = False,
               lost_at: Optional[float] = None) -> Decision:
        """The decision at the end of ``generation``, from every host's end (see the module's rules). With a
        host lost (``lost``), a failure is the root cause only if it came before that host was last heard
        (``lost_at``, on the clock of the ends' ``at``; None: unknown, every failure counts)."""
        cause = root_cause(ends, lost_at if lost else None)
        why = ("lost" if lost else "success" if cause is None else
               "stopped" if any(e.stopped for e in ends) else
               "class" if cause.klass not in self.restart_on else
               "budget" if self.used >= self.budget else
               "no_progress" if generation > 0 and cause.key == self.previous and no_progress(ends)
               else "restart")
        if why == "restart":
            self.used += 1
        if cause is not None:
            self.previous = cause.key
        return Decision(generation, why == "restart", why, self.used, cause, any(e.ahead_gone for e in ends))


def root_cause(ends: Sequence[End], before: Optional[float] = None) -> Optional[End]:
    """The generation's root cause: the earliest failure by node 0's clock that is not a consequence (``primary``;
    earliest by :func:`launcher.failuretime.earlier` over each host's record and death times); when every failure
    is one, the earliest of them; None when every host succeeded, or when none failed ``before`` (a lost host's
    last word: the loss came first)."""
    failing = [e for e in ends if e.code != 0 and (before is None or e.at < before)]
    first = None
    for end in sorted([e for e in failing if e.primary] or failing, key=lambda e: e.at):
        if first is None or earlier(failed_at(end), failed_at(first)):
            first = end
    return first


def failed_at(end: End) -> FailedAt:
    """A host's first failure on node 0's clock: its record's and death's times (node 0 placed them on its own
    clock on arrival: :meth:`launcher.jobwatch.hub.Hub.clock_offset`); ``at`` as the record's when neither is known
    (the generation's end; ``at`` is node 0's monotonic clock, so then neither is known for any host)."""
    if end.record_at is None and end.death_at is None:
        return FailedAt(end.at, None)
    return FailedAt(end.record_at, end.death_at)


def no_progress(ends: Sequence[End]) -> bool:
    """Evidence that a generation made no progress: every host's ranks were watched and none stepped."""
    return bool(ends) and all(e.watched and not e.progress for e in ends)


def root_key(klass: str, exception: str, detail: str, signal: Optional[str], code: int) -> str:
    """A failure's identity: ``hang``; the signal (``SIGKILL``); else the exception's type and the last
    frame of the traceback (``ValueError@train.py:12``), the file by its base name; without a traceback
    (``sys.exit(3)``) the exit code (``exit 3``)."""
    if klass == codes.HANG:
        return "hang"
    if signal:
        return signal
    frames = _FRAME.findall(detail or "")
    if not frames:
        return f"exit {code}"
    kind = exception.split(":", 1)[0].strip() or "exit"
    path, line = frames[-1]
    return f"{kind}@{path.rsplit('/', 1)[-1]}:{line}"


PHASES = ("detection", "stop", "barrier", "new_torchrun", "first_step")


class Steps:
    """A generation's progress on this host: its steps (hang detection's :class:`Progress`, else one fed by
    a beat socket of its own, drained by a thread), and the restart's one log line at its first step, with
    the restart's phases (:func:`phases_text`)."""

    def __init__(self, progress: Progress, beats: Optional[BeatSocket], log: Callable[[str], None],
                 pending: str = "", failed_at: Optional[float] = None,
                 phases: Optional[dict[str, Optional[float]]] = None) -> None:
        self.progress, self.beats, self.log = progress, beats, log
        self.pending, self.failed_at = pending, failed_at  # the restart line, said at the first step
        self.phases = phases  # this restart's phases so far; the first step's is added here
        self.started = time.monotonic()  # the generation's torchrun starts now
        self.to_first_step: Optional[float] = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="restart-steps", daemon=True)
        self.thread.start()

    def moved(self) -> bool:
        """True when a rank of this host made a step in this generation (a beat, or a sampled step)."""
        return self.progress.steps > 0

    def watched(self) -> bool:
        """True when a rank of this host was heard by a beat or the sampler: its lack of steps is evidence."""
        with self.progress.lock:
            return bool(self.progress.beating)

    def _loop(self) -> None:
        while not self.done.is_set():
            if self.beats is not None:
                try:
                    ready, _, _ = select.select([self.beats], [], [], 0.1)
                except (OSError, ValueError):
                    ready = []
                if ready:
                    self.beats.drain(self.progress)
            else:
                self.done.wait(0.1)
            self._said()

    def _said(self) -> None:
        first = self.progress.first_step
        if not self.pending or first is None:
            return
        if self.failed_at is not None:
            self.to_first_step = round(max(0.0, first - self.failed_at), 3)
        if self.phases is not None:
            self.phases["first_step"] = round(max(0.0, first - self.started), 3)
        self.log(f"{self.pending}; first step {self.to_first_step:.1f} s after the failure"
                 f"{phases_text(self.phases)}")
        self.pending = ""

    def close(self) -> None:
        """Stop the thread; a restart line not said yet (no step came) is said now."""
        self.done.set()
        self.thread.join(timeout=5)
        if self.beats is not None:
            self.beats.drain(self.progress)
            self.beats.close()
        self._said()
        if self.pending:
            self.log(f"{self.pending}; no step in this generation{phases_text(self.phases)}")
            self.pending = ""


def phases(root: Optional[float], stopping: Optional[float], ended: float,
           decided: Optional[float]) -> dict[str, Optional[float]]:
    """A restart's phases on this host, in seconds, from monotonic times: ``detection`` (the root cause's
    failure to this host's stop: its own failure, or the job watch's order), ``stop`` (to the end of the
    generation here: every worker gone), ``barrier`` (to node 0's decision: every host's end), ``new_torchrun``
    (to the new torchrun's start: filled when it starts) and ``first_step`` (to its first step: filled by
    :class:`Steps`)."""
    def span(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return None if a is None or b is None else round(max(0.0, b - a), 3)

    return {"detection": span(root, stopping), "stop": span(stopping, ended), "barrier": span(ended, decided),
            "new_torchrun": None, "first_step": None}


def phases_text(values: Optional[dict[str, Optional[float]]]) -> str:
    """``; phases: detection 0.0 s, stop 1.2 s, ...`` (unknown ones as ``?``); empty without phases."""
    if not values:
        return ""
    said = ", ".join(f"{name.replace('_', ' ')} {'?' if values.get(name) is None else format(values[name], '.2f')} s"
                     for name in PHASES)
    return f"; phases: {said}"


def record(decision: Decision, seconds: Optional[float],
           spans: Optional[dict[str, Optional[float]]] = None) -> dict[str, Any]:
    """One restart as the outcome file lists it (``restarts``)."""
    cause = decision.cause
    return {"generation": decision.generation + 1, "class": cause.klass if cause else None,
            "exit_code": cause.code if cause else None,
            "root_cause": cause.head.split("\n", 1)[0][:1000] if cause else "",
            "root_cause_host": cause.host if cause else None, "seconds_to_first_step": seconds,
            "phases": spans if spans is not None else dict.fromkeys(PHASES)}


def restart_line(decision: Decision, budget: int) -> str:
    """The log line of a restart (its first-step time is added when it comes)."""
    cause = decision.cause
    head = cause.head.split("\n", 1)[0] if cause else "?"
    return (f"restart {decision.used} of {budget} (job-wide): generation {decision.generation + 1} starts on every "
            f"host; root cause of generation {decision.generation}: {head}")
