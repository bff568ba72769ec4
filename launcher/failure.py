"""The root cause of a failed job, the exit code that tells the truth, and the failure report.

torchrun exits 1 whatever happened. The facts are elsewhere:

- the "Root Cause (first observed failure)" table torchrun prints when a worker fails: global and
  local rank, the worker's exit code (negative: the signal that killed it), its error file;
- the error file torchrun writes to ``TORCHELASTIC_ERROR_FILE``: a copy of the root-cause worker's
  own (written by torch's ``record`` around the script's ``main``) with ``errorCode`` added, or
  torchrun's own exception when torchrun itself failed;
- the worker's stderr log under ``--log-dir``, when the worker wrote no error file;
- the code the worker's script asked for (``sys.exit(7)``; 1 for an uncaught exception), recorded by
  :mod:`launcher.bootstrap` before interpreter teardown: a crash in teardown (torch's threads aborting
  with "terminate called without an active exception") changes what torchrun saw, not the code the
  launcher reports. A teardown crash after a normal end (code 0) is still a failure: torchrun stopped
  the other workers because of it, and their work may be unfinished.

Everything read here is written by the workers, so every read is bounded: the stderr tail the
supervisor kept, the last :data:`LOG_TAIL_BYTES` of a log, error files up to :data:`ERROR_FILE_LIMIT`.
The report always gets out: writing it never raises, and it reaches stderr whatever happened to the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple, Optional

from launcher.cluster import Cluster
from launcher.codes import RENDEZVOUS_CODE
from launcher.command import Launch
from launcher.errors import ConfigError
from launcher.failuretime import FailedAt, earlier
from launcher.filereader import read_bounded
from launcher.filewriter import replace_file
from launcher.outcome import Death, Outcome

REPORT_LIMIT = 1024  # SageMaker shows the first 1024 characters of output/failure
ERROR_FILE_LIMIT = 4 * 1024 * 1024  # a larger error file is not read: the log tail is used instead
LOG_TAIL_BYTES = 256 * 1024  # how much of the end of a worker's stderr log is read
LOG_LINE_CHARS = 2048  # longer lines of a log tail are cut
_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*)$")
_ENTRY = re.compile(r"^\[\d+\]:\s*$")
_RANK = re.compile(r"(-?\d+) \(local_rank: (-?\d+)\)")
_EXITCODE = re.compile(r"(-?\d+) \(pid: (\d+)\)")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b.*)$")
# What torch and the launcher put before a worker's line: the copy's rank prefix (the launcher's
# "[rank3]:", torchrun's --tee default "[default0]:"), torch's excepthook "[rank3]: " after init_process_group,
# any of them nested; then a C++ log template ("[W1125 03:04:05.123 pid file.cpp:12] ...") marks a log line.
_LINE_PREFIX = re.compile(r"^\s*\[[A-Za-z_]*\d+\]:[ \t]?")
_LOG_TEMPLATE = re.compile(r"^\s*\[[IWEF]\d{4} ")
_NOISE = re.compile(r"^\s*\[[IW]\d{4} ")  # C++ info and warning lines: never part of a report


# How a rank's failure reads when a peer's process ended under it: gloo's pair.cc (read of 0 bytes; ECONNRESET;
# EPIPE), NCCL's ncclRemoteError and its socket layer, torch's TCPStore client (DistNetworkError).
LOST_PEER = re.compile(r"Connection (?:closed|reset) by (?:remote )?peer|remote process exited|Broken pipe"
                       r"|failed to recv, got 0 bytes")


class RootCause(NamedTuple):
    """The first worker that failed on this host, or torchrun itself (``rank`` None)."""

    rank: Optional[int]
    local_rank: Optional[int]
    exitcode: Optional[int]  # the worker's own; negative: killed by that signal
    exception: str  # "ValueError: bad input", or what is known instead
    detail: str  # traceback or stderr tail
    asked: Optional[int] = None  # the code the script asked for, when teardown then ended it otherwise
    teardown: str = ""  # what ended it in teardown: "aborted: terminate called without an active exception"
    oom: str = ""  # the OOM killer's evidence when it sent the SIGKILL (launcher.oom.evidence)
    oom_what: str = ""  # what it killed, after "ran out of memory: " (launcher.oom.explain)
    at: Optional[float] = None  # time.time() when it failed: its exit record, else its death; None: not known
    note: str = ""  # what happened before it that explains it (:func:`ended_before`)


def signal_name(number: int) -> str:
    """``9`` -> ``SIGKILL``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _entries(lines: Sequence[str]) -> list[dict[str, str]]:
    """The ``[i]:`` entries of one section of torchrun's failure table, up to its closing rule."""
    entries: list[dict[str, str]] = []
    field = None
    for line in lines:
        if line.startswith(("=====", "-----")):
            break
        if _ENTRY.match(line):
            entries.append({})
            field = None
        elif entries and field == "traceback":  # the last field: everything up to the next entry
            entries[-1]["traceback"] += "\n" + line
        elif entries:
            match = _FIELD.match(line)
            if match:
                field = match.group(1)
                entries[-1][field] = match.group(2).strip()
    return entries


