"""The next generation started ahead: torchrun, its rendezvous and its workers, held before the script runs.

A restart in place waits for node 0's decision (every host's generation has ended) and only then would start the
next generation: torchrun's interpreter imports torch, the hosts' agents meet, torchrun spawns the workers, and
each worker imports torch again before its script's first line does anything (``bench/bench_restart.py``: the
``first step`` phase). :func:`start` starts all of that as soon as this host's generation has ended, with the next
generation's argv and environment, plus ``DDP_LAUNCHER_HOLD``: the path of a file that does not exist yet. Each
worker's bootstrap (:mod:`launcher.bootstrap`) removes that variable from its environment, imports torch (with
``sys.path[0]`` the script's directory, as the script's own ``import torch`` would; importing initialises nothing
of CUDA) and waits for the file. :meth:`Ahead.go` creates it when node 0 decides to restart: the workers then run
the script as a fresh start does, with the same environment, ``sys.argv``, ``__main__``, signal dispositions and
parent-death signal (``tests/test_ahead.py``, ``tests/test_restart_jobs.py``), only with torch already imported.
Node 0 decides no restart, or a stop signal comes: :meth:`Ahead.cancel` kills the torchrun and its workers by PID
(SIGKILL: no script has run). It is started as torchrun is (:func:`launcher.supervise.start_torchrun`: its own
session, SIGKILL when the launcher dies, the forward-only signals ignored), and
:func:`launcher.generations.run_generations` hands it to ``supervise`` as torchrun when its launch is the
generation's. Its workers write nothing before the go (their logs go to the generation's own directory,
:func:`launcher.command.for_generation`), so the last generation's evidence stays whole for the verdict.

Only between two generations, when the budget allows another: a job that does not restart never starts one.
``DDP_LAUNCHER_AHEAD=0`` in the launcher's environment turns it off (the next generation then starts after the
decision, its workers importing torch in the script, as before). A script that sets a variable torch reads when
it is imported (not when CUDA starts) before its own ``import torch`` should set it in the job's environment, or
turn this off.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Mapping
from typing import Optional

from launcher import proctree
from launcher.command import GENERATION_VARIABLE, Launch
from launcher.supervise import start_torchrun

VARIABLE = "DDP_LAUNCHER_AHEAD"
HOLD_VARIABLE = "DDP_LAUNCHER_HOLD"  # as launcher/bootstrap.py reads it
MODULE = "torch.distributed.run"


class Ahead:
    """The next generation's torchrun, started ahead for ``launch``; its workers wait for :meth:`go`."""

    def __init__(self, proc: subprocess.Popen, launch: Launch, go_file: str) -> None:
        self.proc = proc
        self.launch = launch
        self.go_file = go_file

    def go(self) -> subprocess.Popen:
        """Let the workers run the script; the process. A torchrun that ended meanwhile (its rendezvous failed)
        is returned all the same: its end and its stderr are the generation's."""
        with contextlib.suppress(OSError), open(self.go_file, "x"):
            pass
        return self.proc

    def cancel(self) -> None:
        """Kill torchrun and its workers by PID and reap torchrun; its pipes closed."""
        proctree.kill_tree([self.proc.pid])
        self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        with contextlib.suppress(OSError):
            os.unlink(self.go_file)


def start(launch: Launch, environ: Mapping[str, str]) -> Optional[Ahead]:
    """Start the generation of ``launch`` (the next one) held before its script, or None: turned off
    (``DDP_LAUNCHER_AHEAD=0``), no torchrun to start (the script started directly), or it could not start."""
    if environ.get(VARIABLE) == "0" or list(launch.argv[1:3]) != ["-m", MODULE]:
        return None
    go_file = os.path.join(launch.run_dir, f"go-g{launch.env_changes.get(GENERATION_VARIABLE, '0')}")
    with contextlib.suppress(OSError):
        os.unlink(go_file)
    env = launch.environment(environ)
    env[HOLD_VARIABLE] = go_file
    try:
        os.makedirs(launch.log_dir, exist_ok=True)
        return Ahead(start_torchrun(launch.argv, env), launch, go_file)
    except OSError:
        return None
