"""What the benchmarks share: a clean environment for the jobs they start (with a TMPDIR of the bench's own), a
free port, a liveness check, and how results are printed (a median with its middle half, a Markdown table)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import socket
import statistics
import tempfile
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# another job's variables: a benchmark's jobs must not inherit a platform's description from the shell
FOREIGN_PREFIXES = ("SM_", "LAUNCHER_", "SAGEMAKER_", "TORCHELASTIC_", "PET_")


@functools.cache
def bench_tmpdir() -> str:
    """The TMPDIR of every job this bench starts, removed when the bench exits: plain torchrun leaves a
    ``torchelastic_*`` directory in TMPDIR at every run, and a host powered off on purpose its launcher's
    run directory."""
    path = tempfile.mkdtemp(prefix="bench-tmp-")
    atexit.register(shutil.rmtree, path, True)
    return path


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without another job's variables, the repository importable, the bench's TMPDIR,
    ``extra`` added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_PREFIXES)}
    env.update(PYTHONPATH=REPO, TMPDIR=bench_tmpdir())
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


def spread(values: Sequence[float]) -> str:
    """The median and the middle half: ``1.016 (0.993-1.073)``."""
    quarters = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{quarters[1]:.3f} ({quarters[0]:.3f}-{quarters[2]:.3f})"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table, its columns padded to one width."""
    table = [list(header), *map(list, rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = []
    for i, row in enumerate(table):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
