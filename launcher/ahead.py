"""The next generation's torchrun, started ahead: it imports torch while the hosts stop and meet.

A restart in place waits for node 0's decision (every host's generation has ended) and only then starts the
next generation's torchrun, whose interpreter spends its first second or two importing torch
(``bench/bench_restart.py``: the ``new torchrun`` and ``first step`` phases). :func:`start` starts that
interpreter as soon as this host's generation has ended, with the next generation's argv and environment: it
imports ``torch.distributed.run`` and waits for one byte on its stdin. :meth:`Ahead.go` sends it, and the
process runs the module as ``python -m torch.distributed.run`` does (``runpy`` as ``__main__``, ``sys.argv``
the module's file and torchrun's arguments, ``sys.path[0]`` the working directory), its stdin then
``/dev/null`` as the launcher gives torchrun. Node 0 decides no restart, or a stop signal comes: :meth:`Ahead.cancel`
ends it by PID (SIGKILL: it has started nothing). It is started as torchrun is
(:func:`launcher.supervise.start_torchrun`: its own session, SIGKILL when the launcher dies, the forward-only
signals ignored), and
:func:`launcher.generations.run_generations` hands it to ``supervise`` as torchrun when its launch is the
generation's.

Only between two generations, when the budget allows another: a job that does not restart never starts one.
``DDP_LAUNCHER_AHEAD=0`` in the launcher's environment turns it off (torchrun is then started after the
decision, as before).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Mapping
from typing import Optional

from launcher.command import Launch
from launcher.supervise import start_torchrun

VARIABLE = "DDP_LAUNCHER_AHEAD"
MODULE = "torch.distributed.run"
GO = b"g"
# Python code, run with ``-c`` and torchrun's arguments: import, wait, then be ``python -m torch.distributed.run``
STUB = "\n".join([
    "import os, runpy, sys",
    f"import {MODULE}",
    f"if os.read(0, 1) != {GO!r}:",
    "    sys.exit(0)",
    "null = os.open(os.devnull, os.O_RDONLY)",
    "os.dup2(null, 0)",
    "os.close(null)",
    "sys.path[0] = os.getcwd()",
    f"runpy.run_module({MODULE!r}, run_name='__main__', alter_sys=True)",
])


class Ahead:
    """A torchrun interpreter started ahead for ``launch``, waiting for :meth:`go`."""

    def __init__(self, proc: subprocess.Popen, launch: Launch) -> None:
        self.proc = proc
        self.launch = launch

    def go(self) -> subprocess.Popen:
        """Let it run torchrun; the process. An interpreter that died meanwhile (torch failed to import) is
        returned all the same: its end and its stderr are torchrun's."""
        stdin, self.proc.stdin = self.proc.stdin, None  # as torchrun started with stdin /dev/null: no pipe of ours
        if stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                stdin.write(GO)
            with contextlib.suppress(OSError):
                stdin.close()
        return self.proc

    def cancel(self) -> None:
        """End it by PID and reap it; its pipes closed."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def start(launch: Launch, environ: Mapping[str, str]) -> Optional[Ahead]:
    """Start torchrun's interpreter for ``launch`` (the next generation's), or None: turned off
    (``DDP_LAUNCHER_AHEAD=0``), no torchrun to start (the script started directly), or it could not start."""
    argv = list(launch.argv)
    if environ.get(VARIABLE) == "0" or argv[1:3] != ["-m", MODULE]:
        return None
    try:
        return Ahead(start_torchrun([argv[0], "-c", STUB, *argv[3:]], launch.environment(environ), subprocess.PIPE),
                     launch)
    except OSError:
        return None
