"""Start torchrun, stream its output, forward stop signals, and leave no process behind.

- torchrun runs in a session of its own, so a terminal's Ctrl-C reaches only the launcher, which
  decides what the job gets.
- SIGUSR1 and SIGUSR2 are forwarded to the workers and stop nothing (SLURM's ``--signal=USR1@60``);
  torchrun and the workers start with them ignored, so only a worker that handles them sees them.
- SIGTERM, SIGINT and SIGHUP are forwarded to the workers themselves (torchrun's children). A
  worker that saves a checkpoint and exits 0 then ends the job cleanly, because torchrun sees its
  workers succeed; had torchrun been signalled, it would report a failure whatever they did.
- torchrun never restarts workers by itself (``--max-restarts 0``): restarts are job-wide, the
  launcher's (:mod:`launcher.generations`), and a stop signal is never restarted.
- After the grace period the whole tree is killed. Once torchrun has exited, anything it left
  behind is killed too; the launcher is a child subreaper, so orphans come back to it, and their
  zombies are collected while the job runs.
- The job watch (:mod:`launcher.jobwatch`) may ask for a stop when another host failed: the same
  path as SIGTERM, with a shorter grace period.
- ``direct``: the launch is the script itself, not torchrun (a host outside the training world,
  :mod:`launcher.groups`): the signals go to it, and it is its own worker.
- The workers' output: torchrun writes it to files (``--redirects``) under ``$TMPDIR``, which the launcher
  copies to its own streams with each line's rank (:class:`~launcher.workerlogs.LogCopier`) and keeps small
  on disk while it runs (:class:`~launcher.logspace.LogTrimmer`).
- A :class:`~launcher.proctree.Watchdog` kills the tree (and everything with the job's marker) if
  the launcher itself is killed.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Callable, Optional, Protocol

from launcher import proctree
from launcher.command import Launch
from launcher.deaths import Deaths
from launcher.logspace import LogTrimmer
from launcher.outcome import Outcome
from launcher.workerlogs import LogCopier

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Signals that ask the workers for something without stopping the job (SLURM's --signal=USR1@60: "the
# time limit is near, checkpoint"). torchrun handles neither, and their default action would kill it,
# so torchrun and the workers start with them ignored; a worker that installs a handler gets them.
FORWARD_ONLY = (signal.SIGUSR1, signal.SIGUSR2)
STDERR_TAIL_LINES = 400
STDERR_TAIL_LINE_BYTES = 2048
PUMP_CHUNK = 65536
PUMP_GATHER = 0.001  # seconds to wait after a short read
# Seconds the pumps get to copy what torchrun's tree wrote once the tree is gone. They end at once (end of
# file) unless starved of CPU or a process outside the tree holds a pipe; after this their output is dropped,
# so that the report stays stderr's last lines.
PUMP_DRAIN = 30.0
TICK = 0.5
HELD = "once their stacks are taken (a hang is being reported)"  # a stop held meanwhile (_StopSignals.hold)
TABLE_WAIT = 1.0  # seconds a stopped torchrun whose worker died before the stop gets to print its failure table


class JobWatch(Protocol):
    """What supervise needs of the job watch: to hand it the stop hook, and take it back (None)."""

    def attach(self, request: Optional[Callable[[float, str], None]]) -> None: ...


class HangHook(Protocol):
    """What supervise needs of hang detection (:mod:`launcher.hangwatch`): the output, the stop hook."""

    def feed(self, chunk: bytes, stderr: bool = False) -> None: ...

    def attach(self, request: Optional[Callable[[float, str], None]], pid: Optional[int] = None,
               hold: Optional[Callable[[Optional[float]], None]] = None) -> None: ...


class Beside(Protocol):
    """What runs beside the generation (:class:`launcher.ahead.Next`: the next one, started ahead): looked at
    while torchrun runs, on the main thread, and spared when the generation's processes are ended."""

    def look(self) -> None: ...

    def pids(self) -> tuple[int, ...]: ...


