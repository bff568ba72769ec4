"""No daemon escapes the job, whatever it changes, and losing the watchdog never costs the job.

The class: a worker's daemon that leaves the worker's tree (double fork), changes its session or its
process group, clears its whole environment (no job marker left), or several of these at once
(``tests/scripts/escaping_worker.py`` starts every combination in every rank); the launcher SIGKILLed
alone or with its process group. Then: the watchdog SIGKILLed alone (a warning, the job goes on and
exits 0), the watchdog and then the launcher SIGKILLed (the parent-death signals end torchrun and its
workers), and a worker's own parent-death signal (:func:`launcher.proctree.die_with_parent`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import PYTHON, REPO, assert_gone, is_alive
from test_guarantees_processes import (  # noqa: F401 (an autouse fixture: a failed test's job is ended)
    LONG_RUN,
    WORKER,
    Job,
    children,
    comm,
    end_what_a_failed_test_left,
    start,
)
from test_launcher_processes import make_host, records, wait_for_records

ESCAPING = os.path.join(REPO, "tests", "scripts", "escaping_worker.py")
sys.path.insert(0, os.path.dirname(ESCAPING))
from escaping_worker import WAYS  # noqa: E402


class Lines:
    """A stream's lines as they come (a thread reads them)."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, b""):
            self.lines.append(line.decode(errors="replace"))

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, f"no line with {text!r} in {self.lines[-20:]}"
            time.sleep(0.05)

    def text(self) -> str:
        self.thread.join(timeout=30)
        return "".join(self.lines)


def wait_for_daemons(base, ranks: int, timeout: float = 120.0) -> dict[str, int]:
    """way-rank -> the daemon's pid, once every way of every rank runs."""
    escape = base / "records" / "escape"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {p.name[:-5]: json.loads(p.read_text()) for p in escape.glob("*.json")} if escape.exists() else {}
        if len(found) == len(WAYS) * ranks:
            assert all(d["environ"] == 0 for k, d in found.items() if "clearenv" in k), found
            return {k: d["pid"] for k, d in found.items()}
        time.sleep(0.05)
    pytest.fail(f"the daemons did not all start: {sorted(found)}")


@pytest.mark.job
@pytest.mark.parametrize("kill", ["launcher alone", "launcher's process group"])
def test_no_daemon_escapes_whatever_it_changes(tmp_path, kill):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    proc = start(base, [ESCAPING])
    err = Lines(proc.stderr)
    wait_for_records(base, 2, timeout=150)
    daemons = wait_for_daemons(base, 2)
    workers = [r["pid"] for r in records(base).values()]
    for name, pid in daemons.items():
        assert is_alive(pid), name
        if name.startswith("double"):  # out of the worker's tree: the launcher (subreaper) has it
            assert all(pid not in children(w) for w in workers), name
            err.wait_for(f"process {pid} left torchrun's tree")
    job = Job(proc.pid, base)
    if kill == "launcher alone":
        proc.kill()
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    waited = job.assert_nothing_left(tuple(daemons.values()))
    print(f"\n{kill} SIGKILLed: {len(daemons)} daemons ({', '.join(WAYS)}) gone {waited:.2f} s later")


def the_watchdog(launcher: int) -> int:
    found = [c for c in children(launcher) if comm(c) == "ddp-watchdog"]
    assert len(found) == 1, children(launcher)
    return found[0]


@pytest.mark.job
def test_losing_the_watchdog_costs_a_warning_not_the_job(tmp_path):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    proc = start(base, [WORKER, "--steps", "60", "--step-sleep", "0.1"])
    err = Lines(proc.stderr)
    wait_for_records(base, 2, timeout=150, steps=1)
    watchdog = the_watchdog(proc.pid)
    os.kill(watchdog, signal.SIGKILL)
    err.wait_for(f"the watchdog (pid {watchdog}) is gone")
    proc.stdout.read()
    assert proc.wait(timeout=120) == 0
    text = err.text()
    assert "Traceback" not in text, text
    assert all(r["steps_done"] == 60 for r in records(base).values())


@pytest.mark.job
def test_watchdog_then_launcher_killed_torchrun_ends_the_workers(tmp_path):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    proc = start(base, [WORKER, *LONG_RUN])
    err = Lines(proc.stderr)
    wait_for_records(base, 2, timeout=150, steps=1)
    job = Job(proc.pid, base)
    os.kill(job.watchdogs[0], signal.SIGKILL)
    err.wait_for(f"the watchdog (pid {job.watchdogs[0]}) is gone")
    proc.kill()
    proc.wait(timeout=30)
    # The last line of defence: the kernel SIGKILLs torchrun (its parent-death signal), then sends each worker
    # SIGTERM (theirs, asked for by the bootstrap). With SIGTERM to torchrun instead, the kernel could send it
    # once per launcher thread as they died, and a second one inside torch's shutdown left torchrun waiting
    # for ever on its log tailers (seen under load: torchrun alive 90 s later, its workers gone).
    waited = assert_gone([*job.torchrun, *job.workers], within=90)
    print(f"\nwatchdog, then launcher SIGKILLed: torchrun and its workers gone {waited:.2f} s later")
    import shutil

    shutil.rmtree(job.run_dir, ignore_errors=True)  # no watchdog was left to remove it


def test_a_worker_that_asks_dies_with_its_parent(tmp_path):
    code = ("import os, sys, time\n"
            "from launcher import proctree\n"
            "if os.fork() == 0:\n"
            "    assert proctree.die_with_parent()\n"
            "    print(os.getpid(), flush=True)\n"
            "    time.sleep(600)\n"
            "time.sleep(600)\n")
    parent = subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": REPO})
    child = int(parent.stdout.readline())
    assert is_alive(child)
    parent.kill()
    parent.wait(timeout=30)
    assert_gone([child])
