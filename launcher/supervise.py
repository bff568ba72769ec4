"""Start torchrun, stream its output, forward stop signals, and leave no process behind.

- torchrun runs in a session of its own, so a terminal's Ctrl-C reaches only the launcher, which
  decides what the job gets.
- SIGTERM, SIGINT and SIGHUP are forwarded to the workers themselves (torchrun's children). A
  worker that saves a checkpoint and exits 0 then ends the job cleanly, because torchrun sees its
  workers succeed; had torchrun been signalled, it would report a failure whatever they did.
- After the grace period the whole tree is killed. Once torchrun has exited, anything it left
  behind is killed too; the launcher is a child subreaper, so orphans come back to it.
- A forked :class:`~launcher.proctree.Watchdog` kills the tree if the launcher itself is killed.
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
STDERR_TAIL_LINE_BYTES = 2048
PUMP_CHUNK = 65536
PUMP_GATHER = 0.001  # seconds to wait after a short read


class Outcome(NamedTuple):
    """How torchrun ended, as the launcher saw it."""

    returncode: int  # torchrun's; negative: killed by that signal
    pid: int
    stop_signal: Optional[int] = None  # the first stop signal the launcher received
    killed_after_grace: bool = False
    stderr_tail: Sequence[str] = ()


class StderrTail:
    """The last ``lines`` lines of a byte stream, each cut to ``line_bytes``: bounded whatever is fed."""

    def __init__(self, lines: int = STDERR_TAIL_LINES, line_bytes: int = STDERR_TAIL_LINE_BYTES) -> None:
        self.line_bytes = line_bytes
        self.done: collections.deque[bytes] = collections.deque(maxlen=lines)
        self.partial = b""  # the line still being received, already cut

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the stream (at most a chunk: splitting it is bounded by its size)."""
        cap = self.line_bytes
        parts = data.split(b"\n")
        if len(parts) > 1:
            self.done.append((self.partial + parts[0][:cap])[:cap])
            self.done.extend(part[:cap] for part in parts[1:-1][-(self.done.maxlen or 1):])
            self.partial = b""
        self.partial = (self.partial + parts[-1][:cap])[:cap]

    def lines(self) -> list[str]:
        """The kept lines, decoded (bad bytes replaced), the unfinished last one included."""
        kept = list(self.done) + ([self.partial] if self.partial else [])
        return [line.decode("utf-8", "replace") for line in kept[-(self.done.maxlen or 1):]]


def _pump(source: IO[bytes], sink: Optional[IO[bytes]], tail: Optional[StderrTail]) -> None:
    """Copy bytes unmodified as they come, in bounded chunks; feed the tail when asked.

    When the sink fails (our own stream closed or broken), keep reading: torchrun must never block
    on a full pipe.
    """
    fd = source.fileno()
    while True:
        chunk = os.read(fd, PUMP_CHUNK)
        if not chunk:
            break
        if sink is not None:
            try:
                sink.write(chunk)
                sink.flush()
            except (OSError, ValueError):
                sink = None
        if tail is not None:
            tail.feed(chunk)
        if len(chunk) < PUMP_CHUNK // 4:
            time.sleep(PUMP_GATHER)  # let a trickle of lines gather: a read and a write per line costs CPU
    source.close()


class _StopSignals:
    """Signal handler: remembers the first stop signal and its deadline, forwards each to the workers."""

    def __init__(self, grace_period: float, log: Callable[[str], None]) -> None:
        self.grace_period = grace_period
        self.log = log
        self.signal: Optional[int] = None
        self.deadline: Optional[float] = None
        self.proc: Optional[subprocess.Popen] = None

    def __call__(self, signum: int, _frame: object = None) -> None:
        if self.signal is None:
            self.signal = signum
            self.deadline = time.monotonic() + self.grace_period
            self.log(f"received {signal.Signals(signum).name}: forwarding it to the workers; "
                     f"killing everything left after {self.grace_period:g} s")
        if self.proc is not None and self.proc.poll() is None:
            for pid in proctree.children_of(self.proc.pid) or [self.proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)


def supervise(launch: Launch, environ: Mapping[str, str], grace_period: float,
              log: Callable[[str], None]) -> Outcome:
    """Run the launch to its end and return how it ended. Blocks; installs signal handlers."""
    os.makedirs(launch.log_dir, exist_ok=True)
    proctree.become_subreaper()
    watchdog = proctree.Watchdog()
    stop = _StopSignals(grace_period, log)
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    tail = StderrTail()
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
        killed = False
        while True:
            deadline = stop.deadline
            try:
                timeout = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                returncode = proc.wait(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline and not killed:
                    log(f"grace period of {grace_period:g} s is over: killing the job's processes")
                    proctree.kill_tree([proc.pid])
                    killed = True
        leftovers = proctree.kill_tree([os.getpid()], include_roots=False, exclude=[watchdog.pid])
        if leftovers:
            log(f"killed {leftovers} process(es) torchrun left behind")
        for pump in pumps:
            pump.join(timeout=5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        watchdog.release()
        proctree.reap_children()
    return Outcome(returncode=returncode, pid=proc.pid, stop_signal=stop.signal, killed_after_grace=killed,
                   stderr_tail=tail.lines())