def parse_failures(lines: Sequence[str]) -> list[dict[str, str]]:
    """Every entry of the last failure table in torchrun's stderr: the root cause first, then the others.

    torchrun prints ``Failures:`` (the others, or ``<NO_OTHER_FAILURES>``) and then
    ``Root Cause (first observed failure):``; each entry has ``time``, ``host``, ``rank``, ``exitcode``,
    ``error_file`` and ``traceback`` fields.
    """
    roots = [i for i, line in enumerate(lines) if "Root Cause (first observed failure):" in line]
    if not roots:
        return []
    entries = _entries(lines[roots[-1] + 1:])[:1]
    others = [i for i in range(roots[-1]) if lines[i].strip() == "Failures:"]
    if others:
        entries += _entries(lines[others[-1] + 1:roots[-1]])
    return entries


def _exitcode(entry: dict[str, str]) -> Optional[int]:
    match = _EXITCODE.match(entry.get("exitcode", ""))
    return int(match.group(1)) if match else None


def pick_root_cause(entries: Sequence[dict[str, str]],
                    when: Callable[[dict[str, str]], FailedAt] = lambda entry: FailedAt(None, None)
                    ) -> dict[str, str]:
    """The first worker of the table to fail on its own: the earliest by ``when`` (:func:`launcher.failuretime.earlier`;
    ties: the table's order, torchrun's "first observed failure" first) of those not killed by SIGTERM.

    When one worker fails, torchrun SIGTERMs the others; without error files its "first observed
    failure" can name one of those on a timestamp tie. A worker killed by SIGTERM is never the cause
    when another failed otherwise (an exit code, another signal).
    """
    own = [e for e in entries if _exitcode(e) != -signal.SIGTERM]
    if not own:
        return entries[0]
    first = own[0]
    for entry in own[1:]:
        if earlier(when(entry), when(first)):
            first = entry
    return first


def _read_bounded(path: str, limit: int) -> Optional[bytes]:
    """The file's bytes if it is a regular file of at most ``limit`` bytes (never blocks)."""
    try:
        return read_bounded(path, limit, "")
    except ConfigError:
        return None


def read_error_file(path: Optional[str]) -> Optional[dict[str, Any]]:
    """``{"exception", "traceback", "errorCode"}`` from a torchelastic error file, if readable.

    Files over :data:`ERROR_FILE_LIMIT` or not in the expected shape give None.
    """
    if not path or not os.path.isfile(path):
        return None
    raw = _read_bounded(path, ERROR_FILE_LIMIT)
    try:
        data = json.loads(raw.decode("utf-8", "surrogateescape")) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        callstack = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
        return {"exception": str(message.get("message", "")).strip(), "traceback": str(callstack),
                "errorCode": data.get("errorCode")}
    return {"exception": str(message or "").strip(), "traceback": "", "errorCode": data.get("errorCode")}


def read_log_tail(path: str, size: int = LOG_TAIL_BYTES) -> str:
    """The last ``size`` bytes of a log, from its first whole line, lines cut to :data:`LOG_LINE_CHARS`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO there must not block
    except OSError:
        return ""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return ""
        start = max(0, info.st_size - size)
        data = os.pread(fd, size, start)
    except OSError:
        return ""
    finally:
        os.close(fd)
    if start > 0:
        data = data[data.find(b"\n") + 1:] if b"\n" in data else data
    lines = data.decode("utf-8", "replace").splitlines()
    return "\n".join(line[:LOG_LINE_CHARS] for line in lines)


def worker_log(log_dir: str, local_rank: int) -> Optional[str]:
    """The newest attempt's stderr log of one local rank, as torchrun's ``--log-dir`` keeps it."""
    import glob  # only after a failure

    paths = glob.glob(os.path.join(log_dir, "*", "attempt_*", str(local_rank), "stderr.log"))
    if not paths:
        return None
    return max(paths, key=lambda p: int(p.split("attempt_")[-1].split(os.sep)[0]))


def worker_stderr(log_dir: str, local_rank: int) -> str:
    """The end of the newest attempt's stderr log of one local rank."""
    path = worker_log(log_dir, local_rank)
    return read_log_tail(path) if path else ""


