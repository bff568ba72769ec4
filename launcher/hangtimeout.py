"""Which hang timeout is in force, and why: the start's own bound, a fixed ``--hang-timeout``, or one learned
from the job's steps (the reasons for each number: docs/hangs.md); and the workers' variables hang detection
needs (:func:`worker_env`). Pure: the plan decides with it, :mod:`launcher.hangwatch` acts.

- **The start** lasts from the workers' start until the job's first step-like event (an explicit beat, a
  loop the progress sampler saw come round, a line of a rank that has neither). Until then a silence is
  judged against the start bound (``--hang-start-timeout``, default :data:`START`): imports, a checkpoint
  load, a compilation may hold one frame for minutes.
- **Fixed**: ``--hang-timeout N`` after the start (the start bound is then at least N). The start also ends
  once the workers have run N s, stepped or not (a loop whose steps the sampler never sees come round would
  otherwise keep the start's bound for ever); with ``--hang-start-timeout`` given, once they have run that long.
  ``0``: off.
- **Learned** (no ``--hang-timeout``): the longest gap between the job's step-like events, times
  :data:`MULTIPLE`, at least :data:`FLOOR`, at most the ceiling (:data:`CEILING_GPU` on hosts with GPUs:
  before NCCL's 600 s collective timeout; else :data:`CEILING_CPU`, gloo's 1800 s). The first
  :data:`SKIP` gaps are not learned from (a first step that compiles); the learned value is in force once
  :data:`WARMUP` gaps were seen; until then the start bound is. It only grows: a long phase seen once (an
  evaluation, a checkpoint save) stays covered. A silence that has not ended teaches nothing (a hang never
  raises its own timeout).

The silence judged is the job's silence of any progress (a moving main thread included); the gaps learned
from are those between step-like events, which are at least as long: the learned value errs on the long side.
:data:`FLOOR_ENV` lowers the floor for the tests only (a hang found in seconds, not minutes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Callable, Optional

from launcher.errors import ConfigError
from launcher.progress import BEAT_ENV, beat_address

FLOOR = 300.0  # HyperPod's 300 s without a step line; leaves NCCL's 600 s room for the stacks
MULTIPLE = 5.0  # NVRx's safety factor over the longest gap seen
WARMUP = 16  # gaps before the learned value is in force (NVRx/Megatron: 16 iterations)
SKIP = 2  # the first gaps (a compiling first step, a first evaluation) are not learned from
START = 540.0  # the start's bound: 9 minutes of one frame on every rank, a minute before NCCL's 600 s
CEILING_GPU = 540.0  # NCCL's collective timeout (600 s) less a minute for the freeze, the dumps, the report
CEILING_CPU = 1800.0  # gloo's collective timeout: a rank that waits longer fails anyway
FLOOR_ENV = "DDP_LAUNCHER_TEST_HANG_FLOOR"  # tests only: a lower floor (seconds), so a learned hang takes seconds
GROWTH_LOGGED = 1.25  # a learned value is logged again when it grew by this factor


class Policy:
    """The rule: ``fixed`` (``--hang-timeout``; None: learned), the start bound, floor and ceiling."""

    def __init__(self, fixed: Optional[float], start: float = START, floor: float = FLOOR,
                 ceiling: float = CEILING_CPU, start_given: bool = True) -> None:
        self.fixed, self.floor, self.ceiling = fixed, floor, max(floor, ceiling)
        self.start = max(start, fixed or 0.0)
        # with a fixed timeout, the start ends after this long running (N, unless a start bound was given)
        self.start_ends = self.start if start_given or fixed is None else fixed

    def describe(self) -> str:
        """One line for the dry run and the log: which timeout applies when, and why."""
        start = f"until the first step {self.start:g} s (--hang-start-timeout)"
        if self.fixed is not None:
            return (f"{self.fixed:g} s between progress events (--hang-timeout); {start}, or until the workers "
                    f"have run {self.start_ends:g} s")
        lowered = f" (lowered by {FLOOR_ENV}: tests only)" if self.floor != FLOOR else ""
        return (f"learned: {MULTIPLE:g} x the longest gap between steps, after {WARMUP} gaps (the first {SKIP} "
                f"not counted), at least {self.floor:g} s{lowered}, at most {self.ceiling:g} s; {start} and "
                "until the warm-up ends")


def policy(fixed: Optional[float], start: float, gpus: int, environ: Mapping[str, str]) -> Policy:
    """The policy for these options on this host; raises :class:`ConfigError` for a bad :data:`FLOOR_ENV`."""
    floor = FLOOR
    text = environ.get(FLOOR_ENV)
    if text is not None:
        try:
            floor = float(text)
        except ValueError:
            floor = -1.0
        if not 0 < floor <= FLOOR:  # also refuses nan and inf
            raise ConfigError(f"{FLOOR_ENV}={text!r}: a number of seconds above 0, at most {FLOOR:g}")
    return Policy(fixed, start, floor, CEILING_GPU if gpus else CEILING_CPU, start_given=start != START)


class Clock:
    """The timeout in force, from the job's step-like events (:meth:`observe`, once per judgement)."""

    def __init__(self, rule: Policy, log: Callable[[str], None] = lambda _line: None) -> None:
        self.rule, self.log = rule, log
        self.first_step: Optional[float] = None  # when the start ended (monotonic)
        self.last_step: Optional[float] = None
        self.gaps = 0  # step-to-step gaps seen
        self.longest = 0.0  # the longest gap learned from (after the first SKIP)
        self._logged = 0.0

    def observe(self, latest_step: Optional[float], running: float = 0.0) -> None:
        """The job's latest step-like event (monotonic; None: none yet): a later one closes a gap.
        ``running``: how long the workers have run; with a fixed timeout the start ends after its bound
        even without a step, once the workers have run :attr:`Policy.start_ends` s."""
        if self.first_step is None and self.rule.fixed is not None and running >= self.rule.start_ends:
            self.first_step = self.last_step = latest_step or 0.0
        if latest_step is None or (self.last_step is not None and latest_step <= self.last_step):
            return
        if self.last_step is None:
            self.first_step = latest_step
        else:
            self.gaps += 1
            if self.gaps > SKIP:
                self.longest = max(self.longest, latest_step - self.last_step)
        self.last_step = latest_step
        if self.rule.fixed is None and self.gaps >= WARMUP:
            value = self.timeout()[0]
            if value >= self._logged * GROWTH_LOGGED:
                self._logged = value
                self.log(f"hang timeout: {self.timeout()[1]}")

    def restart(self) -> None:
        """The workers ended (a restart may follow): the start again; what was learned stays."""
        self.first_step = self.last_step = None

    def timeout(self) -> tuple[float, str]:
        """The timeout in force now, and why (one phrase)."""
        rule = self.rule
        if self.first_step is None:
            return rule.start, f"{rule.start:g} s, the start's bound (no step yet)"
        if rule.fixed is not None:
            return rule.fixed, f"{rule.fixed:g} s (--hang-timeout)"
        if self.gaps < WARMUP:
            return rule.start, f"{rule.start:g} s, the start's bound (warm-up: {self.gaps} of {WARMUP} gaps)"
        learned = MULTIPLE * self.longest
        value = min(rule.ceiling, max(rule.floor, learned))
        why = f"{MULTIPLE:g} x the longest gap between steps, {self.longest:.1f} s, over {self.gaps} gaps"
        bound = " (the floor)" if value == rule.floor else " (the ceiling)" if value == rule.ceiling else ""
        return value, f"{value:.1f} s{bound}, learned: {why}"


