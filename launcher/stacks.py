"""A hung host's stacks, taken in bounded time: each worker writes its own dump into a file of its own.

The workers run with ``PYTHONFAULTHANDLER=1``: faulthandler's handler for :data:`STACK_SIGNAL` (SIGABRT) is a
C function that writes every thread's Python stack to file descriptor 2 and lets the process end. It needs
no GIL and no Python code runs, so a rank stuck in a C call, a collective or a busy loop dumps all the same.
Under ``--redirects`` that descriptor is torchrun's log file of the worker (``/proc/PID/fd/2``), so the dump
is read straight from it, from where the file ended when the worker was frozen. Where the worker's sampler
runs (:mod:`launcher.bootstrap`), asked to hold still before the freeze (:func:`park_samplers`) it turns the
dump to a file of its own, ``<pid>.stacks`` in the exit directory (:func:`own_dump_file`): there no other thread
of the script writes into it (in stderr a logger's line joined a frame's line and the frame was misread), and
the dump is read from that file and then appended to the worker's log (:func:`copy_to_log`), so the host's log
still has it in full. Nothing on the way depends on
another thread being scheduled: not the copy of the workers' output (:mod:`launcher.workerlogs`; before it,
torchrun's ``--tee`` threads), nor the launcher's output pumps, whose output was waited for a fixed 10 s before.

:func:`take` freezes torchrun (SIGSTOP) while the workers dump, so it cannot stop a worker (SIGTERM after
another one died) before that worker ran its handler, and continues it afterwards. A worker is done when it
ended (its dump is whole), when it ignores the signal (``SigIgn``), or when the signal was delivered and
every thread of it has slept for :data:`SETTLE` seconds with its file unchanged: a Python-level handler
took the signal and no dump will come. The wait ends when every worker is done, at most ``bound`` seconds.
A worker whose stderr is no regular file (or whose ``/proc`` entry cannot be read) is left to the output
that torchrun copies to the launcher (``unread``). Before the workers, their children that write to the same
file (a DataLoader's workers: they inherit faulthandler and the descriptor) dump the same way, one child per
file at a time, so that a hang inside a loader's worker shows the dataset's line.

Which thread of a dump is the script's: :mod:`launcher.bootstrap` writes the worker's main thread id to
``<pid>.thread`` in the exit directory (``DDP_LAUNCHER_EXIT_DIR`` in the worker's own environment) before the
script starts; :func:`describe` reads it (:attr:`Worker.main`). A dump without that thread gives the rank no
position (:data:`NO_MAIN`), never another thread's frame.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Optional

from launcher import hang, proctree

STACK_SIGNAL = signal.SIGABRT
SETTLE = 1.0  # seconds a worker that took the signal sleeps, its file unchanged, before no dump is expected
POLL = 0.05  # seconds between looks at the workers
MAX_DUMP_BYTES = 4 * 1024 * 1024  # of a worker's file after its offset (faulthandler: 100 threads x 100 frames)
MAX_CHILDREN = 4  # children of one worker whose stacks are taken
IGNORED = "SIGABRT ignored"
CAUGHT = "SIGABRT caught, no dump"
NO_MAIN = "its main thread is not in its dump"
EXIT_DIR_VARIABLE = b"DDP_LAUNCHER_EXIT_DIR"  # as launcher/bootstrap.py reads it
BEAT_VARIABLE = b"DDP_LAUNCHER_PROGRESS"  # ... and these two: whether its sampler runs
SAMPLE_VARIABLE = b"DDP_LAUNCHER_SAMPLE"
PARK_NAME = "park"  # as launcher/bootstrap.py reads it: in the exit directory, the samplers look no more
PARK_WAIT = 2.0  # seconds at most for every sampler to hold still (one look takes milliseconds)
MAX_IDENT = 2 ** 64  # a thread id (``pthread_t``) is an unsigned long


class Worker(NamedTuple):
    """One worker: its pid, its global rank (``RANK``), its stderr file and that file's size when frozen, its
    main thread's id when :mod:`launcher.bootstrap` recorded it, and the file of its own that its parked sampler
    turned faulthandler's dump to (``<pid>.stacks``), if any."""

    pid: int
    rank: Optional[int]
    path: Optional[str]
    offset: int
    main: Optional[int] = None
    own: Optional[str] = None

    def dump_file(self) -> tuple[Optional[str], int]:
        """Where its dump is written, and from which offset: its own file from the start, else its stderr."""
        return (self.own, 0) if self.own is not None else (self.path, self.offset)


