"""A non-master host that gets no rendezvous fails within the rendezvous timeout, saying which way."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time

import pytest
from conftest import PYTHON, free_port, is_alive, launcher_env

from launcher import codes
from launcher.cli import RENDEZVOUS_MARGIN

TIMEOUT = 2


def second_host(tmp_path):
    config = tmp_path / "input" / "config"
    config.mkdir(parents=True)
    (tmp_path / "output").mkdir()  # as in a SageMaker container: the outcome file goes to output/data
    (config / "resourceconfig.json").write_text('{"current_host": "algo-2", "hosts": ["algo-1", "algo-2"]}')
    (tmp_path / "train.py").write_text("print('never runs')\n")


def processes_of(tmp_path) -> list[int]:
    """Every living process started for this host (they all inherit its SAGEMAKER_BASE_DIR)."""
    needle, found = f"SAGEMAKER_BASE_DIR={tmp_path}".encode(), []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0") and is_alive(int(name)):
                    found.append(int(name))
        except OSError:
            pass
    return found


def run_second_host(tmp_path, port):
    env = launcher_env(SAGEMAKER_BASE_DIR=str(tmp_path), LAUNCHER_MASTER_PORT=str(port),
                       LAUNCHER_RESOLVE="algo-1=127.0.0.1,algo-2=127.0.0.1", LAUNCHER_RDZV_TIMEOUT=str(TIMEOUT),
                       LAUNCHER_NO_JOB_WATCH="true")
    start = time.monotonic()
    proc = subprocess.run([PYTHON, "-m", "launcher", "train.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert processes_of(tmp_path) == []  # torchrun and everything it started are gone
    return proc, time.monotonic() - start, (tmp_path / "output" / "failure").read_text()


def outcome_of(base):
    """The outcome file SageMaker's host wrote (output/data/outcome.json)."""
    return json.loads((base / "output" / "data" / "outcome.json").read_text())



@pytest.mark.job
def test_a_port_held_by_another_program_ends_the_launch(tmp_path):
    # Something accepts connections on the master's port and says nothing: torchrun's store client
    # would wait for as long as it stays open. The launcher ends it after the rendezvous timeout.
    second_host(tmp_path)
    server = socket.create_server(("127.0.0.1", 0))
    port, accepted, done = server.getsockname()[1], [], threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not done.is_set():
            with contextlib.suppress(OSError):  # the accept timed out: look at `done` again
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        proc, took, report = run_second_host(tmp_path, port)
    finally:
        done.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()
    assert proc.returncode == codes.RENDEZVOUS_CODE, proc.stderr[-2000:]
    assert outcome_of(tmp_path)["class"] == codes.RENDEZVOUS
    assert took < TIMEOUT + RENDEZVOUS_MARGIN + 60  # bounded (torch's import is slow on a loaded machine)
    assert "no rendezvous within the timeout" in report
    assert f"127.0.0.1:{port} answers but gave no rendezvous" in report
    assert report in proc.stderr


@pytest.mark.job
def test_a_master_that_never_answers_is_named(tmp_path):
    second_host(tmp_path)
    port = free_port()
    proc, _took, report = run_second_host(tmp_path, port)
    assert proc.returncode == codes.RENDEZVOUS_CODE, proc.stderr[-2000:]
    assert outcome_of(tmp_path)["class"] == codes.RENDEZVOUS
    assert report.startswith("algo-2: torchrun failed before or around the workers")
    assert f"rendezvous algo-1:{port} as node 1 of 2, timeout {TIMEOUT} s" in report
    assert "trying to connect" in report or "never answered" in report, report
