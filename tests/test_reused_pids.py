"""A PID names a process only with its start time: the watchdogs never kill a process that was given the
PID of one they guarded after it ended (launcher/proctree.py).

A launcher's watchdog guards each torchrun it starts, and simulate's guards each host. Should the
launcher (or simulate) die later, the watchdog kills what it guards. A guarded process may have ended
long before (an earlier generation's torchrun, a host that exited), and on a busy machine its PID is
given to another process within minutes (``kernel.pid_max`` 32768 here): a simulated host's launcher
once died of SIGKILL that way, no fault asked for. The test makes the reuse certain: in a PID namespace
of its own, the next PID is chosen.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from conftest import PYTHON, REPO

SCRIPT = os.path.join(REPO, "tests", "scripts", "reused_pid.py")


def pid_namespace_refused() -> str:
    """Why a PID namespace with a chosen next PID cannot be made here; "" when it can."""
    if os.geteuid() != 0:
        return "needs root (ns_last_pid is written with CAP_SYS_ADMIN)"
    if shutil.which("unshare") is None:
        return "unshare not found on PATH"
    return ""


@pytest.mark.skipif(bool(pid_namespace_refused()), reason=pid_namespace_refused())
def test_a_watchdog_spares_the_process_that_was_given_a_guarded_pid():
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PYTHON, SCRIPT], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts == {"reused": True, "new_alive": True, "live_alive": False}, facts
