"""Runs the training script as ``python script.py`` would, and records the exit code it asked for.

torchrun starts ``python -u <this file> script.py [args...]`` for every worker. This file is run as a
plain script (it imports nothing from the launcher and only the standard library) and:

- makes the script the ``__main__`` module, as Python does: ``__file__`` absolute, ``sys.argv`` the
  script as given and its arguments, ``sys.path[0]`` the script's real directory (this file's
  directory is no longer on the path), ``__loader__`` a source loader; so multiprocessing ``spawn`` and
  ``forkserver`` children, pickling classes defined in the script, sibling imports, atexit handlers and
  ``if __name__ == "__main__"`` behave as under ``python script.py``;
- sets ``TORCHELASTIC_RESTART_COUNT`` to the launcher's job-wide restart count (``DDP_LAUNCHER_GENERATION``),
  which torchrun, started with ``--max-restarts 0`` for every generation, would give as 0;
- when the script ends, before interpreter teardown, writes the code it asked for (``SystemExit``'s
  code, 1 for an uncaught exception, 0 for a normal end) to ``$DDP_LAUNCHER_EXIT_DIR/<pid>.json``
  with how far its stderr had got and when the worker started, then lets teardown run (atexit handlers, thread joins).

A crash later in teardown (torch's threads aborting: "terminate called without an active exception")
then changes what torchrun sees, but not what the launcher reports (see ``launcher.failure``).
An uncaught exception is printed by ``sys.excepthook`` without this file's frame; ``KeyboardInterrupt``
is left to Python (the process ends by SIGINT, as it would).
"""

import json
import os
import stat
import sys
import time

EXIT_DIR_VARIABLE = "DDP_LAUNCHER_EXIT_DIR"
GENERATION_VARIABLE = "DDP_LAUNCHER_GENERATION"  # the launcher's job-wide restart count (launcher/restart.py)
STARTED = time.time()  # the worker's start: the rendezvous was complete


def _stderr_offset():
    """How many bytes the worker's stderr file holds (torchrun's log file); None if it is not a file."""
    try:
        sys.stderr.flush()
        info = os.fstat(2)
    except (OSError, ValueError, AttributeError):
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _record(code):
    """Write ``{"code", "stderr_offset", "started"}`` for this process, atomically; never fails the script."""
    directory = os.environ.get(EXIT_DIR_VARIABLE)
    if not directory:
        return
    path = os.path.join(directory, f"{os.getpid()}.json")
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump({"code": code, "stderr_offset": _stderr_offset(), "started": STARTED}, fh)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


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


def run(argv):
    """Run the script ``argv[0]`` with ``argv[1:]`` as ``python script.py`` would; record its code."""
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
    _record(0)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: bootstrap.py script.py [args...]")
    run(sys.argv[1:])
