"""The workers' output: copied from torchrun's log files to the launcher's streams, each line with its rank.

torchrun's ``--redirects 3`` writes each worker's stdout and stderr to a file under ``--log-dir``
(``<log dir>/<run id>_<random>/attempt_0/<local rank>/stdout.log`` and ``stderr.log``). A
:class:`LogCopier` thread reads the files as they grow and writes each line, with the rank's prefix
``[rank3]:``, to the launcher's stdout or stderr, where torchrun's ``--tee`` used to put it.

Why the launcher copies rather than ``--tee``: torchrun's tailer is a thread per file that reads a line
at a time and sleeps 0.1 s at each end of file. Its threads end only after their sleep, 0.2 s at the end
of every job and generation, and their polling, with torchrun's pipe to the launcher in between, cost a
4-host job on 2 cores 3 % (``bench/bench_start.py``, ``flags`` against ``redirects``). The copier sleeps
until torchrun makes the workers' log directory and then until a worker writes (inotify; where there is none,
it looks every :data:`FIND_EVERY` for the logs and every :data:`CHECK_EVERY` at them), reads what is there in
:data:`CHUNK` pieces, prefixes the lines in bulk, and once torchrun has exited copies the rest at once.

The text is what ``--tee`` gave: UTF-8 with undecodable bytes replaced, and ``\\r`` and ``\\r\\n`` read as
line ends, so a progress bar's updates are lines. Unlike ``--tee``, a line is written whole once its end
has come. A line still without end after :data:`PARTIAL_AFTER` seconds, or longer than :data:`LINE_LIMIT`,
is written as far as it has come and its rest follows without a second prefix; a worker's last line
without end gets one when the copy ends. So memory per log stays within a chunk and a line limit,
whatever a worker prints.

The rank in the prefix is the worker's ``RANK`` (read from its environment, as torchrun's prefix was),
else the launch's first rank plus the local rank. :meth:`LogCopier.positions` says how far each log has
been copied: :class:`launcher.logspace.LogTrimmer` frees what lies before that.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import io
import os
import threading
import time
from typing import Callable, Optional

from launcher import proctree
from launcher.logspace import Writes, has_entries, watch_writes

PREFIX = "[rank{}]:"
CHUNK = 65536  # bytes read from one log before the next log gets its turn
LINE_LIMIT = 65536  # characters of a line without end kept back, waiting for its end
PARTIAL_AFTER = 0.5  # seconds a line without end is kept back before it is written as far as it has come
CHECK_EVERY = 0.02  # seconds between two looks at the logs where inotify is missing
FIND_EVERY = 0.05  # seconds between two looks for the logs while torchrun has not opened them all
STOP_WAIT = 30.0  # seconds stop() waits for the copy to end (a stream we write to can be stuck)
STREAMS = ("stdout.log", "stderr.log")

Write = Callable[[bytes], None]


class _Log:
    """One worker log being copied: where it is read, the decoder's state, the line not yet ended."""

    def __init__(self, path: str, local_rank: int, stream: int) -> None:
        self.path, self.local_rank, self.stream = path, local_rank, stream
        self.fd: Optional[int] = None
        self.pos = 0
        self.prefix = ""  # set before the first bytes are read
        self.decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")("replace"),
                                                    translate=True)
        self.partial = ""  # the start of a line whose end has not come yet
        self.since = 0.0  # when ``partial`` began waiting
        self.midline = False  # part of the current line is written: its rest gets no prefix

    def text(self, data: bytes, final: bool = False) -> str:
        """What ``data`` gives to write, the prefixes in, whole lines only (but with ``final``)."""
        waiting = bool(self.partial)
        text = self.partial + self.decoder.decode(data, final)
        end = text.rfind("\n") + 1
        done, self.partial = text[:end], text[end:]
        out = ""
        if done:
            out = ("" if self.midline else self.prefix) + done[:-1].replace("\n", "\n" + self.prefix) + "\n"
            self.midline = False
        if self.partial and (final or len(self.partial) >= LINE_LIMIT):
            out += self.flush()
        if self.partial and (done or not waiting):
            self.since = time.monotonic()  # a new line began waiting for its end
        if final and self.midline:
            out += "\n"  # the worker's last line without end: what follows is not part of it
            self.midline = False
        return out

    def flush(self) -> str:
        """The line without end as far as it has come (its rest will follow without a prefix)."""
        out = ("" if self.midline else self.prefix) + self.partial
        self.partial, self.midline = "", True
        return out


