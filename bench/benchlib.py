"""What the benchmarks share: a clean environment for the jobs they start, a free port, a liveness check."""

from __future__ import annotations

import os
import socket

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# another job's variables: a benchmark's jobs must not inherit a platform's description from the shell
FOREIGN_PREFIXES = ("SM_", "LAUNCHER_", "SAGEMAKER_", "TORCHELASTIC_", "PET_")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without another job's variables, the repository importable, ``extra`` added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_PREFIXES)}
    env["PYTHONPATH"] = REPO
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"