class Context(Protocol):
    """What supervise needs of the run (:class:`launcher.runcontext.Run`): the environment, the log, the watchdog,
    the job watch and hang detection (None: off), the grace period, whether the launch is the script itself
    (``direct``: a host outside the training world, :mod:`launcher.groups`) and the rendezvous bound."""

    @property
    def environ(self) -> Mapping[str, str]: ...

    @property
    def log(self) -> Callable[[str], None]: ...

    @property
    def watchdog(self) -> proctree.Watchdog: ...

    @property
    def watch(self) -> Optional[JobWatch]: ...

    @property
    def hangs(self) -> Optional[HangHook]: ...

    @property
    def grace_period(self) -> float: ...

    @property
    def direct(self) -> bool: ...

    @property
    def rendezvous_bound(self) -> Optional[float]: ...


class StderrTail:
    """The last ``lines`` lines of a byte stream, each cut to ``line_bytes``: bounded whatever is fed."""

    def __init__(self, lines: int = STDERR_TAIL_LINES, line_bytes: int = STDERR_TAIL_LINE_BYTES) -> None:
        self.line_bytes = line_bytes
        self.done: collections.deque[bytes] = collections.deque(maxlen=lines)
        self.partial = b""  # the line still being received, already cut
        self.lock = threading.Lock()  # fed by one thread, read by another

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the stream (at most a chunk: splitting it is bounded by its size)."""
        cap = self.line_bytes
        parts = data.split(b"\n")
        with self.lock:
            if len(parts) > 1:
                self.done.append((self.partial + parts[0][:cap])[:cap])
                self.done.extend(part[:cap] for part in parts[1:-1][-(self.done.maxlen or 1):])
                self.partial = b""
            self.partial = (self.partial + parts[-1][:cap])[:cap]

    def lines(self) -> list[str]:
        """The kept lines, decoded (bad bytes replaced), the unfinished last one included."""
        with self.lock:
            kept = list(self.done) + ([self.partial] if self.partial else [])
        return [line.decode("utf-8", "replace") for line in kept[-(self.done.maxlen or 1):]]


class Sink:
    """One of our standard streams as the pumps' destination, until :meth:`close`: from then on what they
    copy is dropped, so nothing of the job's output can follow the report.

    Each write is flushed under a lock that :meth:`close` takes too: a write under way when the job's end
    is reported finishes first, and none starts after it. A stream that fails (closed, or a dead pipe)
    is dropped the same way: the pumps go on reading, so torchrun never blocks on a full pipe.
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream: Optional[IO[bytes]] = stream
        self._lock = threading.Lock()
        self.dropped = 0  # bytes that came after close (or after the stream failed)

    def write(self, chunk: bytes) -> None:
        """Copy ``chunk`` to the stream and flush it; drop it once closed."""
        with self._lock:
            if self._stream is None:
                self.dropped += len(chunk)
                return
            try:
                self._stream.write(chunk)
                self._stream.flush()
            except (OSError, ValueError):
                self._stream = None

    def flush(self) -> None:
        """Nothing to do: each write is flushed."""

    def close(self) -> None:
        """Write nothing more (after a write under way has finished). The stream itself stays open."""
        with self._lock:
            self._stream = None


def _deliver(sink: Sink, tail: Optional[StderrTail], feed: Optional[Callable[[bytes], None]], chunk: bytes) -> None:
    """Hand the workers' lines (:class:`~launcher.workerlogs.LogCopier`) on as :func:`_pump` does torchrun's."""
    sink.write(chunk)
    if tail is not None:
        tail.feed(chunk)
    if feed is not None:
        feed(chunk)


