"""The next generation started ahead: torchrun, its rendezvous and its workers, held before the script runs.

A restart in place waits for node 0's decision (every host's generation has ended) and only then would start the
next generation: torchrun's interpreter imports torch, the hosts' agents meet, torchrun spawns the workers, and each
worker imports torch again before its script's first line does anything. On a host whose cores the other ranks share
that is seconds, paid just when every host stops (``bench/bench_restart.py``: the ``first step`` phase).
:class:`Next` starts all of it while the job trains: at the current generation's first step on this host (its start
is over: nothing of it is slowed), else as soon as this host's generation has ended (always where the rendezvous
port is fixed: the current generation's torchrun holds it until then). :func:`start` starts it with
the next generation's argv and environment, plus ``DDP_LAUNCHER_HOLD``: the path of a file that does not exist yet.
Each worker's bootstrap (:mod:`launcher.bootstrap`) removes that variable from its environment, imports torch (with
``sys.path[0]`` the script's directory, as the script's own ``import torch`` would; importing initialises nothing of
CUDA) and waits for the file. :meth:`Ahead.go` creates it when node 0 decides to restart: the workers then run the
script as a fresh start does, with the same environment, ``sys.argv``, ``__main__``, signal dispositions and
parent-death signal (``tests/test_ahead.py``, ``tests/test_restart_jobs.py``), only with torch already imported. A
held torchrun that ended meanwhile (a held worker was killed, its rendezvous timed out) is never used: its host says
so at the generation's end (:meth:`Next.gone`), and node 0's decision has every host start the next generation
afresh, as without this (another host's held generation may have met the dead one's). Node 0 decides no restart, the
job ends, or a stop signal comes: :meth:`Ahead.cancel` kills the torchrun and its workers by PID (SIGKILL: no script
has run). It is started as torchrun is (:func:`launcher.supervise.start_torchrun`: its own session, SIGKILL when the
launcher dies, the forward-only signals ignored); supervise spares it (:meth:`Next.pids`) when it ends the current
generation's processes, and :func:`launcher.generations.run_generations` hands it to ``supervise`` as torchrun when
its launch is the generation's. Its workers write nothing before the go (their logs go to the generation's own
directory, :func:`launcher.command.for_generation`), so the last generation's evidence stays whole for the verdict.

Only while the budget allows another generation: a job that does not restart never starts one. What it costs while
held: one torchrun and one interpreter per local rank that imported torch, idle (their memory is in
``docs/recovery.md``). ``DDP_LAUNCHER_AHEAD`` in the launcher's environment: ``0`` turns it off (the next generation
then starts after the decision, its workers importing torch in the script), ``end`` starts it only when this host's
generation has ended (nothing held while the job trains). A script that sets a variable torch reads when it is
imported (not when CUDA starts) before its own ``import torch`` should set it in the job's environment, or turn this
off.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Mapping
from typing import Callable, Optional

from launcher import proctree
from launcher.command import GENERATION_VARIABLE, Launch
from launcher.supervise import start_torchrun

VARIABLE = "DDP_LAUNCHER_AHEAD"  # "0": off; "end": only at the end of a generation; else at its first step
HOLD_VARIABLE = "DDP_LAUNCHER_HOLD"  # as launcher/bootstrap.py reads it
MODULE = "torch.distributed.run"


class Ahead:
    """The next generation's torchrun, started ahead for ``launch``; its workers wait for :meth:`go`."""

    def __init__(self, proc: subprocess.Popen, launch: Launch, go_file: str) -> None:
        self.proc = proc
        self.launch = launch
        self.go_file = go_file

    def ended(self) -> bool:
        """True when torchrun has ended: its rendezvous failed, or it was killed."""
        return self.proc.poll() is not None

    def go(self) -> subprocess.Popen:
        """Let the workers run the script; the process."""
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


class Next:
    """This host's next generation while the current one runs: armed with its launch while the budget allows a
    restart (:meth:`arm`), started when :meth:`look` finds the current generation's first step (``due``), or by
    :meth:`now` at the generation's end; :meth:`take` hands it over when its generation comes."""

    def __init__(self, environ: Mapping[str, str], log: Callable[[str], None] = lambda _line: None) -> None:
        self.environ, self.log = environ, log
        self.mode = environ.get(VARIABLE, "")
        self.launch: Optional[Launch] = None
        self.due: Optional[Callable[[], bool]] = None
        self.ahead: Optional[Ahead] = None
        self.tried = False  # :meth:`look` started it once for this launch (or could not: off, no torchrun)

    def arm(self, launch: Optional[Launch], due: Optional[Callable[[], bool]]) -> None:
        """The next generation's ``launch`` (None: no restart can follow this generation), started once ``due``
        (None: only at the end, :meth:`now`)."""
        self.cancel()
        self.launch, self.due, self.tried = launch, due, False

    def look(self) -> None:
        """Start it if it is due (supervise calls this while the current generation runs, on its main thread)."""
        if not self.tried and self.launch is not None and self.due is not None and self.mode != "end" and self.due():
            self.now()
            if self.ahead is not None:
                self.log(f"the next generation started ahead at this one's first step (torchrun pid "
                         f"{self.ahead.proc.pid}): held before its script until a restart")

    def now(self) -> None:
        """Start it unless it was: this host's generation ended and a restart may follow."""
        if self.ahead is None and self.launch is not None:
            self.ahead, self.tried = start(self.launch, self.environ), True

    def gone(self) -> bool:
        """True when it was started and has ended meanwhile (a held process was killed, its rendezvous failed):
        node 0 then has every host start the next generation afresh (another host's may have met this one)."""
        return self.ahead is not None and self.ahead.ended()

    def take(self, launch: Launch) -> Optional[subprocess.Popen]:
        """Let go the generation of ``launch`` started ahead and return its torchrun; None (start it fresh)
        when none was started for it, or its torchrun ended meanwhile."""
        ready, self.ahead, self.launch, self.tried = self.ahead, None, None, False
        if ready is not None and ready.launch == launch and not ready.ended():
            return ready.go()
        if ready is not None and ready.ended():
            self.log(f"the generation started ahead here had ended (its torchrun exited with code "
                     f"{ready.proc.returncode}): it starts afresh")
        if ready is not None:
            ready.cancel()
        return None

    def pids(self) -> tuple[int, ...]:
        """The torchrun started ahead (its workers are its descendants), for supervise to spare."""
        return () if self.ahead is None else (self.ahead.proc.pid,)

    def cancel(self) -> None:
        """Kill what was started ahead, if anything."""
        ready, self.ahead = self.ahead, None
        if ready is not None:
            ready.cancel()
