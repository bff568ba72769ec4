"""Standard streams that are always there and writes to them that never fail.

A launcher may start with a standard descriptor closed (a scheduler's daemon), and its output may
vanish mid-run (Ctrl-C on ``ddp-launcher ... | tee log`` kills the pipe's reader first). Neither may
stop it from supervising the job, handling a signal or reporting the exit code.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, TextIO

_NAMES = ("stdin", "stdout", "stderr")


def ensure_standard_fds() -> None:
    """Open ``/dev/null`` on any closed descriptor 0, 1 or 2 (and give Python a stream for it).

    Call it first, before any pipe is made: a pipe would otherwise take the free number, and a
    child's or a watchdog's standard stream would become that pipe.
    """
    for fd, name in enumerate(_NAMES):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:  # Python found the descriptor closed at start-up
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", buffering=1 if fd else -1, closefd=False))  # noqa: SIM115 (lives as long as the process)


def write(stream: Optional[TextIO], text: str) -> None:
    """Write and flush; a closed or broken stream (or none) is silently skipped."""
    try:
        stream.write(text)  # type: ignore[union-attr]
        stream.flush()  # type: ignore[union-attr]
    except (OSError, ValueError, AttributeError):
        pass


def settle_output() -> None:
    """Flush stdout and stderr; where that fails, send the rest to ``/dev/null``.

    Otherwise the interpreter's own last flush fails again at exit and turns the exit code into 120.
    """
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        try:
            stream.flush()
        except (OSError, ValueError):
            try:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
                stream.flush()
            except (OSError, ValueError):
                pass
        except AttributeError:
            pass