def _pump(source: IO[bytes], sink: Optional[IO[bytes]], tail: Optional[StderrTail],
          feed: Optional[Callable[[bytes], None]] = None, fed: Optional[Callable[[], None]] = None) -> None:
    """Copy bytes unmodified as they come, in bounded chunks; feed the tail and ``feed`` when asked, then call
    ``fed`` (torchrun's failure table may have ended: the supervisor looks at once).

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
        if feed is not None:
            feed(chunk)
        if fed is not None:
            fed()
        if len(chunk) < PUMP_CHUNK // 4:
            time.sleep(PUMP_GATHER)  # let a trickle of lines gather: a read and a write per line costs CPU
    source.close()


class _Wake:
    """A pipe that wakes the supervisor's wait before its tick; pokes from any thread (never blocks, never fails)."""

    def __init__(self) -> None:
        self.read, self.write = os.pipe()
        os.set_blocking(self.read, False)
        os.set_blocking(self.write, False)
        self.lock = threading.Lock()  # a late poke (a pump still draining) never writes to a reused number
        self.closed = False

    def poke(self) -> None:
        if not self.lock.acquire(blocking=False):  # a poke from a signal handler while another thread pokes
            return
        try:
            if not self.closed:
                with contextlib.suppress(OSError):  # full: a wake is pending anyway
                    os.write(self.write, b"x")
        finally:
            self.lock.release()

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self.read, 4096):
                pass

    def close(self) -> None:
        with self.lock:
            self.closed = True
            os.close(self.write)
            os.close(self.read)