class Taken(NamedTuple):
    """What :func:`take` found: each rank's dump, why a rank gave none (or none with its main thread), the
    workers left to the output pipe, each rank's children's dumps (pid, threads), e.g. its DataLoader workers',
    and each rank's main thread id."""

    dumps: dict[int, list[hang.Thread]]
    why: dict[int, str]
    unread: list[int]
    children: dict[int, list[tuple[int, list[hang.Thread]]]]
    mains: dict[int, int]  # rank -> its main thread's id, where recorded (see :func:`main_ident`)


def main_ident(exit_dir: str, pid: int) -> Optional[int]:
    """The main thread id that :mod:`launcher.bootstrap` wrote to ``<exit_dir>/<pid>.thread``; None if none."""
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(exit_dir, f"{pid}.thread"), "rb") as fh:
            text = fh.read(64).decode("ascii").strip()
        return int(text) if text.isdigit() and 0 < int(text) < MAX_IDENT else None
    return None


def _environ(pid: int) -> dict[bytes, bytes]:
    """The process's environment as it started (``/proc/PID/environ``, at most 1 MiB); empty if unreadable."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as fh:
        return dict(item.partition(b"=")[::2] for item in fh.read(1 << 20).split(b"\0") if item)
    return {}


def park_samplers(pids: Sequence[int], bound: float = PARK_WAIT) -> list[int]:
    """Ask the samplers of the workers ``pids`` (:mod:`launcher.bootstrap`) to look no more, and wait until each
    said it holds still (``<pid>.parked`` in its exit directory), at most ``bound`` s; before they are frozen.
    faulthandler reads every thread's frames without the GIL: a sampler looking meanwhile changed its own under
    it, and the dump showed a wrong frame, or crashed (SIGSEGV) before it reached the main thread, which it
    prints last. The workers that did not say so (no sampler; or it could not run, the GIL held in C)."""
    waiting: dict[int, str] = {}
    for pid in pids:
        env = _environ(pid)
        exits = os.fsdecode(env.get(EXIT_DIR_VARIABLE, b""))
        if exits.startswith("/") and env.get(BEAT_VARIABLE) and env.get(SAMPLE_VARIABLE) != b"0":
            with contextlib.suppress(OSError):
                os.close(os.open(os.path.join(exits, PARK_NAME), os.O_WRONLY | os.O_CREAT, 0o600))
            waiting[pid] = os.path.join(exits, f"{pid}.parked")
    deadline = time.monotonic() + bound
    while waiting:
        waiting = {pid: path for pid, path in waiting.items()
                   if not os.path.exists(path) and signal_state(pid) != "gone"}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(POLL)
    return sorted(waiting)


def describe(pid: int) -> Worker:
    """A worker's rank (``RANK`` in ``/proc/PID/environ``), its stderr file and the file's size now, and its
    main thread's id (:func:`main_ident` in its ``DDP_LAUNCHER_EXIT_DIR``)."""
    rank: Optional[int] = None
    path: Optional[str] = None
    main: Optional[int] = None
    own: Optional[str] = None
    offset = 0
    with contextlib.suppress(ValueError):
        env = _environ(pid)
        text = env.get(b"RANK", b"").decode()
        rank = int(text) if text.isdigit() and len(text) <= 7 else None
        exit_dir = os.fsdecode(env.get(EXIT_DIR_VARIABLE, b""))
        if exit_dir.startswith("/"):
            main = main_ident(exit_dir, pid)
            own = own_dump_file(exit_dir, pid)
    with contextlib.suppress(OSError):
        target = os.readlink(f"/proc/{pid}/fd/2")
        info = os.stat(f"/proc/{pid}/fd/2")
        if stat.S_ISREG(info.st_mode) and target.startswith("/"):
            path, offset = target, info.st_size
    return Worker(pid, rank, path, offset, main, own)


def own_dump_file(exit_dir: str, pid: int) -> Optional[str]:
    """``<exit_dir>/<pid>.stacks`` when the worker's sampler, parked, turned faulthandler's dump to it (it says
    so in ``<pid>.parked`` after); None else."""
    own = os.path.join(exit_dir, f"{pid}.stacks")
    if os.path.exists(os.path.join(exit_dir, f"{pid}.parked")) and os.path.isfile(own):
        return own
    return None