NCCL_FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
NCCL_PIPE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"  # writing to <prefix><rank>.pipe makes that rank dump


def worker_env(environ: Mapping[str, str], run_dir: str, gpus: int = 0) -> tuple[dict[str, str], list[str]]:
    """The workers' variables for hang detection: where beats go, and faulthandler on (unless the user
    set ``PYTHONFAULTHANDLER``: then a note says stacks may not come). With GPUs, NCCL's Flight Recorder
    (:data:`NCCL_FLIGHT_RECORDER`): each rank keeps its last collectives and writes them out on a NCCL
    timeout, or when the launcher writes to its pipe at a hang; a variable the user set wins. Pure."""
    changes = {BEAT_ENV: beat_address(run_dir)}
    notes = []
    if "PYTHONFAULTHANDLER" in environ:
        if not environ["PYTHONFAULTHANDLER"]:
            notes.append("kept PYTHONFAULTHANDLER= (set by the user): a hang's stacks will be missing")
    else:
        changes["PYTHONFAULTHANDLER"] = "1"
    if gpus:
        tmp = environ.get("TMPDIR") or "/tmp"
        wanted = {**NCCL_FLIGHT_RECORDER, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(tmp, "nccl_trace_rank_"),
                  NCCL_PIPE_ENV: os.path.join(run_dir, "nccl_pipe_rank_")}
        changes.update({k: v for k, v in wanted.items() if k not in environ})
    return changes, notes
