"""When each rank was last heard: its output lines, and the explicit beats of scripts that print rarely.

- Output: the launcher copies every worker line from torchrun's log files with a ``[rankN]:`` prefix
  (:mod:`launcher.workerlogs`); :meth:`Progress.feed` takes the chunks it and the supervisor's output pumps
  copy and notes the ranks whose lines they hold (one regular-expression scan of the chunk; nothing is kept).
- Beats: the launcher binds a UNIX datagram socket in the run directory and names it in the workers'
  environment (:data:`BEAT_ENV`). A script sends its rank as a datagram, e.g. once per step::

      beat = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); beat.setblocking(False)  # once
      address = socket_address(os.environ.get(BEAT_ENV, ""))  # once: "@name" is "\\0name" (below)
      with contextlib.suppress(OSError, KeyError): beat.sendto(os.environ["RANK"].encode(), address)

  One system call, no output, never blocks; when nobody listens (no launcher, hang detection off) it
  fails at once with ``FileNotFoundError``/``ConnectionRefusedError``, which is ignored. Where the socket's
  path would be too long for a UNIX socket (107 bytes: a ``TMPDIR`` of more than about 55 characters) the
  socket has a name in Linux's abstract namespace instead, written ``@name`` (a variable cannot hold the NUL
  byte it starts with): :func:`socket_address` gives what to send to.
- Sampled: without the script's help, :mod:`launcher.bootstrap` samples each rank's main thread and
  sends a beat with a word of :data:`SAMPLED`: its code went round a loop (``~step``), moved (``~moved``),
  only the library's frames moved (``~busy``), or it waits for the other ranks in ``torch.distributed``
  (``~wait``: no progress; :meth:`Progress.waiting`).

A rank whose script ended (``~end``) is heard through its teardown (at most :data:`TEARDOWN` s). Every
kind but ``~wait`` makes a rank heard (its silence ends), ``~busy`` only until the rank first stepped
(a poll loop inside torch is no progress); a step-like kind (an explicit beat, a sampled
``~step``, a line) also marks its step, which the learned timeout learns from
(:mod:`launcher.hangtimeout`). A rank's lines count only until it beats or is sampled: a thread that
prints proves nothing about the training loop.
- After a hang is decided, :meth:`Progress.capture` keeps (bounded) what the workers print on stderr
  next: their stack dumps.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Sequence
from typing import Optional

BEAT_ENV = "DDP_LAUNCHER_PROGRESS"
BEAT_SOCKET = "progress.sock"
MAX_SOCKET_PATH = 107  # bytes of a UNIX socket's path (sun_path holds 108, with the closing NUL)
SAMPLED = (b"~moved", b"~step", b"~busy", b"~wait", b"~end")  # the bootstrap's sampler's words (launcher/bootstrap.py)
TEARDOWN = 60.0  # seconds a rank whose script ended counts as heard: the interpreter's teardown, under load
WAIT_FRESH = 3.0  # seconds a rank's last ``~wait`` holds: its sampler says it again every second while it waits
MAX_BEAT = 64  # bytes of a beat datagram that are read: the rank, then an optional word
CAPTURE_LIMIT = 16 * 1024 * 1024  # bytes of stack dumps kept after a hang (a few MB for hundreds of threads)
_RANK_LINE = re.compile(rb"^\[rank(\d{1,7})\]:", re.MULTILINE)


class Progress:
    """Per rank, the monotonic time it was last heard. Thread-safe; fed by the pumps and the beats."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.heard: dict[int, float] = {}
        self.stepped: dict[int, float] = {}  # rank -> its latest step-like event
        self.beating: set[int] = set()  # ranks that beat or are sampled: their lines no longer count
        self.ended: dict[int, float] = {}  # rank -> when its script ended (``~end``): the teardown is no silence
        self.came_round: set[int] = set()  # ranks that stepped (sampled or explicit): their ``~busy`` no longer counts
        self.waits: dict[int, tuple[float, float]] = {}  # rank -> (since, last ``~wait``): waiting for the others
        self.beats = 0
        self.first_beat: Optional[float] = None  # when the first beat came (monotonic): a first step
        self.steps = 0  # step-like beats: explicit ones and the sampler's ``~step`` (a restart's progress)
        self.first_step: Optional[float] = None  # when the first of them came (monotonic)
        self.last_beat: Optional[float] = None  # when the latest explicit beat came (monotonic)
        self.captured: Optional[bytearray] = None

    def feed(self, chunk: bytes, stderr: bool = False) -> None:
        """Note the ranks whose lines ``chunk`` holds (a line's prefix cut by the chunk's start is missed:
        the rank's next line counts). While capturing, keep stderr's bytes."""
        ranks = {int(m) for m in _RANK_LINE.findall(chunk)} if b"[rank" in chunk else ()
        now = time.monotonic()
        with self.lock:
            for rank in ranks:
                if rank not in self.beating:
                    self.heard[rank] = self.stepped[rank] = now
            if stderr and self.captured is not None and len(self.captured) < CAPTURE_LIMIT:
                self.captured += chunk[:CAPTURE_LIMIT - len(self.captured)]

    def beat(self, rank: int, word: bytes = b"") -> None:
        """A rank's beat: explicit (any ``word`` but the sampler's) or sampled (:data:`SAMPLED`). ``~wait``
        makes no rank heard (it notes since when the rank waits for the others); ``~busy`` (the library's
        frames moved, the script's did not) makes it heard only until it first stepped."""
        now = time.monotonic()
        with self.lock:
            self.beating.add(rank)
            if word == b"~wait":
                self.waits[rank] = (self.waits[rank][0] if rank in self.waits else now, now)
                return
            self.waits.pop(rank, None)
            if word == b"~end":
                self.ended[rank] = now
            if word == b"~busy" and rank in self.came_round:
                return
            self.heard[rank] = now
            if word in (b"~moved", b"~busy", b"~end"):
                return
            self.stepped[rank] = now
            self.came_round.add(rank)
            self.steps += 1
            if self.first_step is None:
                self.first_step = now
            if word not in SAMPLED:
                self.beats += 1
                self.last_beat = now
                if self.first_beat is None:
                    self.first_beat = now

    def waiting(self) -> dict[int, float]:
        """rank -> since when it waits for the others in ``torch.distributed`` (monotonic), for the ranks
        whose sampler said so in the last :data:`WAIT_FRESH` s."""
        now = time.monotonic()
        with self.lock:
            return {rank: since for rank, (since, last) in self.waits.items() if now - last <= WAIT_FRESH}

    def last(self) -> dict[int, float]:
        """A copy of rank -> when last heard (monotonic); for a rank whose script ended, now, for at most
        :data:`TEARDOWN` s (the interpreter's teardown, when nothing samples)."""
        now = time.monotonic()
        with self.lock:
            return {**self.heard, **{rank: min(now, when + TEARDOWN) for rank, when in self.ended.items()}}

    def last_step(self) -> Optional[float]:
        """When any rank's latest step-like event came (monotonic); None before the first."""
        with self.lock:
            return max(self.stepped.values(), default=None)

    def capture(self) -> None:
        """Start keeping stderr's bytes (the stack dumps that follow)."""
        with self.lock:
            self.captured = bytearray()

    def captured_lines(self) -> list[str]:
        """What was kept since :meth:`capture`, as lines (bad bytes replaced)."""
        with self.lock:
            data = bytes(self.captured or b"")
        return data.decode("utf-8", "replace").splitlines()