def _mask(fields: Mapping[str, str], name: str) -> int:
    with contextlib.suppress(ValueError):
        return int(fields.get(name, "0"), 16)
    return 0


def signal_state(pid: int, signum: int = STACK_SIGNAL) -> str:
    """Where the signal stands with the process: ``gone`` (ended: exited, or a zombie), ``ignored``,
    ``pending`` (not delivered yet), ``running`` (a thread runs or waits on the disk: a handler may be
    writing), ``asleep`` (delivered, and every thread sleeps)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            fields = dict(line.partition(":")[::2] for line in fh.read(65536).splitlines())
    except OSError:
        return "gone"
    fields = {k: v.strip() for k, v in fields.items()}
    bit = 1 << (signum - 1)
    if fields.get("State", "Z")[:1] in ("Z", "X"):
        return "gone"
    if _mask(fields, "SigIgn") & bit:
        return "ignored"
    if (_mask(fields, "ShdPnd") | _mask(fields, "SigPnd")) & bit:
        return "pending"
    return "running" if any(s in ("R", "D") for s in _thread_states(pid)) else "asleep"


def _thread_states(pid: int) -> list[str]:
    states = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task")[:4096]:
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                    data = fh.read(4096)
                states.append(data[data.rfind(b")") + 2:][:1].decode("ascii", "replace"))
    return states


def _size(path: Optional[str]) -> int:
    with contextlib.suppress(OSError):
        return os.stat(path).st_size if path else 0
    return 0


def read_dump(worker: Worker) -> list[hang.Thread]:
    """The worker's last dump in its file after its offset (at most :data:`MAX_DUMP_BYTES`); [] if none."""
    return _parse(worker, _dump_text(worker))


def _parse(worker: Worker, data: bytes) -> list[hang.Thread]:
    return hang.parse_dumps(data.decode("utf-8", "replace").splitlines(), worker.rank).get(worker.rank, [])


def _dump_text(worker: Worker) -> bytes:
    path, offset = worker.dump_file()
    if path is None:
        return b""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read(MAX_DUMP_BYTES)
    except OSError:
        return b""


