"""The disk the worker logs take under ``$TMPDIR``, bounded while the job runs; a full disk, named.

torchrun's ``--redirects`` sends each worker's stdout and stderr to a file in ``--log-dir``, which
:class:`launcher.workerlogs.LogCopier` copies to the launcher's streams; so every byte a worker prints
would stay on disk until the job ends: 1.1 GB of progress bars left a 1.07 GB file. The files cannot be
deleted or truncated: the workers write at their own file offsets and the copier reads at its own.

:class:`LogTrimmer` instead punches holes (``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``)
in what the copier has already read: the file keeps its size and every offset stays valid, only the
blocks are freed. The last :data:`KEEP_BYTES` of each file stay, so the root-cause search (the last
256 KiB of a rank's stderr) reads exactly what it would have read. A file not copied yet is left alone.
Where the file system cannot punch holes the logs grow as before, and the launcher says so once.

A worker can print faster than the copy goes (our own stdout may be a slow pipe). A pipe would then
make the worker wait; here a worker more than :data:`LAG_LIMIT` ahead of the copy is paused (SIGSTOP)
until half of that is copied, exactly a pipe's back-pressure with a 32 MiB buffer. A paused worker is
resumed at once when the job is being stopped, when the copy has ended, and when the trimmer stops.
So each log takes at most ``KEEP_BYTES + LAG_LIMIT`` on disk, plus what a worker writes between two
looks: the trimmer trims every :data:`EVERY` but stats the logs every :data:`CHECK_EVERY`, and trims at
once a log that grew fast (a worker writing into the page cache at 4 GB/s wrote 1 GB in one 0.25 s
period before this check existed).

Looking 50 times a second costs about 1 % of a core (each wake of a sleeping thread costs 0.1-0.2 ms
here), and most jobs print a line now and then. So once the logs are known the trimmer sleeps until a
worker writes to one (inotify, :class:`Writes`), and looks at once: a flood is seen at its first write.
It goes back to looking every :data:`CHECK_EVERY` while writes come more often than that, a log lags or
a worker is paused, and it trims every :data:`EVERY` only while a log is larger than :data:`KEEP_BYTES`
(before that there is nothing to free and nothing can lag), else every :data:`IDLE_EVERY`. Where inotify
is missing it looks every :data:`CHECK_EVERY`, as before.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import select
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any, Callable, Optional

from launcher import proctree

KEEP_BYTES = 1 << 20  # of each log, the last MiB stays on disk (the root-cause search reads 256 KiB)
LAG_LIMIT = 32 << 20  # bytes of a log not copied yet beyond which its worker is paused
EVERY = 0.25  # seconds between two trims ...
CHECK_EVERY = 0.02  # ... and between two looks at the logs' sizes: a log that grew by GROWTH is trimmed at once,
GROWTH = LAG_LIMIT // 4  # as is every log while one lags or none is known yet (a worker can write 4 GB/s)
IDLE_EVERY = 1.0  # seconds between two trims while every log is under KEEP_BYTES
START_EVERY = 0.1  # seconds between two looks for the first log while torchrun has created none (no inotify)
START_WAIT = 5.0  # ... with inotify, the longest sleep until it makes the logs' directory (woken at once)
FREE_MIN = 1 << 20  # a TMPDIR with less free space than this is full: nothing could run from it
_PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)
_BLOCK = 4096


def free_bytes(path: str) -> Optional[int]:
    """Free space for this user on the file system holding ``path`` (None: unknown)."""
    try:
        info = os.statvfs(path)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def disk_full_note(path: str) -> Optional[str]:
    """One line saying the file system of ``path`` is full (less than :data:`FREE_MIN` free), else None."""
    free = free_bytes(path)
    if free is None or free >= FREE_MIN:
        return None
    return (f"the disk of TMPDIR is full ({free >> 10} KiB free at {path}): torchrun and the workers could "
            "not write their logs and error files there")


@functools.cache
def _libc() -> Any:
    """The C library (``ctypes.CDLL``), loaded once; None where it cannot be (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    import ctypes  # only here: costs a few milliseconds

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _fallocate() -> Optional[Callable[[int, int, int, int], int]]:
    function = getattr(_libc(), "fallocate", None)
    if function is None:
        return None
    import ctypes

    function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
    function.restype = ctypes.c_int
    return function


class Writes:
    """Wakes a thread when a worker writes to one of the watched logs (inotify ``IN_MODIFY``), when something is
    made in a watched directory (``IN_CREATE``: torchrun's first log directory), or when :meth:`wake` is
    called. :func:`watch_writes` makes one; None where inotify cannot be used."""

    IN_MODIFY = 0x2
    IN_CREATE = 0x100

    def __init__(self, fd: int, add_watch: Callable[[int, bytes, int], int]) -> None:
        self.fd, self._add_watch = fd, add_watch
        self.watched: set[str] = set()
        self._wake_r, self._wake_w = os.pipe()
        for end in (self._wake_r, self._wake_w):  # wait() reads until empty; wake() never blocks
            os.set_blocking(end, False)

    def watch(self, paths: Iterable[str], events: int = IN_MODIFY) -> bool:
        """Watch these logs too (or directories, with ``events=IN_CREATE``); False if one cannot be watched
        (``fs.inotify.max_user_watches``, or it is gone)."""
        for path in paths:
            if path not in self.watched:
                if self._add_watch(self.fd, os.fsencode(path), events) < 0:
                    return False
                self.watched.add(path)
        return True

    def wait(self, timeout: float) -> bool:
        """Sleep until a watched log is written, :meth:`wake` is called or ``timeout`` passes; True if
        written. The events are read and dropped: the caller looks at the sizes itself."""
        ready, _, _ = select.select([self.fd, self._wake_r], [], [], max(0.0, timeout))
        for fd in ready:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                while os.read(fd, 65536):
                    pass
        return self.fd in ready

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        for fd in (self.fd, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def watch_writes() -> Optional[Writes]:
    """An inotify instance for the logs; None where there is none (not Linux, or the user's limit of
    instances reached: ``fs.inotify.max_user_instances``)."""
    init, add_watch = getattr(_libc(), "inotify_init1", None), getattr(_libc(), "inotify_add_watch", None)
    if init is None or add_watch is None:
        return None
    import ctypes

    init.argtypes, init.restype = (ctypes.c_int,), ctypes.c_int
    add_watch.argtypes, add_watch.restype = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32), ctypes.c_int
    fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
    return Writes(fd, add_watch) if fd >= 0 else None


class LogTrimmer:
    """A thread that keeps the worker logs of one torchrun small on disk while it runs.

    ``positions`` says how far each log is copied (:meth:`launcher.workerlogs.LogCopier.positions`);
    ``copying`` whether the copy goes on (when it has ended no worker is held back for it).
    """

    def __init__(self, torchrun_pid: int, log_dir: str, log: Callable[[str], None],
                 positions: Callable[[], dict[str, int]], copying: Callable[[], bool] = lambda: True,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.pid, self.log_dir, self.log, self.stopping = torchrun_pid, log_dir, log, stopping
        self.positions, self.copying = positions, copying
        self.punched: dict[str, int] = {}  # path -> bytes from 0 already punched
        self.paused: dict[int, str] = {}  # worker PID -> the log it is too far ahead in
        self.pauses = 0
        self.freed = 0
        self.behind = 0  # the largest number of bytes a log is ahead of the copy, at the last trim
        self.sizes: dict[str, int] = {}  # path -> its size at the last trim
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fallocate = _fallocate()
        self._writes = watch_writes() if self._fallocate is not None else None
        # torchrun makes its first log directory when it starts the workers: until then sleep on inotify
        self._dir_watched = self._writes is not None and self._writes.watch([log_dir], Writes.IN_CREATE)
        self._thread = threading.Thread(target=self._run, name="log-trimmer", daemon=True)
        if self._fallocate is not None:
            self._thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 (the job goes on without it; it says so once)
            self.log(f"stopped bounding the worker logs' disk use: {exc!r}")
            self._resume_all()

    def _loop(self) -> None:
        next_trim = looked = 0.0
        fast = polling = True  # look every CHECK_EVERY; else sleep until a log is written (or the next trim is due)
        seen: dict[str, int] = {}  # path -> its size at the last look
        while True:
            if not self.sizes and self._dir_watched and not has_entries(self.log_dir):
                written = self._writes.wait(START_WAIT)  # type: ignore[union-attr]  (watched: not None)
                if self._stop.is_set():
                    return
            elif polling or self._writes is None:
                pause = CHECK_EVERY if self.sizes or has_entries(self.log_dir) else START_EVERY
                written = False
                if self._stop.wait(pause):
                    return
            else:
                written = self._writes.wait(next_trim - time.monotonic())
                if self._stop.is_set():
                    return
            now = time.monotonic()
            sizes = {path: _size(path) for path in self.sizes}
            grown, seen = sizes != seen, sizes
            if self.sizes and now < next_trim and not self._grown(sizes):
                # a write less than CHECK_EVERY after the last look: writes come often, look every CHECK_EVERY;
                # a look that saw nothing written: sleep until the next write
                polling = fast or (written and now - looked < CHECK_EVERY) or (polling and grown)
                looked = now
                continue
            looked = now
            if not self.sizes and not has_entries(self.log_dir):
                continue  # torchrun has started no worker: no log yet
            known = set(self.sizes)
            with self._lock:
                if self._stop.is_set():
                    return
                self.trim()
            watched = self._writes is not None and self._writes.watch(self.sizes)
            # often while the copy lags, a worker is paused, or the logs are not all known yet (none, or new
            # ones since the last trim: torchrun opens one rank's after the other)
            fast = self.behind > LAG_LIMIT // 4 or bool(self.paused) or not self.sizes or set(self.sizes) != known
            small = max(self.sizes.values(), default=0) < KEEP_BYTES  # nothing to free, nothing can lag
            next_trim = now + (CHECK_EVERY if fast else IDLE_EVERY if small else EVERY)
            polling = fast or not watched

    def _grown(self, sizes: dict[str, int]) -> bool:
        """Whether a known log grew by more than :data:`GROWTH` since the last trim (``sizes``: now)."""
        return any(sizes.get(path, 0) - size > GROWTH for path, size in self.sizes.items())

    def trim(self) -> int:
        """Punch what is copied of each log, but its last :data:`KEEP_BYTES`; pause or resume the
        workers too far ahead of the copy. Returns the bytes freed."""
        freed = 0
        positions = self.positions()
        self.sizes = {path: _size(path) for path in positions}
        lags = {path: self.sizes[path] - pos for path, pos in positions.items()}
        self.behind = max(lags.values(), default=0)
        self._pace(lags)
        for path, pos in positions.items():
            end = min(pos, _size(path) - KEEP_BYTES) // _BLOCK * _BLOCK  # 0 until copied
            start = self.punched.get(path, 0)
            if end <= start:
                continue
            if not self._punch(path, start, end):
                return freed
            self.punched[path] = end
            freed += end - start
        self.freed += freed
        return freed

    def _pace(self, lags: dict[str, int]) -> None:
        """Pause the writer of a log more than :data:`LAG_LIMIT` ahead; resume it below half of that."""
        hold = not self.stopping() and self.copying()
        for pid, path in list(self.paused.items()):
            if not hold or lags.get(path, 0) < LAG_LIMIT // 2:
                self._signal(pid, signal.SIGCONT)
                del self.paused[pid]
        behind = [path for path, lag in lags.items() if lag > LAG_LIMIT and path not in self.paused.values()]
        if not hold or not behind:
            return
        for pid in proctree.children_of(self.pid):
            for fd in (1, 2):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in behind and pid not in self.paused:
                        self.paused[pid] = os.readlink(f"/proc/{pid}/fd/{fd}")
                        self._signal(pid, signal.SIGSTOP)
                        self.pauses += 1

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)

    def _resume_all(self) -> None:
        for pid in self.paused:
            self._signal(pid, signal.SIGCONT)
        self.paused.clear()

    def _punch(self, path: str, start: int, end: int) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return True  # gone (a new attempt's directory replaced it): nothing to free
        try:
            if self._fallocate(fd, _PUNCH_HOLE_KEEP_SIZE, start, end - start) != 0:  # type: ignore[misc]
                import ctypes

                code = ctypes.get_errno()
                if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    self.log(f"the file system of {self.log_dir} cannot punch holes ({os.strerror(code)}): "
                             "the worker logs keep all output on disk while the job runs")
                    self._stop.set()
                    return False
        finally:
            os.close(fd)
        return True

    def stop(self) -> None:
        """End the thread and resume any paused worker; the logs keep their holes."""
        self._stop.set()
        if self._writes is not None:
            self._writes.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._writes is not None and not self._thread.is_alive():  # closed here only: a descriptor
            self._writes.close()  # closed under the thread, or before a late wake(), could be another file's
            self._writes = None
        with self._lock:
            self._resume_all()


def has_entries(directory: str) -> bool:
    """Whether ``directory`` holds anything (True when it cannot be read: then look as before)."""
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is not None
    except OSError:
        return True


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
