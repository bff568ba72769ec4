"""Runs the training script as ``python script.py`` would, and records the exit code it asked for.

torchrun starts ``python -u <this file> script.py [args...]`` for every worker. This file is run as a
plain script (it imports nothing from the launcher and only the standard library) and:

- makes the script the ``__main__`` module, as Python does: ``__file__`` absolute, ``sys.argv`` the
  script as given and its arguments, ``sys.path[0]`` the script's real directory (this file's
  directory is no longer on the path), ``__loader__`` a source loader; so multiprocessing ``spawn`` and
  ``forkserver`` children, pickling classes defined in the script, sibling imports, atexit handlers and
  ``if __name__ == "__main__"`` behave as under ``python script.py``;
- asks the kernel for SIGTERM when torchrun dies (Linux ``PR_SET_PDEATHSIG``): the launcher starts torchrun
  with SIGKILL as its own parent-death signal (see ``launcher.supervise``), so a worker whose launcher and
  watchdog were both killed gets SIGTERM from the kernel instead of from torchrun's shutdown;
- in a generation started ahead (``DDP_LAUNCHER_HOLD``, ``launcher.ahead``): removes that variable, imports torch
  and waits for the launcher's go file before any of the rest;
- sets ``TORCHELASTIC_RESTART_COUNT`` to the launcher's job-wide restart count (``DDP_LAUNCHER_GENERATION``),
  which torchrun, started with ``--max-restarts 0`` for every generation, would give as 0;
- when the script ends, before interpreter teardown, writes the code it asked for (``SystemExit``'s
  code, 1 for an uncaught exception, 0 for a normal end) to ``$DDP_LAUNCHER_EXIT_DIR/<pid>.json``
  with how far its stderr had got and when the worker started, then lets teardown run (atexit handlers, thread joins);
- before the script starts, writes its main thread's id (``threading.main_thread().ident``, the number
  faulthandler prints in that thread's header) to ``$DDP_LAUNCHER_EXIT_DIR/<pid>.thread``, so that the
  launcher knows which thread of a hung worker's stack dump is the script's (``launcher.stacks``).

A crash later in teardown (torch's threads aborting: "terminate called without an active exception")
then changes what torchrun sees, but not what the launcher reports (see ``launcher.failure``).
An uncaught exception is printed by ``sys.excepthook`` without this file's frame; ``KeyboardInterrupt``
is left to Python (the process ends by SIGINT, as it would).

With hang detection on (``$DDP_LAUNCHER_PROGRESS`` names the launcher's beat socket), a daemon thread
samples the main thread every :data:`PERIOD` s (:class:`Sampler`). What it judges is the script's own code:
the innermost frame of the main thread that is the script's (not the standard library, an installed package,
torch or this file), that frame's line, and the library frame it called (the *callee*). At most once per
:data:`SEND` s it tells the launcher what it saw since the last beat, with one word (docs/hangs.md):

- ``~step``: the script's code came round a loop: back to a line it had left, or the same line called its
  library function again (a new callee frame);
- ``~moved``: the script's code moved: another frame or line, a new callee, or, when the script's own line
  is the innermost frame (a C call made from it, ``.item()``, ``time.sleep``), the thread's CPU clock moved
  since the last look; or the main thread read or wrote bytes (its ``/proc`` I/O counters: a checkpoint
  written or loaded in one long library call). These do not depend on where a look lands: every call makes
  a new frame, a thread that came back from a C call and went round has used CPU time, and the counters
  only grow;
- ``~wait``: no move, and a frame below the script's is a ``torch.distributed`` collective (:data:`WAITS`):
  the rank waits for the others, and every rank has joined the group;
- ``~busy``: only the library's frames moved (an import, a checkpoint load, a poll loop inside torch);
- ``~end`` (once, from the main thread): the script has ended; the interpreter's teardown follows, during
  which no thread samples (faulthandler is gone too: no stack could be taken).

A blocked collective, a deadlock, a blocked read and a library poll loop keep the script's frame, line and
callee for ever: no ``~moved``. A C call that holds the GIL stops the sampler too: no beat, as it should be.
``DDP_LAUNCHER_SAMPLE=0`` turns the sampler off. Before a hang's stacks are taken the launcher asks the sampler
to look no more (the file ``park`` in the exit directory): it turns faulthandler's dump to a file of its own
(``<pid>.stacks``, which no other thread of the script writes into), says so (``<pid>.parked``) and holds still
in a C call that keeps the GIL, so that no thread of the script runs Python until the dump: faulthandler reads
every thread's frames without the GIL, and never reads one while it changes.
"""