class LogCopier:
    """A thread that copies the worker logs of one torchrun (``--redirects``) to ``writes``: (stdout, stderr)."""

    def __init__(self, log_dir: str, torchrun_pid: int, first_rank: int, logs: int,
                 writes: tuple[Write, Write], log: Callable[[str], None]) -> None:
        """``logs``: how many files torchrun opens (two per local rank); ``first_rank``: this host's first
        global rank, for a worker gone before its ``RANK`` could be read."""
        self.log_dir, self.pid, self.first_rank, self.expected = log_dir, torchrun_pid, first_rank, logs
        self.writes, self.log = writes, log
        self.logs: dict[str, _Log] = {}
        self._lock = threading.Lock()  # the positions, read by the trimmer's thread
        self._stop = threading.Event()
        self._watch = watch_writes()
        self._poll = self._watch is None  # look every CHECK_EVERY (no inotify, or out of watches)
        # until torchrun makes its first log directory (when it starts the workers) sleep on inotify
        self._dir_watched = self._watch is not None and self._watch.watch([log_dir], Writes.IN_CREATE)
        self._thread = threading.Thread(target=self._run, name="log-copier", daemon=True)
        self._thread.start()

    def copying(self) -> bool:
        """Whether the copy goes on (False once it has ended, or failed)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def positions(self) -> dict[str, int]:
        """Each known log's path (resolved) and how many of its bytes are copied."""
        with self._lock:
            return {path: entry.pos for path, entry in self.logs.items()}

    def stop(self, timeout: float = STOP_WAIT) -> bool:
        """Copy what is left (torchrun has exited) and end the thread; False if it did not end in ``timeout``."""
        self._stop.set()
        if self._watch is not None:
            self._watch.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self._watch is not None:  # closed only once the thread is gone: its descriptor could be reused
            self._watch.close()
            self._watch = None
        return True

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 (the job goes on; its output then stays in the logs)
            self.log(f"stopped copying the workers' output: {exc!r}; it stays in {self.log_dir}")
        finally:
            for entry in self.logs.values():
                if entry.fd is not None:
                    os.close(entry.fd)

    def _loop(self) -> None:
        ended = False  # the stop has come and the logs were looked for once more: copy to their ends
        while True:
            if not ended and (len(self.logs) < self.expected or self._stop.is_set()):
                ended = self._stop.is_set()
                self._find()
            more = self._copy_round()  # a log had more than a chunk: another round, each log in turn
            if ended and not more:
                for entry in self.logs.values():
                    self._write(entry, entry.text(b"", final=True))
                return
            now = time.monotonic()
            for entry in self.logs.values():
                if entry.partial and now - entry.since >= PARTIAL_AFTER:
                    self._write(entry, entry.flush())
            if more:
                continue
            waits = [entry.since + PARTIAL_AFTER - now for entry in self.logs.values() if entry.partial]
            if len(self.logs) < self.expected and (not self._dir_watched or has_entries(self.log_dir)):
                waits.append(FIND_EVERY)
            if self._poll or self._watch is None:
                self._stop.wait(min([*waits, CHECK_EVERY]))
            else:
                self._watch.wait(min(waits, default=3600.0))

    def _find(self) -> None:
        """Learn of the logs torchrun has opened since the last look."""
        for stream, name in enumerate(STREAMS):
            for path in glob.glob(os.path.join(glob.escape(self.log_dir), "*", "attempt_*", "*", name)):
                path = os.path.realpath(path)
                local = os.path.basename(os.path.dirname(path))
                if path in self.logs or not local.isdigit():
                    continue
                if not self._poll and self._watch is not None and not self._watch.watch([path]):
                    self._poll = True  # out of inotify watches (fs.inotify.max_user_watches): look instead
                with self._lock:
                    self.logs[path] = _Log(path, int(local), stream)

    def _copy_round(self) -> bool:
        """A chunk of each log that has grown; True if one may hold more."""
        more = False
        for entry in list(self.logs.values()):
            if entry.fd is None:
                try:
                    entry.fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
            data = os.read(entry.fd, CHUNK)
            if not data:
                continue
            with self._lock:
                entry.pos += len(data)
            more = more or len(data) == CHUNK
            if not entry.prefix:
                entry.prefix = PREFIX.format(self._rank_of(entry.local_rank))
            self._write(entry, entry.text(data))
        return more

    def _rank_of(self, local_rank: int) -> int:
        """The global rank of torchrun's worker ``local_rank``, from its environment (the first rank plus the
        local rank if it is gone)."""
        for pid in proctree.children_of(self.pid):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
                if env.get(b"LOCAL_RANK") == str(local_rank).encode() and b"RANK" in env:
                    return int(env[b"RANK"])
        return self.first_rank + local_rank

    def _write(self, entry: _Log, text: str) -> None:
        if text:
            self.writes[entry.stream](text.encode("utf-8", "surrogateescape"))