class _StopSignals:
    """Signal handler: remembers the first stop signal and its deadline, forwards each to the workers.

    Never raises: logging cannot fail.
    """

    def __init__(self, grace_period: float, log: Callable[[str], None], direct: bool = False) -> None:
        self.direct = direct  # the process is the script itself: it gets the signals
        self.grace_period = grace_period
        self.log = log
        self.signal: Optional[int] = None
        self.at: Optional[float] = None  # time.time() when the first stop was passed on to the workers
        self.since = 0.0  # the same moment, monotonic
        self.deadline: Optional[float] = None
        self.proc: Optional[subprocess.Popen] = None
        self.deadline_grace = grace_period  # the grace period the deadline was set with
        self.requested = False  # a stop the launcher decided (request): no need to wait for torchrun's shutdown
        self.lock = threading.RLock()  # the signal handler (main thread) and request (the job watch's)
        self.wake: Optional[Callable[[], None]] = None  # the supervisor's wait looks again at once
        self.held_until: Optional[float] = None  # monotonic: the workers' stacks are being taken (hold)
        self.owed: list[int] = []  # the signals that came meanwhile, passed on at the hold's end

    def __call__(self, signum: int, _frame: object = None) -> None:
        with self.lock:
            self._forward(signum)

    def request(self, grace_period: float, why: str) -> bool:
        """A stop the launcher itself decided (the job watch: another host failed): SIGTERM to the
        workers, everything killed after ``grace_period`` (at most the configured one). Any thread.
        Whether this request stopped them: False when torchrun had ended or a stop was in force already.

        The workers get the signal once: a later request (each other host's end reaches the job watch as
        an event of its own) only brings the deadline closer. A second SIGTERM would run a script's handler
        again inside the first one, in the middle of the checkpoint it is saving."""
        with self.lock:
            if self.proc is not None and self.proc.poll() is not None:
                return False  # torchrun has ended: nothing to stop, and its outcome is its own
            deadline = time.monotonic() + min(grace_period, self.grace_period)
            if self.proc is not None and not self.direct and not proctree.children_of(self.proc.pid):
                deadline = time.monotonic()  # no worker left: only torchrun's own shutdown would be waited for
            self.requested = True
            if self.signal is not None:  # the workers have it already (or get it as torchrun starts)
                if self.deadline is not None:
                    self.deadline = min(self.deadline, deadline)
                return False
            self.log(why + (f"; the signal reaches them {HELD}" if self.held_until is not None else ""))
            self.signal, self.deadline = signal.SIGTERM, deadline
            self.deadline_grace = min(grace_period, self.grace_period)
            self._forward(self.signal)
            return True

    def hold(self, seconds: Optional[float]) -> None:
        """Hang detection takes the workers' stacks: for at most ``seconds`` (None: no longer), a stop that comes
        is decided at once (its deadline counts from its arrival) but its signal reaches the workers only at the
        hold's end. Delivered beside the stack signal, a SIGTERM ended a worker in the middle of its dump (its
        default action ends the process from any thread while the main thread writes). Any thread."""
        with self.lock:
            if seconds is not None:
                self.held_until = time.monotonic() + seconds
                return
            self.held_until = None
            owed, self.owed = self.owed, []
            for signum in owed:
                self._send(signum)

    def overdue(self) -> None:
        """A hold past its bound ends here (the supervisor's wait looks at each tick)."""
        with self.lock:
            if self.held_until is not None and time.monotonic() >= self.held_until:
                if self.owed:
                    self.log("the workers' stacks were not taken within the hold: passing the stop on now")
                self.hold(None)

    def relay(self, signum: int, _frame: object = None) -> None:
        """Signal handler for :data:`FORWARD_ONLY`: pass the signal to the workers; no stop, no deadline."""
        if self.proc is None or self.proc.poll() is not None:
            return
        workers = [self.proc.pid] if self.direct else proctree.children_of(self.proc.pid)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        self.log(f"received {signal.Signals(signum).name}: forwarded it to {len(workers)} worker(s)")

    def _forward(self, signum: int) -> None:
        if self.wake is not None:  # the wait looks at the new deadline, and at the workers, at once
            self.wake()
        if self.at is None:
            self.at, self.since = time.time(), time.monotonic()
        held = self.held_until is not None
        if self.signal is None:
            self.signal = signum
            self.deadline = time.monotonic() + self.grace_period
            self.log(f"received {signal.Signals(signum).name}: forwarding it to the workers"
                     f"{f' {HELD}' if held else ''}; killing everything left after {self.grace_period:g} s")
        if held:
            self.owed.append(signum)
            return
        self._send(signum)

    def _send(self, signum: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        targets = [self.proc.pid] if self.direct else (proctree.children_of(self.proc.pid) or [self.proc.pid])
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def start_torchrun(argv: Sequence[str], env: Mapping[str, str], stdin: int = subprocess.DEVNULL) -> subprocess.Popen:
    """Start torchrun (or what stands for it: :mod:`launcher.ahead`) as the launcher starts it: its output on
    pipes, its own session, the signals the launcher only forwards (:data:`FORWARD_ONLY`) ignored, and SIGKILL
    to it if the launcher dies (even by SIGKILL), set in the child before exec; its workers then get SIGTERM,
    their own parent-death signal (launcher/bootstrap.py). Not SIGTERM to torchrun: the kernel sends it once per
    launcher thread that torchrun is handed to as the threads die, and a second one inside torch's shutdown left
    torchrun (with --tee) waiting for ever on its log tailers."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in FORWARD_ONLY}  # inherited by torchrun
    try:
        return subprocess.Popen(list(argv), env=dict(env), stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=proctree.parent_death_signal(signal.SIGKILL))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def supervise(run: Context, launch: Launch, quick_end: bool = False,
              started: Optional[subprocess.Popen] = None, beside: Optional[Beside] = None) -> Outcome:
    """Run the launch (the plan's, or a generation's) to its end and return how it ended. Blocks; installs
    signal handlers.

    The run's watchdog (forked before this is called) is told to guard torchrun's tree. Its job watch
    (:mod:`launcher.jobwatch`) gets the stop hook while torchrun runs. If no worker has started by the run's
    rendezvous bound (a master port held by another program leaves torchrun's store client waiting for ever),
    torchrun is killed and the outcome says so. Its hang detection sees every output chunk and gets the stop
    hook and torchrun's pid. ``quick_end`` (restarts: every second counts): once torchrun has printed its
    failure table and has no worker left, it is killed instead of waited for through its interpreter's
    teardown (seconds on a loaded host). ``started``: torchrun already started for this launch, as this
    function starts it (:mod:`launcher.ahead`: it met the other hosts and its workers imported torch while the
    hosts stopped, held before the script until now). ``beside``: looked at while torchrun runs (no stop asked),
    its processes and their descendants spared when this generation's are ended.
    """
    environ, log, watchdog, watch, hangs = run.environ, run.log, run.watchdog, run.watch, run.hangs
    direct, rendezvous_timeout = run.direct, run.rendezvous_bound
    os.makedirs(launch.log_dir, exist_ok=True)
    proctree.become_subreaper()
    stop = _StopSignals(run.grace_period, log, direct=direct)
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    previous.update({sig: signal.signal(sig, signal.SIG_IGN) for sig in FORWARD_ONLY})  # inherited by torchrun
    if watch is not None:
        watch.attach(stop.request)
    tail = StderrTail()  # torchrun's own stderr: its failure table ends it
    worker_tail = StderrTail()  # the workers' stderr lines, as copied (they came before torchrun's table)
    sinks = (Sink(sys.stdout.buffer), Sink(sys.stderr.buffer))
    deaths: Optional[Deaths] = None
    wake = _Wake()  # what the wait below looks at sooner than its tick: a death, a stop, torchrun's table
    stop.wake = wake.poke
    try:
        proc = started or start_torchrun(launch.argv, launch.environment(environ))
        stop.proc = proc
        for sig in FORWARD_ONLY:
            signal.signal(sig, stop.relay)
        watchdog.guard(proc.pid)
        deaths = None if direct else Deaths(proc.pid, launch.nproc_per_node, wake.poke)
        ahead = (" (started ahead: its workers, held before the script, had imported torch)"
                 if started is not None else "")
        log(f"{'the script' if direct else 'torchrun'} started as pid {proc.pid}{ahead}")
        if stop.signal is not None:  # arrived while starting
            stop(stop.signal)
        feeds = (None, None) if hangs is None else (hangs.feed, functools.partial(hangs.feed, stderr=True))
        copier = trimmer = None
        if not direct:  # the workers' output, from their log files, and the disk those take
            writes = (functools.partial(_deliver, sinks[0], None, feeds[0]),
                      functools.partial(_deliver, sinks[1], worker_tail, feeds[1]))
            copier = LogCopier(launch.log_dir, proc.pid, launch.first_rank, 2 * launch.nproc_per_node, writes, log)
            trimmer = LogTrimmer(proc.pid, launch.log_dir, log, copier.positions, copier.copying,
                                 lambda: stop.signal is not None)
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, sinks[0], None, feeds[0]), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr, sinks[1], tail, feeds[1], wake.poke),
                                  daemon=True)]
        if hangs is not None:
            hangs.attach(stop.request, proc.pid, stop.hold)
        for pump in pumps:
            pump.start()
        rendezvous_by = None if rendezvous_timeout is None else time.monotonic() + rendezvous_timeout
        reported = functools.partial(failure_reported, tail) if quick_end and not direct else None
        # a stop after a worker's own death: torchrun may still print its table (its next look), wait for it briefly
        settled = (None if direct or deaths is None else
                   lambda: failure_reported(tail) or not any(d.at < (stop.at or 0.0) for d in deaths.ended().values()))
        helpers = (watchdog.pid, *(() if deaths is None else deaths.pids()))  # the launcher's own

        def spared() -> tuple[int, ...]:
            return helpers if beside is None else (*helpers, *beside.pids())

        returncode, after_grace, no_rendezvous = _wait(proc, stop, log, watchdog, rendezvous_by, reported, wake,
                                                       settled, spared, None if beside is None else beside.look)
        if trimmer is not None:
            trimmer.stop()
        leftovers = proctree.kill_tree([os.getpid()], include_roots=False, exclude=spared())
        if leftovers:
            log(f"killed {leftovers} process(es) torchrun left behind")
        copied = copier is None or copier.stop(PUMP_DRAIN)  # the workers' last lines, at once
        for pump in pumps:  # at once, unless starved of CPU or a process outside the tree holds a pipe
            pump.join(timeout=PUMP_DRAIN)
        late = [pump for pump in pumps if pump.is_alive()]
        if late or not copied:
            log(f"the job's output still open {PUMP_DRAIN:g} s after its end: the rest is not shown")
    finally:
        for sink in sinks:  # whatever the pumps copy from now on would come after the report
            sink.close()
        if watch is not None:
            watch.attach(None)
        if hangs is not None:
            hangs.attach(None)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ended = {} if deaths is None else deaths.stop()
        proctree.reap_orphans([watchdog.pid])
        stop.wake = None
        wake.close()
    return Outcome(returncode=returncode, pid=proc.pid, stop_signal=stop.signal, killed_after_grace=after_grace,
                   stderr_tail=worker_tail.lines() + tail.lines(), no_rendezvous=no_rendezvous, deaths=ended,
                   stopped_at=stop.at)


def failure_reported(tail: StderrTail) -> bool:
    """True once torchrun's stderr holds the end of its failure table (``Root Cause ...`` then a ``===`` rule):
    all it does after that is its interpreter's teardown."""
    lines = tail.lines()
    last = max((i for i, line in enumerate(lines) if line.startswith("Root Cause (first observed failure)")),
               default=None)
    return last is not None and any(line.startswith("=====") for line in lines[last + 1:])


def _wait(proc: subprocess.Popen, stop: _StopSignals, log: Callable[[str], None],
          watchdog: proctree.Watchdog, rendezvous_by: Optional[float] = None,
          reported: Optional[Callable[[], bool]] = None, wake: Optional[_Wake] = None,
          settled: Optional[Callable[[], bool]] = None, spared: Callable[[], tuple[int, ...]] = tuple,
          look: Optional[Callable[[], None]] = None) -> tuple[int, bool, bool]:
    """Wait for torchrun; reap orphans but ``spared()`` (the living ones go to the watchdog), settle a frozen
    torchrun, enforce the grace period and the rendezvous deadline, call ``look`` at each look while no stop is
    asked. Woken early by ``wake`` (a death, a stop, torchrun's output). A stopped torchrun with no worker left is
    killed at once, unless ``settled`` says it still owes its failure table (a worker died before the stop): then
    it gets :data:`TABLE_WAIT` s to print it.

    Returns torchrun's return code, whether the grace period ran out, and whether no worker had
    started by ``rendezvous_by`` (torchrun then killed).
    """
    killed = after_grace = no_rendezvous = False
    while True:
        deadline = stop.deadline
        timeout = TICK if deadline is None else max(0.0, min(TICK, deadline - time.monotonic()))
        returncode = proctree.wait_exit(proc, timeout, None if wake is None else wake.read)
        if wake is not None:
            wake.drain()
        if returncode is not None:
            return returncode, after_grace, no_rendezvous
        proctree.reap_orphans([proc.pid, watchdog.pid, *spared()], watchdog)
        stop.overdue()
        if killed:
            continue
        if look is not None and not stop.requested and stop.signal is None:
            look()
        if rendezvous_by is not None and stop.signal is None and time.monotonic() >= rendezvous_by:
            rendezvous_by = None  # checked once: after it, workers exist and torchrun's own timeouts rule
            if not proctree.children_of(proc.pid):
                log("no worker started within the rendezvous timeout: killing torchrun")
                proctree.kill_tree([proc.pid])
                killed = no_rendezvous = True
                continue
        if reported is not None and stop.signal is None and reported() and not proctree.children_of(proc.pid):
            log("torchrun reported its workers' failure: killing it (its teardown would only delay the restart)")
            proctree.kill_tree([proc.pid])
            killed = True
            continue
        if stop.requested and not stop.direct and not proctree.children_of(proc.pid):
            if settled is not None and not settled() and time.monotonic() < stop.since + TABLE_WAIT:
                time.sleep(0.02)  # a worker died before the stop: torchrun's table, with its code, is on its way
                continue
            log("the workers have ended: killing torchrun (its own shutdown would only delay the end)")
            proctree.kill_tree([proc.pid])
            killed = True
            continue
        if not killed and deadline is not None and time.monotonic() >= deadline:
            log(f"grace period of {stop.deadline_grace:g} s is over: killing the job's processes")
            proctree.kill_tree([proc.pid])
            killed = after_grace = True
