"""Shared test helpers: free ports, the repository's paths, and proof that no process is left."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterable

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
TRAIN_SCRIPTS = os.path.join(REPO, "train_scripts")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (an exited process nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def assert_gone(pids: Iterable[int], within: float = 10.0) -> float:
    """Wait until none of ``pids`` is alive; fail naming the survivors. Returns the wait."""
    pids = [int(p) for p in pids]
    assert pids, "no PIDs were recorded: the test cannot prove that nothing is left"
    start = time.monotonic()
    while True:
        alive = [p for p in pids if is_alive(p)]
        if not alive:
            return time.monotonic() - start
        if time.monotonic() - start > within:
            pytest.fail(f"processes still alive {within} s later: {alive}")
        time.sleep(0.05)


def launcher_env(**extra: str) -> dict[str, str]:
    """The environment for a launcher started by a test: the repository importable, no SM_* leaks."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SM_", "LAUNCHER_", "SAGEMAKER_", "TORCHELASTIC_", "PET_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env
