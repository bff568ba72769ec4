"""A PID names a process only with its start time: the watchdogs never kill a process that was given the
PID of one they guarded after it ended (launcher/proctree.py).

A launcher's watchdog guards each torchrun it starts, and simulate's guards each host. Should the
launcher (or simulate) die later, the watchdog kills what it guards. A guarded process may have ended
long before (an earlier generation's torchrun, a host that exited), and on a busy machine its PID is
given to another process within minutes (``kernel.pid_max`` 32768 here): a simulated host's launcher
once died of SIGKILL that way, no fault asked for. The test makes the reuse certain: in a PID namespace
of its own, the next PID is chosen: once for a lone process, once for a simulated DataLoader-hang job
whose hosts are all given such PIDs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess

import pytest
from conftest import PYTHON, REPO

SCRIPT = os.path.join(REPO, "tests", "scripts", "reused_pid.py")
STALE = os.path.join(REPO, "tests", "scripts", "stale_guard.py")


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


@pytest.mark.job
@pytest.mark.skipif(bool(pid_namespace_refused()), reason=pid_namespace_refused())
def test_a_simulated_host_survives_a_watchdog_that_guarded_its_pid_before(tmp_path):
    """The DataLoader-hang job on 2 simulated hosts, started on PIDs that another launcher's watchdog still
    guards from processes that ended; that launcher dies while rank 1's loader worker hangs. Before the
    fix, the watchdog killed every host's tree (and simulate): "algo-2 was lost", no fault asked for."""
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PYTHON, STALE, str(tmp_path / "w"), "300"],
                          capture_output=True, text=True, timeout=540, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["hung"] and facts["reused"], facts["stderr"]  # the shape was in place, on a guarded PID
    assert facts["survived"] and facts["simulate"] == 143, facts["stderr"]
    hosts = {h["host"]: h for h in facts["summary"]["hosts"]}
    assert {name: (h["exit_code"], h["outcome"]) for name, h in hosts.items()} == {
        name: (143, "stopped: SIGTERM from the user") for name in ("algo-1", "algo-2")}, facts["stderr"]
    left = []  # the namespace ended with its first process: nothing of it may be left on the machine
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{name}/ns/pid") == facts["namespace"]:
                left.append(int(name))
    assert left == []
