"""When each of torchrun's workers ended, by the kernel's word: a pidfd per worker (Linux 5.3+).

The root cause is the first failure in time (``launcher.failure``). A worker whose script raises or exits is dated
by its exit record (``launcher.bootstrap``), written as the script ends. A worker killed by a signal (SIGKILL from
the OOM killer or a person, SIGSEGV, SIGABRT) or ended by ``os._exit`` writes none, and torchrun notices it only at
its next look, its teardown after that: by then the peers it left have failed on the closed connection and written
their records, so the consequence would look first. The kernel closes a dying process's sockets and then wakes
whoever polls its pidfd, microseconds apart, where a peer needs its network, an exception and a printed traceback
before its record: a watcher blocked on the workers' pidfds dates each death before any consequence of it.

The watcher is a small process of its own (``python -I -c``, this module's :func:`main`), not a thread of the
launcher: a thread would need the launcher's GIL to read the clock, and under load the thread that holds it (log
relays, the job watch, the sampler's reader) can be off the CPU for seconds. A lone process that sleeps in
``poll`` is woken by the kernel and runs at once, or nearly: on a host whose cores are all busy (a next
generation's imports, other jobs) a woken process waits for its turn like any other, so the watcher lowers its
nice value by :data:`PRIORITY` where it may (root, or ``CAP_SYS_NICE``), which lets the scheduler run it ahead of
the busy ones when it wakes; elsewhere it keeps the launcher's. It writes one line per death to a pipe (``pid at
code rank local_rank``); a thread here reads them, at its leisure (the time is in the line). It ends when the
launcher closes its stdin, or dies.

Each death also carries the worker's code, read from the kernel's ``/proc/PID/stat`` (field 52, the wait status)
while it is a zombie (torchrun reaps at its next look), and its rank, read from its environment when it is first
seen: a host whose torchrun was stopped before it printed its failure table still knows which worker failed first.

Where pidfds are not available (another kernel or OS) nothing is dated here, and a worker without a record comes
first within its host and is dated by its generation's end across hosts, as before.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Optional

from launcher import proctree
from launcher.outcome import Death

PRIORITY = 10  # how much the watcher lowers its nice value (raises its priority) where it is permitted
SCAN = 0.05  # seconds between looks for workers torchrun has started, until every one is watched
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds ``launcher`` (a folder, or the zipapp)
_MAIN = f"import sys; sys.path.insert(0, {_ROOT!r}); from launcher.deaths import main; main()"


class Deaths:
    """Watches the workers among the children of ``parent`` (torchrun; ``expected`` of them: ``--nproc-per-node``;
    a worker has ``RANK`` in its environment) and records when each one ended (``time.time()``, the clock of the
    exit records' modification times), how, and which rank it was; ``on_death`` is called (from a thread) after
    each one is heard."""

    def __init__(self, parent: int, expected: int, on_death: Optional[Callable[[], None]] = None) -> None:
        self.on_death = on_death
        self._ended: dict[int, Death] = {}
        self._lock = threading.Lock()
        self.watcher: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None
        if hasattr(os, "pidfd_open") and sys.executable:
            self.watcher = subprocess.Popen([sys.executable, "-I", "-c", _MAIN, str(parent), str(expected)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            self._thread = threading.Thread(target=self._hear, args=(self.watcher.stdout,), name="deaths",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> dict[int, Death]:
        """Stop watching (the watcher ends, having said every death it saw); the watched workers that ended (pid ->
        :class:`~launcher.outcome.Death`)."""
        if self.watcher is not None and self._thread is not None:
            self.watcher.stdin.close()  # type: ignore[union-attr]
            self._thread.join()
            self.watcher.stdout.close()  # type: ignore[union-attr]
            self.watcher.wait()
        return self.ended()

    def pids(self) -> tuple[int, ...]:
        """The watcher's pid (none without pidfds): the launcher's own child, never a leftover of torchrun's."""
        return () if self.watcher is None else (self.watcher.pid,)

    def ended(self) -> dict[int, Death]:
        """The deaths heard so far (pid -> :class:`~launcher.outcome.Death`)."""
        with self._lock:
            return dict(self._ended)

    def _hear(self, lines: IO[bytes]) -> None:
        for line in lines:
            try:
                pid, death = _parse(line)
            except ValueError:
                continue
            with self._lock:
                self._ended[pid] = death
            if self.on_death is not None:
                self.on_death()


def main() -> None:
    """The watcher (``argv``: torchrun's pid, how many workers): a line on stdout per death, until stdin closes."""
    parent, expected = int(sys.argv[1]), int(sys.argv[2])
    with contextlib.suppress(OSError):  # not permitted: the launcher's own priority
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - PRIORITY)
    poller = select.poll()
    poller.register(0, select.POLLIN)
    pidfds: dict[int, int] = {}  # fd -> pid
    ranks: dict[int, tuple[Optional[int], Optional[int]]] = {}
    seen: set[int] = set()
    while True:
        if len(ranks) < expected:
            for pid in proctree.children_of(parent):
                if pid not in seen:
                    fd = _open(pid, parent)
                    rank = (None, None) if fd is None else _ranks(pid)
                    if fd is not None and rank[0] is None:  # not a worker (yet: forked, not exec'd)
                        os.close(fd)
                        continue  # looked at again next time
                    seen.add(pid)
                    if fd is not None:
                        pidfds[fd], ranks[pid] = pid, rank
                        poller.register(fd, select.POLLIN)
        ready = poller.poll(SCAN * 1000 if len(ranks) < expected else None)
        now = time.time()
        for fd, _events in ready:
            if fd != 0:
                pid = pidfds.pop(fd)
                code, (rank, local_rank) = _code(pid), ranks[pid]
                os.write(1, f"{pid} {now!r} {_or_dash(code)} {_or_dash(rank)} {_or_dash(local_rank)}\n".encode())
                poller.unregister(fd)
                os.close(fd)
        if any(fd == 0 for fd, _events in ready):  # the launcher closed it (or died): every death seen is said
            return


def _or_dash(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def _parse(line: bytes) -> tuple[int, Death]:
    """A watcher's line: the pid and its :class:`~launcher.outcome.Death` (raises ValueError on a bad one)."""
    pid, at, code, rank, local_rank = line.decode().split()
    maybe = [None if v == "-" else int(v) for v in (code, rank, local_rank)]
    return int(pid), Death(float(at), *maybe)


def _open(pid: int, parent: int) -> Optional[int]:
    """A pidfd for ``pid`` if it is still ``parent``'s child (not a reused number); None otherwise."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already, or no pidfds here
        return None
    if proctree.parent_of(pid) != parent:
        os.close(fd)
        return None
    return fd



def _code(pid: int) -> Optional[int]:
    """A zombie's code, torchrun's way (``-N``: signal N), from its wait status; None once it is reaped."""
    fields = proctree.stat_fields(pid)
    if fields is None or len(fields) < 50:  # field 52 (Linux 3.5+), the 50th after the name
        return None
    status = int(fields[49])
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def _ranks(pid: int) -> tuple[Optional[int], Optional[int]]:
    """RANK and LOCAL_RANK from the environment the worker was started with."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            pairs = dict(item.partition(b"=")[::2] for item in fh.read().split(b"\0") if item)
    except OSError:
        return None, None
    values = [pairs.get(name, b"") for name in (b"RANK", b"LOCAL_RANK")]
    return tuple(int(v) if v.isdigit() else None for v in values)  # type: ignore[return-value]