TEARDOWN_BYTES = 4096  # how much of a worker's stderr after its script ended is read


def read_exit_record(exit_dir: str, pid: int) -> Optional[dict[str, Any]]:
    """``{"code", "stderr_offset", "started", "ended"}`` that :mod:`launcher.bootstrap` wrote for worker ``pid``."""
    raw = _read_bounded(os.path.join(exit_dir, f"{pid}.json"), 1024)
    try:
        data = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(data, dict) or type(data.get("code")) is not int or not 0 <= data["code"] <= 255:
        return None
    offset = data.get("stderr_offset")
    return {"code": data["code"], "stderr_offset": offset if type(offset) is int and offset >= 0 else None,
            "started": _moment(data.get("started")), "ended": _moment(data.get("ended"))}


def _moment(value: object) -> Optional[float]:
    """A ``time.time()`` from a record: a finite positive number, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e11:
        return None
    return float(value)


def first_worker_start(exit_dir: str, limit: int = 4096) -> Optional[float]:
    """When the earliest worker that recorded its code started (``time.time()``): the rendezvous was done."""
    try:  # the records only: the directory holds the workers' other files too (<pid>.thread, <pid>.parked)
        names = sorted(name for name in os.listdir(exit_dir) if name.endswith(".json") and name[:-5].isdigit())
    except OSError:
        return None
    starts = [record["started"] for name in names[:limit]
              for record in [read_exit_record(exit_dir, int(name[:-5]))] if record and record["started"]]
    return min(starts) if starts else None


def _stderr_after(path: Optional[str], offset: Optional[int]) -> str:
    """The first non-empty line a worker wrote to its stderr log after ``offset`` (its teardown's words)."""
    if path is None or offset is None:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read(TEARDOWN_BYTES)
    except OSError:
        return ""
    lines = [strip_prefixes(line).strip() for line in data.decode("utf-8", "replace").splitlines()]
    return next((line[:200] for line in lines if line), "")


def teardown_text(exitcode: int, words: str) -> str:
    """What ended a worker after its script did: ``aborted in interpreter teardown: terminate called ...``."""
    if exitcode == -signal.SIGABRT:
        how = "aborted"
    elif exitcode < 0:
        how = f"was killed by {signal_name(-exitcode)}"
    else:
        how = f"exited with code {exitcode}"
    return f"{how} in interpreter teardown" + (f": {words}" if words else "")


def strip_prefixes(line: str) -> str:
    """``line`` without the rank and tee prefixes torch and the launcher put before it."""
    while True:
        match = _LINE_PREFIX.match(line)
        if not match:
            return line
        line = line[match.end():]


def exception_line(line: str) -> str:
    """The exception ``line`` names (``ValueError: bad``) whatever prefixes it has; "" for any other line."""
    bare = strip_prefixes(line)
    if _LOG_TEMPLATE.match(bare):
        return ""  # a C++ log line that mentions an error is not the exception
    match = _EXCEPTION_LINE.match(bare.strip())
    return match.group(1) if match else ""


def _last_exception_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        found = exception_line(line)
        if found:
            return found
    return ""


def find_root_cause(outcome: Outcome, launch: Launch) -> Optional[RootCause]:
    """What failed on this host, from torchrun's table, error files and logs; None if it succeeded."""
    if outcome.returncode == 0:
        return None
    if outcome.no_rendezvous:
        return RootCause(None, None, None, "no rendezvous within the timeout: no worker was started",
                         "\n".join(outcome.stderr_tail))
    entries = parse_failures(outcome.stderr_tail) or _deaths_before_stop(outcome)
    if not entries:
        # torchrun itself failed (rendezvous, bad flag) or was killed: its own error file or stderr.
        own = read_error_file(launch.error_file)
        stderr = "\n".join(outcome.stderr_tail)
        exception = (own or {}).get("exception") or _last_exception_line(stderr)
        if not exception and outcome.returncode < 0:
            exception = f"torchrun was killed by {signal_name(-outcome.returncode)}"
        return RootCause(None, None, None, exception or "torchrun failed",
                         (own or {}).get("traceback") or stderr)
    # The first to fail in time, by the exit records bootstrap writes as each script ends and, for a worker that
    # wrote none (a signal, os._exit), its death as the kernel told it (launcher.deaths): what an exception says
    # is no evidence.
    first = pick_root_cause(entries, lambda entry: _failed_when(entry, launch.exit_dir, outcome.deaths))
    cause = _cause_of(first, first is entries[0], launch)._replace(
        at=_failed_when(first, launch.exit_dir, outcome.deaths).first())
    return cause._replace(note=ended_before(outcome, cause, launch.exit_dir))


def ended_before(outcome: Outcome, cause: RootCause, exit_dir: str) -> str:
    """When ``cause`` is a lost peer (:data:`LOST_PEER`): a rank of this host whose script had ended with exit
    code 0 before it failed, said in one line; "" if none. A rank that ends closes its connections, and a peer
    still in a collective fails on them ("Connection closed by peer ... typically caused by a remote worker
    crashing"): the failure reads as a crash's consequence, and the crash was a clean end (a rank with fewer
    batches than the others). Its death as the kernel told it (:mod:`launcher.deaths`), dated by its exit record
    where it wrote one."""
    if outcome.stop_signal is not None or cause.rank is None or cause.at is None:
        return ""
    if not LOST_PEER.search(cause.exception) and not LOST_PEER.search(cause.detail[-LOG_TAIL_BYTES:]):
        return ""
    clean = []
    for pid, death in outcome.deaths.items():
        record = read_exit_record(exit_dir, pid)
        code = death.code if death.code is not None else (record or {}).get("code")
        ended = (record or {}).get("ended") or death.at
        if code == 0 and death.rank is not None and death.rank != cause.rank and ended < cause.at:
            clean.append((ended, death.rank, death.local_rank))
    if not clean:
        return ""
    ended, rank, local_rank = min(clean)
    others = f" (and {len(clean) - 1} other rank{'s' if len(clean) > 2 else ''} of this host)" if len(clean) > 1 else ""
    return (f"rank {rank} (local rank {local_rank}){others} had ended its script with exit code 0, "
            f"{max(0.0, cause.at - ended):.1f} s before: a rank that ends while the others still run collectives "
            "closes its connections, and they fail on them (does every rank run the same number of steps?)")


def _deaths_before_stop(outcome: Outcome) -> list[dict[str, str]]:
    """Table entries, as torchrun prints them, for the workers that failed before a stop ended torchrun without
    its table (stopped before its next look): each one's rank and code as the kernel told them."""
    if outcome.stopped_at is None:
        return []
    return [{"rank": f"{d.rank} (local_rank: {d.local_rank})", "exitcode": f"{d.code} (pid: {pid})",
             "error_file": "<N/A>", "traceback": ""}
            for pid, d in sorted(outcome.deaths.items(), key=lambda item: item[1].at)
            if d.code and d.rank is not None and d.local_rank is not None and d.at < outcome.stopped_at]


def failed_before_stop(outcome: Outcome, cause: Optional[RootCause]) -> bool:
    """Whether a worker of this host failed on its own before a stop reached the workers (a stop signal, or the
    job watch's stop for another host's failure): that failure is this host's end, not the stop."""
    return (outcome.stopped_at is not None and cause is not None and cause.rank is not None and cause.at is not None
            and cause.at < outcome.stopped_at)


def _failed_when(entry: dict[str, str], exit_dir: str, deaths: Mapping[int, Death]) -> FailedAt:
    """When the worker of a table entry failed: its exit record's time when its script ended with a non-zero code,
    and its death (``deaths``)."""
    pid = _entry_pid(entry)
    if pid is None:
        return FailedAt(None, None)
    return FailedAt(failed_at(exit_dir, pid), deaths[pid].at if pid in deaths else None)


def _entry_pid(entry: dict[str, str]) -> Optional[int]:
    """The worker's pid in a table entry (``exitcode : 1 (pid: 7550)``); None without one."""
    match = _EXITCODE.match(entry.get("exitcode", ""))
    return int(match.group(2)) if match else None


def failed_at(exit_dir: str, pid: int) -> Optional[float]:
    """When worker ``pid``'s script ended with a non-zero code (``time.time()``: its exit record's ``ended``, or
    the record's modification time from a bootstrap that wrote none); None without such a record."""
    record = read_exit_record(exit_dir, pid)
    if record is None or record["code"] == 0:
        return None
    if record["ended"] is not None:
        return record["ended"]
    try:
        return os.stat(os.path.join(exit_dir, f"{pid}.json")).st_mtime
    except OSError:
        return None


def host_failure(outcome: Outcome, exit_dir: str) -> Optional[FailedAt]:
    """This host's first failure (``time.time()``): of the workers with an exit record with a non-zero code (written
    as the script ended) or a death with a non-zero code (``outcome.deaths``; one that wrote no record: a signal,
    ``os._exit``), the first by :func:`launcher.failuretime.earlier`. None when no worker is known to have failed."""
    try:
        names = os.listdir(exit_dir)
    except OSError:
        names = []
    records = {int(name[:-5]) for name in names if name.endswith(".json") and name[:-5].isdigit()}
    table = {_entry_pid(entry) for entry in parse_failures(outcome.stderr_tail)}
    pids = {pid for pid in records if failed_at(exit_dir, pid) is not None}
    # a death whose code was reaped before it was read: a failure when torchrun's table has it, or when the worker
    # wrote no record at all (a clean end always writes one)
    pids |= {pid for pid, death in outcome.deaths.items()
             if death.code or (death.code is None and (pid in table or pid not in records))}
    failures = [FailedAt(failed_at(exit_dir, pid), outcome.deaths[pid].at if pid in outcome.deaths else None)
                for pid in sorted(pids)]
    first = None
    for failed in failures:
        if first is None or earlier(failed, first):
            first = failed
    return first


def first_failure(outcome: Outcome, exit_dir: str, ended: float) -> float:
    """When this host's first worker failed (:func:`host_failure`'s earliest time, monotonic); ``ended`` (the
    generation's end) when none is known to have failed."""
    first = host_failure(outcome, exit_dir)
    known = None if first is None else first.first()
    return ended if known is None else min(ended, time.monotonic() - (time.time() - known))


def _cause_of(entry: dict[str, str], table_root: bool, launch: Launch) -> RootCause:
    """One failed worker of torchrun's table, with its exception from its error file or its stderr log."""
    rank_match = _RANK.match(entry.get("rank", ""))
    rank = int(rank_match.group(1)) if rank_match else None
    local_rank = int(rank_match.group(2)) if rank_match else None
    exitcode = _exitcode(entry)
    asked, teardown = _asked_code(entry, exitcode, launch, local_rank)
    # torchrun copies the table's root cause's error file to its own: only that one's is trusted there.
    recorded = ((read_error_file(launch.error_file) if table_root else None)
                or read_error_file(entry.get("error_file")))
    if recorded and recorded["exception"]:
        return RootCause(rank, local_rank, exitcode, recorded["exception"], recorded["traceback"], asked, teardown)
    stderr = worker_stderr(launch.log_dir, local_rank) if local_rank is not None else ""
    exception = _last_exception_line(stderr)
    if not exception and exitcode is not None and exitcode < 0 and asked is None:
        exception = f"killed by {signal_name(-exitcode)}"
    return RootCause(rank, local_rank, exitcode, exception, stderr, asked, teardown)


def _asked_code(entry: dict[str, str], exitcode: Optional[int], launch: Launch,
                local_rank: Optional[int]) -> tuple[Optional[int], str]:
    """The non-zero code the worker's script asked for and how teardown then ended it, when the two differ."""
    match = _EXITCODE.match(entry.get("exitcode", ""))
    if not match or exitcode is None:
        return None, ""
    record = read_exit_record(launch.exit_dir, int(match.group(2)))
    if record is None or record["code"] == 0 or record["code"] == exitcode:
        return None, ""
    log = worker_log(launch.log_dir, local_rank) if local_rank is not None else None
    return record["code"], teardown_text(exitcode, _stderr_after(log, record["stderr_offset"]))


def exit_code(outcome: Outcome, cause: Optional[RootCause]) -> int:
    """0 only if every worker succeeded; else the root cause's own code, 128+N for signal N.

    A launcher stopped by signal N whose workers did not all finish cleanly exits 128+N.
    """
    if outcome.returncode == 0:
        return 0
    if outcome.stop_signal is not None:
        return 128 + outcome.stop_signal
    if outcome.no_rendezvous:
        return RENDEZVOUS_CODE  # the launcher, not a signal, ended torchrun: a temporary failure
    if cause is not None and cause.asked is not None:
        return cause.asked  # the script's own code survives a crash in teardown
    code = cause.exitcode if cause is not None and cause.exitcode else outcome.returncode
    return code if code > 0 else 128 - code


def _is_marker(line: str) -> bool:
    """Python 3.11's ``^^^^~~~`` lines under a traceback's code: no information, only length."""
    return set(line.strip()) <= set("^~ ")


def compose_report(cluster: Cluster, outcome: Outcome, cause: Optional[RootCause], code: int,
                   rendezvous: str = "", limit: int = REPORT_LIMIT) -> str:
    """At most ``limit`` characters: the root cause first, then the traceback's tail.

    ``rendezvous`` (e.g. ``algo-1:7777, timeout 900 s``) is named when torchrun itself failed.
    """
    host = cluster.current_host
    if outcome.stop_signal is not None:
        head = (f"{host}: stopped by {signal_name(outcome.stop_signal)} and the workers did not finish "
                f"cleanly (exit code {code})")
    elif cause is not None and cause.oom:
        who = "torchrun" if cause.rank is None else f"rank {cause.rank} (local rank {cause.local_rank})"
        what = cause.oom_what or "was killed by SIGKILL from the kernel's OOM killer"
        head = f"{host}: {who} ran out of memory: {what} (exit code {code})"
    elif cause is None or cause.rank is None:
        head = f"{host}: torchrun failed before or around the workers (exit code {code})"
        if rendezvous:
            head += f"; rendezvous {rendezvous}"
    elif cause.asked is not None:
        head = (f"{host}: rank {cause.rank} (local rank {cause.local_rank}) exited with code {cause.asked} "
                f"(then {cause.teardown})")
    elif cause.exitcode is not None and cause.exitcode < 0:
        head = (f"{host}: rank {cause.rank} (local rank {cause.local_rank}) was killed by "
                f"{signal_name(-cause.exitcode)} (exit code {code})")
    else:
        head = f"{host}: rank {cause.rank} (local rank {cause.local_rank}) exited with code {code}"
    lines = [head]
    if cause is not None and cause.exception:
        lines.append(cause.exception[:300])
    if cause is not None and cause.note:
        lines.append(cause.note)
    text = "\n".join(lines)
    detail = [strip_prefixes(ln) for ln in (cause.detail.splitlines() if cause else [])]
    detail = [ln for ln in detail if ln.strip() and not _is_marker(ln) and not _NOISE.match(ln)]
    tail: list[str] = []
    budget = limit - len(text) - 1
    for line in reversed(detail):
        if not tail and cause is not None and line.strip() == cause.exception.strip():
            continue  # the exception line is already in the head
        if len(line) + 1 > budget:
            break
        tail.insert(0, line)
        budget -= len(line) + 1
    if tail:
        text += "\n" + "\n".join(tail)
    return text[:limit]


def fit_report(report: str, limit: int) -> str:
    """``report`` as it is written and shown: unencodable characters as ``\\udcff``, cut at a character
    so that its UTF-8 is at most ``limit`` bytes (a limit in characters is then kept too). The file and
    stderr's last lines are this same text, whatever characters the job's output held."""
    data = report.encode("utf-8", "backslashreplace")
    return data[:limit].decode("utf-8", "ignore")


def write_failure_file(path: str, report: str, limit: int = REPORT_LIMIT) -> Optional[str]:
    """Write the report's first ``limit`` bytes to ``path`` atomically (:func:`launcher.filewriter.replace_file`:
    readers see the old file or the whole new one; a bind-mounted file is overwritten in place); never
    raises. Returns None when written, else why not (one line)."""
    return replace_file(path, fit_report(report, limit).encode("utf-8"), ".failure.")


def print_report(report: str, notes: Sequence[str] = ()) -> None:
    """``notes`` then the report as the last lines of stderr; never raises (stderr may be closed or broken)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    text = "".join(f"{line}\n" for line in (*notes, report))
    with contextlib.suppress(Exception):  # no stderr to tell it on: the exit code still tells the truth
        stream = sys.stderr.buffer
        stream.write(text.encode("utf-8", "backslashreplace"))
        stream.flush()
