"""Job-wide restarts in place: one generation of workers after another, on the same hosts.

A *generation* is one torchrun per host with the same world (generation 0 is the first start). With
``--max-restarts N`` (N >= 1) a failure anywhere ends the generation on every host, and node 0 decides
for all (:func:`Policy.decide`, carried by the job watch, :mod:`launcher.jobwatch`): restart, or end the
job. The rules, in order:

1. a lost host: never restarted (the platform cannot hand the job a new host): the job ends, 137;
2. every host succeeded: the job is done;
3. a stop signal from the platform on any host: never restarted;
4. the root cause's class (the first primary failure, as the verdict picks it) is not in
   ``--restart-on`` (default :data:`launcher.options.DEFAULT_RESTART_ON`): the job ends with it;
5. the budget (``--max-restarts``, job-wide) is used up: the job ends with the last failure's code;
6. *no progress*: a restarted generation failed with the same root cause as the generation before it
   (:func:`root_key`: the exception's type and the script's ``file:line``, or the signal, or ``hang``)
   and no rank of it made progress: the job ends with class ``no_progress``, exit code 93, which retry
   policies do not retry;
7. else every host starts the next generation.

Progress is a progress beat from any rank of the generation, on any host: ``train_scripts/ddp_utils.py``
beats at every step and while it writes a checkpoint; any script can beat (:mod:`launcher.progress`).
A script that never beats never shows progress: a repeated failure of it is stopped after one restart.

Bad input (exit 2 before anything starts) and the launcher's own error (70) never reach this module.
"""

from __future__ import annotations

import re
import select
import threading
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional

from launcher import codes
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
    primary: bool  # False: its workers were stopped because another host failed
    progress: bool  # a rank of this host beat during the generation
    stopped: bool = False  # a stop signal from the platform ended it

    def message(self) -> dict:
        """As the job watch carries it."""
        return self._asdict()


def end_of(message: dict) -> End:
    """An ``End`` from a job watch message; raises (KeyError, TypeError, ValueError) on a malformed one."""
    return End(int(message["node"]), str(message["host"])[:100], int(message["code"]), str(message["klass"])[:40],
               str(message["key"])[:300], str(message["head"])[:600], bool(message["primary"]),
               bool(message["progress"]), bool(message["stopped"]))


class Decision(NamedTuple):
    """Node 0's decision at the end of a generation, the same on every host."""

    generation: int  # the generation that ended
    restart: bool
    why: str  # restart, success, lost, stopped, class, budget, no_progress, no_decision
    used: int  # restarts used so far, this one included
    cause: Optional[End] = None

    def message(self) -> dict:
        """As the job watch carries it."""
        return {"generation": self.generation, "restart": self.restart, "why": self.why, "used": self.used,
                "cause": None if self.cause is None else self.cause.message()}

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
                            f"progress (no step beat from any rank) since the restart: {what}"),
            "no_decision": "node 0 decided nothing in time: no restart",
        }.get(self.why, "")


def decision_of(message: dict) -> Decision:
    """A ``Decision`` from a job watch message; raises on a malformed one."""
    cause = message.get("cause")
    return Decision(int(message["generation"]), bool(message["restart"]), str(message["why"])[:20],
                    int(message["used"]), None if cause is None else end_of(cause))


class Policy:
    """Node 0's (or a single node's) rules: the budget, the classes restarted, the last root cause."""

    def __init__(self, budget: int, restart_on: Sequence[str]) -> None:
        self.budget, self.restart_on = budget, frozenset(restart_on)
        self.used = 0
        self.previous: Optional[str] = None  # the root key of the generation before

    def decide(self, generation: int, ends: Sequence[End], lost: bool = False) -> Decision:
        """The decision at the end of ``generation``, from every host's end (see the module's rules)."""
        failing = [e for e in ends if e.code != 0]
        cause = next((e for e in failing if e.primary), failing[0] if failing else None)
        why = ("lost" if lost else "success" if cause is None else
               "stopped" if any(e.stopped for e in ends) else
               "class" if cause.klass not in self.restart_on else
               "budget" if self.used >= self.budget else
               "no_progress" if generation > 0 and cause.key == self.previous and not any(e.progress for e in ends)
               else "restart")
        if why == "restart":
            self.used += 1
        if cause is not None:
            self.previous = cause.key
        return Decision(generation, why == "restart", why, self.used, cause)


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


class Steps:
    """A generation's progress on this host: beats (from hang detection's :class:`Progress`, else from a
    beat socket of its own, drained by a thread), and the restart's one log line at its first step."""

    def __init__(self, progress: Progress, beats: Optional[BeatSocket], log: Callable[[str], None],
                 pending: str = "", failed_at: Optional[float] = None) -> None:
        self.progress, self.beats, self.log = progress, beats, log
        self.pending, self.failed_at = pending, failed_at  # the restart line, said at the first step
        self.to_first_step: Optional[float] = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="restart-steps", daemon=True)
        self.thread.start()

    def moved(self) -> bool:
        """True when a rank of this host beat in this generation."""
        return self.progress.beats > 0

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
        first = self.progress.first_beat
        if not self.pending or first is None:
            return
        if self.failed_at is not None:
            self.to_first_step = round(max(0.0, first - self.failed_at), 3)
        self.log(f"{self.pending}; first step {self.to_first_step:.1f} s after the failure")
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
            self.log(f"{self.pending}; no step in this generation")
            self.pending = ""


def record(decision: Decision, seconds: Optional[float]) -> dict[str, Any]:
    """One restart as the outcome file lists it (``restarts``)."""
    cause = decision.cause
    return {"generation": decision.generation + 1, "class": cause.klass if cause else None,
            "exit_code": cause.code if cause else None,
            "root_cause": cause.head.split("\n", 1)[0][:1000] if cause else "",
            "root_cause_host": cause.host if cause else None, "seconds_to_first_step": seconds}


def restart_line(decision: Decision, budget: int) -> str:
    """The log line of a restart (its first-step time is added when it comes)."""
    cause = decision.cause
    head = cause.head.split("\n", 1)[0] if cause else "?"
    return (f"restart {decision.used} of {budget} (job-wide): generation {decision.generation + 1} starts on every "
            f"host; root cause of generation {decision.generation}: {head}")
