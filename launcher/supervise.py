"""Start torchrun, stream its output, forward stop signals, and leave no process behind.

- torchrun runs in a session of its own, so a terminal's Ctrl-C reaches only the launcher, which
  decides what the job gets.
- SIGTERM, SIGINT and SIGHUP are forwarded to the workers themselves (torchrun's children). A
  worker that saves a checkpoint and exits 0 then ends the job cleanly, because torchrun sees its
  workers succeed; had torchrun been signalled, it would report a failure whatever they did.
- With restarts (``--max-restarts`` >= 1) torchrun would take workers ending on a stop signal as a
  failure and start new ones. So at the first stop signal torchrun is frozen (SIGSTOP) before the
  workers get it; their exit statuses are read from their zombies (torchrun cannot reap them). All
  0: torchrun is resumed and sees them succeed. Anything else: its tree is killed, the stop reported.
- After the grace period the whole tree is killed. Once torchrun has exited, anything it left
  behind is killed too; the launcher is a child subreaper, so orphans come back to it, and their
  zombies are collected while the job runs.
- A :class:`~launcher.proctree.Watchdog` kills the tree (and everything with the job's marker) if
  the launcher itself is killed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Callable, NamedTuple, Optional

from launcher import proctree
from launcher.command import Launch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STDERR_TAIL_LINES = 400
TICK = 0.5
STOPPING_TICK = 0.1  # while frozen torchrun's workers end


class Outcome(NamedTuple):
    """How torchrun ended, as the launcher saw it."""

    returncode: int  # torchrun's; negative: killed by that signal
    pid: int
    stop_signal: Optional[int] = None  # the first stop signal the launcher received
    killed_after_grace: bool = False
    stderr_tail: Sequence[str] = ()


def _pump(source: IO[bytes], sink: IO[bytes], tail: Optional[collections.deque[bytes]]) -> None:
    """Copy lines unmodified as they come; keep the last ones when asked."""
    for line in iter(source.readline, b""):
        try:
            sink.write(line)
            sink.flush()
        except (OSError, ValueError):
            pass  # our own output is gone (a dead pipe reader): keep draining torchrun's
        if tail is not None:
            tail.append(line)
    source.close()


class _StopSignals:
    """Signal handler: remembers the first stop signal and its deadline, forwards each to the workers.

    With ``freeze`` (torchrun may restart workers), torchrun is stopped at the first signal and the
    workers it had then are remembered in ``workers``. Never raises: logging cannot fail.
    """

    def __init__(self, grace_period: float, log: Callable[[str], None], freeze: bool) -> None:
        self.grace_period = grace_period
        self.log = log
        self.freeze = freeze
        self.signal: Optional[int] = None
        self.deadline: Optional[float] = None
        self.proc: Optional[subprocess.Popen] = None
        self.workers: Optional[list[int]] = None

    def __call__(self, signum: int, _frame: object = None) -> None:
        if self.signal is None:
            self.signal = signum
            self.deadline = time.monotonic() + self.grace_period
            self.log(f"received {signal.Signals(signum).name}: forwarding it to the workers; "
                     f"killing everything left after {self.grace_period:g} s")
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.freeze and self.workers is None:
            self.workers = _freeze(self.proc.pid)
        targets = proctree.children_of(self.proc.pid) or ([] if self.freeze else [self.proc.pid])
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def _freeze(pid: int, timeout: float = 2.0) -> list[int]:
    """SIGSTOP torchrun, wait until it is stopped; its children then (also exited, unreaped ones)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while proctree.state(pid) not in ("T", "t", "Z", None) and time.monotonic() < deadline:
        time.sleep(0.005)
    return proctree.children_of(pid, zombies=True)


def _workers_ended(workers: Sequence[int]) -> Optional[bool]:
    """None while a worker runs; else True if every one exited 0 (read from its zombie)."""
    statuses = [proctree.exit_status(pid) for pid in workers]
    if any(s is None and proctree.state(pid) is not None for s, pid in zip(statuses, workers)):
        return None
    return bool(workers) and all(s == 0 for s in statuses)


def supervise(launch: Launch, environ: Mapping[str, str], grace_period: float, log: Callable[[str], None],
              watchdog: proctree.Watchdog, max_restarts: int = 0) -> Outcome:
    """Run the launch to its end and return how it ended. Blocks; installs signal handlers.

    ``watchdog`` (forked before this is called) is told to guard torchrun's tree.
    """
    os.makedirs(launch.log_dir, exist_ok=True)
    proctree.become_subreaper()
    stop = _StopSignals(grace_period, log, freeze=max_restarts > 0)
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    tail: collections.deque[bytes] = collections.deque(maxlen=STDERR_TAIL_LINES)
    try:
        proc = subprocess.Popen(launch.argv, env=launch.environment(environ), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        stop.proc = proc
        watchdog.guard(proc.pid)
        log(f"torchrun started as pid {proc.pid}")
        if stop.signal is not None:  # arrived while starting
            stop(stop.signal)
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout.buffer, None), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr, sys.stderr.buffer, tail), daemon=True)]
        for pump in pumps:
            pump.start()
        returncode, after_grace = _wait(proc, stop, log, grace_period, keep=[proc.pid, watchdog.pid])
        leftovers = proctree.kill_tree([os.getpid()], include_roots=False, exclude=[watchdog.pid])
        if leftovers:
            log(f"killed {leftovers} process(es) torchrun left behind")
        for pump in pumps:
            pump.join(timeout=5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        proctree.reap_orphans([watchdog.pid])
    return Outcome(returncode=returncode, pid=proc.pid, stop_signal=stop.signal, killed_after_grace=after_grace,
                   stderr_tail=[line.decode("utf-8", "replace").rstrip("\n") for line in tail])


def _wait(proc: subprocess.Popen, stop: _StopSignals, log: Callable[[str], None], grace_period: float,
          keep: Sequence[int]) -> tuple[int, bool]:
    """Wait for torchrun; reap orphans, settle a frozen torchrun, enforce the grace period.

    Returns torchrun's return code and whether the grace period ran out.
    """
    killed = after_grace = resumed = False
    while True:
        deadline = stop.deadline
        tick = STOPPING_TICK if stop.workers is not None and not resumed else TICK
        try:
            timeout = tick if deadline is None else max(0.0, min(tick, deadline - time.monotonic()))
            return proc.wait(timeout=timeout), after_grace
        except subprocess.TimeoutExpired:
            pass
        proctree.reap_orphans(keep)
        if killed:
            continue
        if stop.workers is not None and not resumed:
            # Frozen, torchrun copies no worker output (--tee): what the workers print now shows late.
            clean = _workers_ended(stop.workers)
            if clean:
                os.kill(proc.pid, signal.SIGCONT)  # it sees its workers succeed and exits 0
                resumed = True
            elif clean is False:
                log("the workers did not all exit 0 after the stop signal: killing torchrun (no restart)")
                proctree.kill_tree([proc.pid])
                killed = True
        if not killed and deadline is not None and time.monotonic() >= deadline:
            log(f"grace period of {grace_period:g} s is over: killing the job's processes")
            proctree.kill_tree([proc.pid])
            killed = after_grace = True
