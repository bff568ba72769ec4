"""The root cause of a failed job, the exit code that tells the truth, and the failure report.

torchrun exits 1 whatever happened. The facts are elsewhere:

- the "Root Cause (first observed failure)" table torchrun prints when a worker fails: global and
  local rank, the worker's exit code (negative: the signal that killed it), its error file;
- the error file torchrun writes to ``TORCHELASTIC_ERROR_FILE``: a copy of the root-cause worker's
  own (written by torch's ``record`` around the script's ``main``) with ``errorCode`` added, or
  torchrun's own exception when torchrun itself failed;
- the worker's stderr log under ``--log-dir``, when the worker wrote no error file.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

from launcher.cluster import Cluster
from launcher.command import Launch
from launcher.supervise import Outcome

REPORT_LIMIT = 1024  # SageMaker shows the first 1024 characters of output/failure
_FIELD = re.compile(r"^\s*(host|rank|exitcode|error_file|traceback)\s*:\s?(.*)$")
_RANK = re.compile(r"(-?\d+) \(local_rank: (-?\d+)\)")
_EXITCODE = re.compile(r"(-?\d+) \(pid: (\d+)\)")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b.*)$")


class RootCause(NamedTuple):
    """The first worker that failed on this host, or torchrun itself (``rank`` None)."""

    rank: Optional[int]
    local_rank: Optional[int]
    exitcode: Optional[int]  # the worker's own; negative: killed by that signal
    exception: str  # "ValueError: bad input", or what is known instead
    detail: str  # traceback or stderr tail


def signal_name(number: int) -> str:
    """``9`` -> ``SIGKILL``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def parse_failure_table(lines: Sequence[str]) -> Optional[dict[str, str]]:
    """The fields of the last "Root Cause (first observed failure)" table in torchrun's stderr."""
    starts = [i for i, line in enumerate(lines) if "Root Cause (first observed failure):" in line]
    if not starts:
        return None
    fields: dict[str, str] = {}
    current = None
    for line in lines[starts[-1] + 1:]:
        if line.startswith("====="):
            break
        match = _FIELD.match(line)
        if match:
            current = match.group(1)
            fields[current] = match.group(2).strip()
        elif current == "traceback":
            fields["traceback"] += "\n" + line
    return fields


def read_error_file(path: Optional[str]) -> Optional[dict[str, Any]]:
    """``{"exception", "traceback", "errorCode"}`` from a torchelastic error file, if readable."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        return {"exception": str(message.get("message", "")).strip(),
                "traceback": str(extra.get("py_callstack", "")),
                "errorCode": data.get("errorCode")}
    return {"exception": str(message or "").strip(), "traceback": "", "errorCode": data.get("errorCode")}


def worker_stderr(log_dir: str, local_rank: int) -> str:
    """The newest attempt's stderr log of one local rank, as torchrun's ``--log-dir`` keeps it."""
    import glob  # only after a failure

    paths = glob.glob(os.path.join(log_dir, "*", "attempt_*", str(local_rank), "stderr.log"))
    if not paths:
        return ""
    newest = max(paths, key=lambda p: int(p.split("attempt_")[-1].split(os.sep)[0]))
    try:
        with open(newest, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _last_exception_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            return match.group(1)
    return ""


def find_root_cause(outcome: Outcome, launch: Launch) -> Optional[RootCause]:
    """What failed on this host, from torchrun's table, error files and logs; None if it succeeded."""
    if outcome.returncode == 0:
        return None
    table = parse_failure_table(outcome.stderr_tail)
    if table is None:
        # torchrun itself failed (rendezvous, bad flag) or was killed: its own error file or stderr.
        own = read_error_file(launch.error_file)
        stderr = "\n".join(outcome.stderr_tail)
        exception = (own or {}).get("exception") or _last_exception_line(stderr)
        if not exception and outcome.returncode < 0:
            exception = f"torchrun was killed by {signal_name(-outcome.returncode)}"
        return RootCause(None, None, None, exception or "torchrun failed",
                         (own or {}).get("traceback") or stderr)
    rank_match = _RANK.match(table.get("rank", ""))
    code_match = _EXITCODE.match(table.get("exitcode", ""))
    rank = int(rank_match.group(1)) if rank_match else None
    local_rank = int(rank_match.group(2)) if rank_match else None
    exitcode = int(code_match.group(1)) if code_match else None
    recorded = read_error_file(launch.error_file) or read_error_file(table.get("error_file"))
    if recorded and recorded["exception"]:
        return RootCause(rank, local_rank, exitcode, recorded["exception"], recorded["traceback"])
    stderr = worker_stderr(launch.log_dir, local_rank) if local_rank is not None else ""
    exception = _last_exception_line(stderr)
    if not exception and exitcode is not None and exitcode < 0:
        exception = f"killed by {signal_name(-exitcode)}"
    return RootCause(rank, local_rank, exitcode, exception, stderr)


def exit_code(outcome: Outcome, cause: Optional[RootCause]) -> int:
    """0 only if every worker succeeded; else the root cause's own code, 128+N for signal N.

    A launcher stopped by signal N whose workers did not all finish cleanly exits 128+N.
    """
    if outcome.returncode == 0:
        return 0
    if outcome.stop_signal is not None:
        return 128 + outcome.stop_signal
    code = cause.exitcode if cause is not None and cause.exitcode else outcome.returncode
    return code if code > 0 else 128 - code


def _is_marker(line: str) -> bool:
    """Python 3.11's ``^^^^~~~`` lines under a traceback's code: no information, only length."""
    return set(line.strip()) <= set("^~ ")


def compose_report(cluster: Cluster, outcome: Outcome, cause: Optional[RootCause], code: int,
                   rendezvous: str = "") -> str:
    """At most 1024 characters: the root cause first, then the traceback's tail.

    ``rendezvous`` (e.g. ``algo-1:7777, timeout 900 s``) is named when torchrun itself failed.
    """
    host = cluster.current_host
    if outcome.stop_signal is not None:
        head = (f"{host}: stopped by {signal_name(outcome.stop_signal)} and the workers did not finish "
                f"cleanly (exit code {code})")
    elif cause is None or cause.rank is None:
        head = f"{host}: torchrun failed before or around the workers (exit code {code})"
        if rendezvous:
            head += f"; rendezvous {rendezvous}"
    elif cause.exitcode is not None and cause.exitcode < 0:
        head = (f"{host}: rank {cause.rank} (local rank {cause.local_rank}) was killed by "
                f"{signal_name(-cause.exitcode)} (exit code {code})")
    else:
        head = f"{host}: rank {cause.rank} (local rank {cause.local_rank}) exited with code {code}"
    lines = [head]
    if cause is not None and cause.exception:
        lines.append(cause.exception[:300])
    text = "\n".join(lines)
    detail = [ln for ln in (cause.detail.splitlines() if cause else []) if ln.strip() and not _is_marker(ln)]
    tail: list[str] = []
    budget = REPORT_LIMIT - len(text) - 1
    for line in reversed(detail):
        if line.strip() == (cause.exception if cause else "").strip() and not tail:
            continue  # the exception line is already in the head
        if len(line) + 1 > budget:
            break
        tail.insert(0, line)
        budget -= len(line) + 1
    if tail:
        text += "\n" + "\n".join(tail)
    return text[:REPORT_LIMIT]


def write_failure_file(path: str, report: str) -> str:
    """Write the report where the platform shows it (SageMaker: ``output/failure``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(report)
    return path