import contextlib
import json
import os
import signal
import socket
import stat
import sys
import threading
import time

EXIT_DIR_VARIABLE = "DDP_LAUNCHER_EXIT_DIR"
GENERATION_VARIABLE = "DDP_LAUNCHER_GENERATION"  # the launcher's job-wide restart count (launcher/restart.py)
BEAT_VARIABLE = "DDP_LAUNCHER_PROGRESS"  # the launcher's beat socket (launcher/progress.py: BEAT_ENV)
SAMPLE_VARIABLE = "DDP_LAUNCHER_SAMPLE"  # "0": no sampler
HOLD_VARIABLE = "DDP_LAUNCHER_HOLD"  # a generation started ahead: wait for this file (launcher/ahead.py)
HOLD_LOOK = 0.01  # seconds between two looks for it
STARTED = time.time()  # the worker's start: the rendezvous was complete (held: the go)
PERIOD = 0.1  # seconds between two looks at the main thread
PARK_NAME = "park"  # in the exit directory: the launcher asks the samplers to look no more (a hang's stacks)
PARK_HOLD = 300.0  # seconds a parked sampler keeps the GIL: the stacks are taken within 40 s (launcher/hangwatch.py)
SEND = 1.0  # seconds at least between two beats of the sampler
MAX_DEPTH = 64  # frames walked outward to find the script's own code
MAX_SEEN = 4096  # lines of the script's code remembered (then forgotten, and learned again)
# torch.distributed's collectives: a rank in one waits for the others, every rank has joined the group
# (launcher/hang.py: COLLECTIVES)
WAITS = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "all_reduce_coalesced"})
_DISTRIBUTED = os.sep.join(("", "torch", "distributed", ""))
_LIBRARY = (os.path.dirname(os.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)


class Sampler:
    """Looks at the main thread (``ident``) every :data:`PERIOD` s: :meth:`look` says what changed since the
    last look, at the level of the script's own code (see the module's text). It holds the innermost frame
    of the script's code and the library frame that frame called (the *callee*) until the next look, so
    that a new frame is never taken for the old one (a function called again from the same line gets a new
    frame object, which could otherwise reuse the old one's address); what they hold stays alive until then
    (at most :data:`PERIOD` s)."""

    def __init__(self, ident, native_id=None):
        self.ident = ident
        self.io = f"/proc/self/task/{native_id}/io" if native_id else None  # the thread's I/O counters (Linux)
        self.moved_bytes = self._bytes()
        self.frame, self.line = None, 0  # the innermost frame at the last look, and its line
        self.user, self.user_line, self.callee = None, 0, None  # the script's innermost frame, its line, callee
        self.cpu = None  # the main thread's CPU clock (None: not readable here), and its last reading
        self.spent = 0.0
        with contextlib.suppress(AttributeError, OSError, OverflowError):
            self.cpu = time.pthread_getcpuclockid(ident)
            self.spent = time.clock_gettime(self.cpu)
        self.user_last = None  # (id of the code, line) of the innermost frame in the script's own code
        self.seen = set()
        self.user_code = {}  # id(code) -> whether it is the script's own code (not the library's)
        self.exiting = threading.Event()  # the script has ended: look at no frame any more
        self.released = threading.Event()  # the sampler's thread has let go of every frame

    def finish(self, timeout=1.0):
        """The script has ended: hold no frame of it any more, before the interpreter finalizes.

        A frame held past its function's return keeps its locals alive: a frame of
        ``destroy_process_group`` keeps the process group it destroys, whose C++ threads then meet the
        interpreter's teardown. From now on :meth:`look` says "moving" (the process is finishing) and
        holds nothing; this waits (at most ``timeout``) until the sampler's thread has let go."""
        self.exiting.set()
        self.released.wait(timeout)
        self.frame = self.user = self.callee = None

    def _is_user(self, code):
        known = self.user_code.get(id(code))
        if known is None:
            name = code.co_filename
            known = not (name.startswith("<") or name.startswith(_LIBRARY) or "-packages" + os.sep in name)
            if len(self.user_code) > MAX_SEEN:
                self.user_code.clear()
            self.user_code[id(code)] = known
        return known

    def _bytes(self):
        """Bytes the main thread has read and written (``rchar`` + ``wchar``); 0 where unreadable."""
        if self.io is None:
            return 0
        try:
            with open(self.io, "rb") as fh:
                fields = dict(line.split(b":", 1) for line in fh.read(4096).splitlines() if b":" in line)
            return int(fields[b"rchar"]) + int(fields[b"wchar"])
        except (OSError, KeyError, ValueError):
            return 0

    def _did_io(self):
        """Whether the main thread read or wrote since the last look (a checkpoint write that keeps writing)."""
        moved_bytes = self._bytes()
        did, self.moved_bytes = moved_bytes != self.moved_bytes, moved_bytes
        return did

    def _ran(self):
        """Whether the main thread ran on a CPU since the last look (its CPU clock moved)."""
        if self.cpu is None:
            return False
        try:
            spent = time.clock_gettime(self.cpu)
        except OSError:  # the thread is gone
            return True
        ran, self.spent = spent != self.spent, spent
        return ran

    def look(self):
        """:class:`Look` since the last look. A main thread without a Python frame is finishing (the
        interpreter's teardown, torch's own): that counts as moving, as does a script that has ended."""
        if self.exiting.is_set():
            self.frame = self.user = self.callee = None
            self.released.set()
            return Look(True, True, False, False)
        frame = sys._current_frames().get(self.ident)
        if frame is None:
            self.frame = self.user = self.callee = None
            return Look(True, True, False, False)
        busy = frame is not self.frame or frame.f_lineno != self.line
        self.frame, self.line = frame, frame.f_lineno
        callee, waiting, depth = None, False, 0
        while frame is not None and depth < MAX_DEPTH and not self._is_user(frame.f_code):
            code = frame.f_code
            waiting = waiting or (code.co_name in WAITS and _DISTRIBUTED in code.co_filename)
            callee, frame, depth = frame, frame.f_back, depth + 1
        if frame is None or depth >= MAX_DEPTH:  # no frame of the script's (its start, the interpreter's end)
            self.user = self.callee = None
            return Look(busy, busy, False, waiting)
        moved = frame is not self.user or frame.f_lineno != self.user_line or callee is not self.callee
        ran, did_io = self._ran(), self._did_io()
        if not moved and callee is None:  # in the script's own line (a C call, or a loop on one line)
            moved = ran
        moved = moved or did_io
        # the same line called its library function again: the loop came round
        stepped = (frame is self.user and frame.f_lineno == self.user_line and callee is not None
                   and self.callee is not None and callee is not self.callee)
        user = (id(frame.f_code), frame.f_lineno)
        if moved and user != self.user_last:
            stepped = stepped or user in self.seen
            if len(self.seen) > MAX_SEEN:
                self.seen.clear()
            self.seen.add(user)
            self.user_last = user
        self.user, self.user_line, self.callee = frame, frame.f_lineno, callee
        del frame, callee
        return Look(busy, moved, stepped, waiting and not moved)


class Look(tuple):
    """What one look saw: ``busy`` (the innermost frame or its line changed: the library's code counts),
    ``moved`` (the script's own code moved: see the module's text), ``stepped`` (it came round a loop),
    ``waiting`` (still, inside a ``torch.distributed`` function that waits for the other ranks)."""

    def __new__(cls, busy, moved, stepped, waiting):
        return super().__new__(cls, (busy, moved, stepped, waiting))

    busy = property(lambda self: self[0])
    moved = property(lambda self: self[1])
    stepped = property(lambda self: self[2])
    waiting = property(lambda self: self[3])


def _word(busy, moved, stepped, waiting):
    """The beat's word for what was seen since the last beat; None: nothing to say."""
    if stepped:
        return b"~step"
    if moved:
        return b"~moved"
    if waiting:
        return b"~wait"
    return b"~busy" if busy else None


def _sample(sampler, rank, path, stop, park=None):
    """The sampler's thread: at most once per :data:`SEND` a beat to ``path`` saying what was seen (see
    the module's text); until ``stop`` is set (never, in a worker: the thread ends with the interpreter), or
    until the file ``park`` exists (:func:`_park`)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    busy = moved = stepped = False
    sent = 0.0
    while not stop.wait(PERIOD):
        if park is not None and os.path.exists(park):
            _park(park, stop)
            return
        seen = sampler.look()
        busy, moved, stepped = busy or seen.busy, moved or seen.moved, stepped or seen.stepped
        now = time.monotonic()
        if now - sent < SEND:
            continue
        word = _word(busy, moved, stepped, seen.waiting)
        if word is not None:
            with contextlib.suppress(OSError):  # nobody listens (yet, or any more), or the queue is full
                sock.sendto(b"%d %s" % (rank, word), path)
            sent = now
        busy = moved = stepped = False


def _park(park, stop):
    """Look no more: the launcher takes every thread's stack next. faulthandler reads each thread's frames
    without the GIL; a thread that runs Python meanwhile changes them under it, and the dump can show a
    wrong frame or crash before it reaches the main thread (printed last). Turns the dump to a file of its own
    (:func:`_dump_to_own_file`), says so in ``<pid>.parked`` beside ``park`` and holds the GIL in C for
    :data:`PARK_HOLD` s (:func:`_hold_the_gil`): no thread of the script runs Python (a logger's thread, a
    progress bar's) until the dump, which comes long before. Then it waits until ``stop`` (in a worker: never)."""
    directory = os.path.dirname(park)
    _dump_to_own_file(directory)
    _hold_the_gil(os.path.join(directory, f"{os.getpid()}.parked"), PARK_HOLD)
    stop.wait()


def _hold_the_gil(parked, seconds):
    """Create the file ``parked``, then sleep ``seconds`` in ``poll``, both called through ``ctypes.PyDLL``,
    which keeps the GIL: from the file on, the other threads of the process run no Python (they wait for the
    GIL; a thread inside a C call goes on with it). Between the two calls the interpreter may hand the GIL over
    once (a thread that asked for it for 5 ms); the sampler takes it back within a switch interval, as a rule before the
    launcher, which looks for the file every 50 ms, stops the worker. Where the C library cannot be called this
    way, the file is created and nothing is held."""
    import ctypes  # only for a hang's stacks

    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        open_, close, poll = libc.open, libc.close, libc.poll
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.close(os.open(parked, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        return
    open_.argtypes, open_.restype = (ctypes.c_char_p, ctypes.c_int, ctypes.c_uint), ctypes.c_int
    poll.argtypes, poll.restype = (ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int), ctypes.c_int
    close.argtypes, close.restype = (ctypes.c_int,), ctypes.c_int
    path, flags, deadline = os.fsencode(parked), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, time.monotonic() + seconds
    fd = open_(path, flags, 0o600)
    if fd >= 0:
        close(fd)
    while fd >= 0 and time.monotonic() < deadline:  # poll ends early on a signal's handler (EINTR)
        poll(None, 0, max(1, int((deadline - time.monotonic()) * 1000)))


def _dump_to_own_file(directory):
    """From now on faulthandler writes its dump (the launcher's SIGABRT comes next) to ``<pid>.stacks`` in
    ``directory``, a file no other thread writes to: in the worker's stderr a logger's line, written while
    faulthandler wrote a frame's line a word at a time, joined that line (``in all_reduceINFO:chat 122``) and
    the frame was misread. Only when faulthandler is on (the user may have turned it off); the descriptor stays
    open for faulthandler (and for a forked child, which dumps into the same file)."""
    import faulthandler

    if not faulthandler.is_enabled():
        return
    fd = -1
    try:
        fd = os.open(os.path.join(directory, f"{os.getpid()}.stacks"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
        faulthandler.enable(file=fd, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        if fd >= 0:
            os.close(fd)


def start_sampler(environ, stop=None):
    """Start the sampler's thread when the launcher listens for beats (until ``stop``, an event, is set);
    the thread (its ``sampler`` attribute: the :class:`Sampler`), or None."""
    path, rank = environ.get(BEAT_VARIABLE), environ.get("RANK", "")
    if not path or not rank.isdigit() or environ.get(SAMPLE_VARIABLE) == "0":
        return None
    if path.startswith("@"):  # a name in Linux's abstract namespace (launcher/progress.py: beat_address)
        path = "\0" + path[1:]
    main = threading.main_thread()
    sampler = Sampler(main.ident, getattr(main, "native_id", None))
    exits = environ.get(EXIT_DIR_VARIABLE)
    park = os.path.join(exits, PARK_NAME) if exits else None
    thread = threading.Thread(target=_sample, args=(sampler, int(rank), path, stop or threading.Event(), park),
                              name="ddp-launcher-sampler", daemon=True)
    thread.sampler = sampler
    thread.ended = lambda: _send(path, int(rank), b"~end")
    thread.start()
    return thread


def _send(path, rank, word):
    """One beat datagram (never blocks, never fails the script)."""
    with contextlib.suppress(OSError):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            sock.sendto(b"%d %s" % (rank, word), path)
        finally:
            sock.close()


def die_with_torchrun():
    """SIGTERM to this worker when its parent (torchrun) dies; at once if it already has. Linux only; never
    fails the script. ``launcher.proctree.die_with_parent`` does the same, but this file imports nothing
    from the launcher (a script's own ``launcher`` module could stand in its way)."""
    parent = os.getppid()
    try:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):  # no C library, or no prctl (not Linux)
        return
    if parent == 1 or os.getppid() != parent:  # torchrun died before the request: the signal would never come
        os.kill(os.getpid(), signal.SIGTERM)


def _stderr_offset():
    """How many bytes the worker's stderr file holds (torchrun's log file); None if it is not a file."""
    try:
        sys.stderr.flush()
        info = os.fstat(2)
    except (OSError, ValueError, AttributeError):
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _write(suffix, text):
    """Write ``text`` to ``<pid><suffix>`` in the exit directory, atomically; never fails the script."""
    directory = os.environ.get(EXIT_DIR_VARIABLE)
    if not directory:
        return
    path = os.path.join(directory, f"{os.getpid()}{suffix}")
    try:
        with open(path + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _record(code):
    """Write ``{"code", "stderr_offset", "started", "ended"}`` for this process (``<pid>.json``): ``ended`` is the
    moment the script ended (its file's modification time is the kernel's coarse clock, a tick behind)."""
    ended = time.time()
    _write(".json", json.dumps({"code": code, "stderr_offset": _stderr_offset(), "started": STARTED,
                                "ended": ended}))


def _record_main_thread():
    """Write the main thread's id (decimal) to ``<pid>.thread``."""
    _write(".thread", str(threading.main_thread().ident))


def _asked(code):
    """The process exit status ``SystemExit(code)`` gives, as Python computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: printed, exit status 1


def _main_module(path):
    """A fresh ``__main__`` module for the script at ``path`` (absolute), registered in ``sys.modules``."""
    import importlib.machinery
    import types

    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    module.__cached__ = None
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    return module


def hold(script):
    """Started ahead (``$DDP_LAUNCHER_HOLD``, the launcher's go file): import torch meanwhile, with ``sys.path[0]``
    the script's directory as its own ``import torch`` would have (importing initialises nothing of CUDA), then
    wait for the go. The variable is removed first: the script's environment is a fresh start's."""
    global STARTED
    path = os.environ.pop(HOLD_VARIABLE, "")
    if not path:
        return
    first = sys.path[0]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    try:
        import torch  # noqa: F401  (the script's own import then finds it done)
    except Exception:  # the script's own import says what is wrong, as it would
        pass
    finally:
        sys.path[0] = first
    while not os.path.exists(path):
        time.sleep(HOLD_LOOK)
    STARTED = time.time()


def run(argv):
    """Run the script ``argv[0]`` with ``argv[1:]`` as ``python script.py`` would; record its code."""
    die_with_torchrun()
    hold(argv[0])
    script = argv[0]
    path = os.path.abspath(script)
    with open(path, "rb") as fh:
        source = fh.read()
    try:
        code = compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:  # as Python prints it: no traceback
        exc.__traceback__ = None
        sys.excepthook(type(exc), exc, None)
        _record(1)
        raise SystemExit(1) from None
    sys.argv = list(argv)
    if os.environ.get(GENERATION_VARIABLE, "").isdigit():  # torchrun (--max-restarts 0) would say 0
        os.environ["TORCHELASTIC_RESTART_COUNT"] = os.environ[GENERATION_VARIABLE]
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    module = _main_module(path)
    _record_main_thread()
    sampling = start_sampler(os.environ)
    try:
        exec(code, module.__dict__)
    except SystemExit as exc:
        _record(_asked(exc.code))
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # what Python does with an uncaught exception, without this frame
        exc.__traceback__ = exc.__traceback__.tb_next if exc.__traceback__ else None
        sys.excepthook(type(exc), exc, exc.__traceback__)
        _record(1)
        raise SystemExit(1) from None
    finally:
        if sampling is not None:
            sampling.sampler.finish()
            sampling.ended()
    _record(0)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: bootstrap.py script.py [args...]")
    run(sys.argv[1:])