def parse_beat(data: bytes) -> Optional[tuple[int, bytes]]:
    """A beat datagram's rank and word (``b"3"``, ``b"3 eval"``, ``b"3 ~moved"``); None when it is not one."""
    head, _, word = data[:MAX_BEAT].partition(b" ")
    head = head.strip()
    return (int(head), word.strip()) if head.isdigit() and len(head) <= 7 else None


def beat_address(run_dir: str) -> str:
    """Where the workers send beats (:data:`BEAT_ENV`): the socket's path in the run directory; or, when that
    is too long for a UNIX socket, ``@`` and the run directory's name (unique: the launcher's pid and 16
    random hex digits), a name in Linux's abstract namespace, which the workers share with the launcher (the
    same network namespace) and which no cleaner can remove. Pure."""
    path = os.path.join(run_dir, BEAT_SOCKET)
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    return f"@{os.path.basename(run_dir)}/{BEAT_SOCKET}"


def socket_address(address: str) -> str:
    """What ``sendto`` and ``bind`` take for :func:`beat_address`'s value: ``@name`` is ``\\0name``."""
    return "\0" + address[1:] if address.startswith("@") else address


class BeatSocket:
    """The UNIX datagram socket beats arrive on; :meth:`drain` reads what came (never blocks).

    The workers send to its path, so a socket whose file was removed (a ``/tmp`` cleaner that ignores the run
    directory's lock, a hand) hears nothing more, and a healthy job would look hung: :meth:`rebind_if_gone`
    binds a new one at the same path."""

    def __init__(self, run_dir: str, remake: Sequence[str] = ()) -> None:
        self.path = beat_address(run_dir)  # ``@name``: in the abstract namespace, no file
        self.remake = remake  # directories made again with the socket's own (the workers' exit records)
        self.sock, self.identity = self._bind()

    def _bind(self) -> tuple[socket.socket, tuple[int, int]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(socket_address(self.path))
            sock.setblocking(False)
            found = None if self.path.startswith("@") else os.lstat(self.path)
        except OSError:
            sock.close()
            raise
        return sock, (found.st_dev, found.st_ino) if found is not None else (0, 0)

    def rebind_if_gone(self, progress: Progress) -> Optional[str]:
        """If the socket's file is no longer at its path (removed, alone or with the run directory, or
        replaced), read what the old socket holds into ``progress`` and bind a new one there, its directory
        and :attr:`remake` made again (0700) if they are gone. Returns a line for the log when it did or
        could not, None when all is well."""
        if self.path.startswith("@"):
            return None  # no file to remove
        with contextlib.suppress(OSError):
            found = os.lstat(self.path)
            if (found.st_dev, found.st_ino) == self.identity:
                return None
        self.drain(progress)
        try:
            directory = os.path.dirname(self.path)
            os.makedirs(directory, 0o700, exist_ok=True)
            if os.lstat(directory).st_uid != os.geteuid():
                return f"progress beats: {self.path} is gone, and its directory is not this user's: not bound again"
            for path in self.remake:
                os.makedirs(path, 0o700, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            sock, self.identity = self._bind()
        except OSError as exc:
            return f"progress beats: {self.path} is gone and cannot be bound again: {exc}"
        self.sock.close()
        self.sock = sock
        return f"progress beats: {self.path} was removed (a /tmp cleaner?): bound again"

    def fileno(self) -> int:
        """For select."""
        return self.sock.fileno()

    def drain(self, progress: Progress, limit: int = 10000) -> None:
        """Read every waiting beat (at most ``limit``) into ``progress``."""
        for _ in range(limit):
            try:
                data = self.sock.recv(MAX_BEAT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            beat = parse_beat(data)
            if beat is not None:
                progress.beat(*beat)

    def wake(self) -> None:
        """Make a select on this socket return now: an empty datagram to itself (no beat: ignored)."""
        with contextlib.suppress(OSError):
            self.sock.sendto(b"", socket_address(self.path))

    def close(self) -> None:
        """Close and remove the socket file."""
        self.sock.close()
        if not self.path.startswith("@"):
            with contextlib.suppress(OSError):
                os.unlink(self.path)