def copy_to_log(worker: Worker, data: bytes) -> None:
    """Append ``data``, the dump written to the worker's own file, to its stderr file (torchrun's log of it, which
    the launcher copies to its output with the rank's prefix): the host's log has every thread's stack in full,
    as when faulthandler wrote it there. Nothing when it has no own file, or no stderr file."""
    if worker.own is None or worker.path is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(worker.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def signal_workers(pids: Sequence[int], signum: int) -> None:
    """Send ``signum`` to each worker; SIGABRT to its main thread (:func:`_to_main_thread`), after setting its
    core size limit to 0 (no core file)."""
    import resource  # only on a hang

    for pid in pids:
        if signum == signal.SIGABRT:
            with contextlib.suppress(OSError, ValueError):
                resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
            if _to_main_thread(pid, signum):
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _to_main_thread(pid: int, signum: int) -> bool:
    """Send ``signum`` to the process's main thread (its thread id is its pid; Linux ``tgkill``): faulthandler's
    handler then runs in the main thread, which cannot go on meanwhile. Sent to the process, any thread could take
    it while the main thread resumed: a rank whose peer died in another host's dump woke in its collective, raised,
    and was dumped inside ``sys.excepthook`` instead of at its line. False where ``tgkill`` is missing."""
    import ctypes  # only on a hang

    try:
        tgkill = ctypes.CDLL(None, use_errno=True).tgkill
    except (OSError, AttributeError):  # no C library here, or one older than glibc 2.30
        return False
    tgkill(pid, pid, signum)  # a process already gone: ESRCH, as os.kill's ProcessLookupError is ignored
    return True


def wait_done(workers: Sequence[Worker], bound: float) -> dict[int, str]:
    """Wait until each worker is done (see the module's text), at most ``bound`` s: pid -> why it gave no
    dump, for the workers that will give none (ignored, caught) or did not finish in time."""
    deadline = time.monotonic() + bound
    left = {w.pid: w for w in workers}
    asleep: dict[int, tuple[float, int]] = {}  # pid -> since when it sleeps, its file's size then
    why: dict[int, str] = {}
    while left:
        now = time.monotonic()
        for pid, worker in list(left.items()):
            state = signal_state(pid)
            if state in ("gone", "ignored"):
                del left[pid]
                if state == "ignored":
                    why[pid] = IGNORED
            elif state == "asleep":
                written = _size(worker.dump_file()[0])
                since, size = asleep.setdefault(pid, (now, written))
                if written != size:
                    asleep[pid] = (now, written)
                elif now - since >= SETTLE:
                    del left[pid]
                    why[pid] = CAUGHT
            else:
                asleep.pop(pid, None)
        if not left or now >= deadline:
            break
        time.sleep(POLL)
    why.update({pid: f"no dump in {bound:g} s" for pid in left})
    return why


def _hold(pid: int, timeout: float = 1.0) -> None:
    """SIGSTOP ``pid`` and wait (bounded) until it is stopped."""
    signal_workers([pid], signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while proctree.state(pid) not in ("T", "t", "Z", None) and time.monotonic() < deadline:
        time.sleep(0.005)


def _children(workers: Sequence[Worker]) -> list[list[Worker]]:
    """Each worker's children that write to its stderr file (a DataLoader's workers, forked or spawned), at
    most :data:`MAX_CHILDREN` each, in rounds: the i-th child of every worker (one file, one writer at a time)."""
    rounds: list[list[Worker]] = []
    for worker in workers:
        if worker.path is None or worker.rank is None:
            continue
        kids = [describe(pid) for pid in proctree.children_of(worker.pid)]
        kids = [kid._replace(rank=worker.rank) for kid in kids if kid.path == worker.path][:MAX_CHILDREN]
        for i, kid in enumerate(kids):
            if len(rounds) <= i:
                rounds.append([])
            rounds[i].append(kid)
    return rounds


def _dump_children(workers: Sequence[Worker], bound: float) -> dict[int, list[tuple[int, list[hang.Thread]]]]:
    """Dump the workers' children (:func:`_children`) before the workers: rank -> [(pid, threads)]. Each round
    of children gets at most ``bound`` s; a child that gives no dump is left out."""
    found: dict[int, list[tuple[int, list[hang.Thread]]]] = {}
    deadline = time.monotonic() + bound
    for kids in _children(workers):
        kids = [describe(kid.pid)._replace(rank=kid.rank) for kid in kids]  # the file as it is now
        pids = [kid.pid for kid in kids]
        signal_workers(pids, STACK_SIGNAL)
        signal_workers(pids, signal.SIGCONT)
        wait_done(kids, max(0.5, min(bound / 2, deadline - time.monotonic())))
        for kid in kids:
            threads = read_dump(kid)
            if threads and kid.rank is not None:
                found.setdefault(kid.rank, []).append((kid.pid, threads))
    return found


def take(pids: Sequence[int], parent: Optional[int], bound: float) -> Taken:
    """Dump the (frozen) workers ``pids``: first their children (:func:`_dump_children`), then SIGABRT
    pending, then SIGCONT; torchrun (``parent``) stopped meanwhile when every worker's dump is read from a
    file; wait (:func:`wait_done`), copy each dump written to a worker's own file into its log
    (:func:`copy_to_log`), and read each dump."""
    children = _dump_children([describe(pid) for pid in pids], bound / 2)
    workers = [describe(pid) for pid in pids]
    readable = [w for w in workers if w.rank is not None and w.dump_file()[0] is not None]
    unread = [w.pid for w in workers if w not in readable]
    hold = parent is not None and not unread and bool(workers)
    if hold and parent is not None:
        _hold(parent)
    try:
        signal_workers(pids, STACK_SIGNAL)
        signal_workers(pids, signal.SIGCONT)
        why_pid = wait_done(readable, bound)
        texts = {w.pid: _dump_text(w) for w in readable}
        for worker in readable:  # before torchrun goes on, ends, and the copy of its logs with it
            copy_to_log(worker, texts[worker.pid])
    finally:
        if hold and parent is not None:
            signal_workers([parent], signal.SIGCONT)
    dumps: dict[int, list[hang.Thread]] = {}
    why: dict[int, str] = {}
    mains = {w.rank: w.main for w in workers if w.rank is not None and w.main is not None}
    for worker, rank in ((w, w.rank) for w in readable if w.rank is not None):
        threads = _parse(worker, texts[worker.pid])
        if threads:
            dumps[rank] = threads
            if worker.main is not None and hang.main_thread(threads, worker.main) is None:
                why[rank] = NO_MAIN + (f", {why_pid[worker.pid]}" if worker.pid in why_pid else "")
        else:
            why[rank] = why_pid.get(worker.pid, "ended without a dump")
    return Taken(dumps, why, unread, children, mains)
