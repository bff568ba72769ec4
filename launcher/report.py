"""The verdict of a run: its class, exit code and report (:mod:`launcher.codes`), and the outcome file.

:func:`judge` turns torchrun's outcome, the root cause :mod:`launcher.failure` reads from torchrun's
evidence, and the job watch's root cause (an :class:`launcher.jobwatch.Event`) into one verdict: the
class, the exit code, the report text cut once at the platform's limit, and the outcome file's data.

The outcome file is a small JSON object (``launcher/outcome.schema.json``) written atomically at the
end of every run, success included, on every host: where ``--outcome-file`` says, else where the
platform keeps its output (SageMaker: ``$SAGEMAKER_BASE_DIR/output/data/outcome.json``, uploaded to S3
with the job's output). A retry policy reads ``class`` (or ``infrastructure``) instead of guessing
from an exit code that two classes can share.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from launcher import __version__, codes, failure, oom
from launcher.command import Launch
from launcher.failure import RootCause
from launcher.filewriter import replace_file
from launcher.outcome import Outcome

if TYPE_CHECKING:
    from launcher.jobwatch import Event
    from launcher.runcontext import JobWatch, Run

SCHEMA = "ddp-launcher-outcome/1"
DEFAULT_LIMIT = failure.REPORT_LIMIT  # the report's length where the platform sets none (stderr only)
# torchrun failed before any worker: a rendezvous that broke or never formed (its words, or the launcher's)
_RENDEZVOUS = re.compile(r"rendezvous|DistNetworkError|DistStoreError|RendezvousError", re.IGNORECASE)

_SIGNAL_IN_HEAD = re.compile(r"(?:was killed by|stopped by) (SIG[A-Z0-9]+)")


class Clock(NamedTuple):
    """When the run's steps happened (``time.time()``): the launcher's start, torchrun's start, the end."""

    started: float
    torchrun: Optional[float] = None
    first_worker: Optional[float] = None  # the earliest worker start recorded (the rendezvous was done)
    ended: Optional[float] = None


class Verdict(NamedTuple):
    """What one host says about the run: its class and exit code, and the facts the outcome file holds."""

    klass: str
    code: int
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    signal: Optional[str] = None  # the signal that ended the root-cause worker, or that stopped the launcher
    root_cause: str = ""  # the report's first line ("" on success)
    exception: str = ""
    root_cause_host: Optional[str] = None  # the job's root-cause host (this one, or another)
    restarts: tuple = ()  # the job-wide restarts, oldest first (launcher/restart.py's record)


def classify(outcome: Outcome, cause: Optional[RootCause], code: int) -> str:
    """This host's own class, from how torchrun ended and the root cause (:class:`launcher.failure.RootCause`)."""
    if code == 0:
        return codes.SUCCESS
    if outcome.stop_signal is not None:
        return codes.STOPPED
    if outcome.no_rendezvous:
        return codes.RENDEZVOUS
    if cause is not None and cause.oom:
        return codes.OUT_OF_MEMORY
    if cause is None or cause.rank is None:  # torchrun failed before or around the workers
        return codes.RENDEZVOUS if cause is not None and _RENDEZVOUS.search(cause.exception) else codes.WORKER_EXIT
    if cause.asked is None and cause.exitcode is not None and cause.exitcode < 0:
        return codes.WORKER_SIGNAL
    return codes.WORKER_EXIT


def out_of_memory(outcome: Outcome, cause: Optional[RootCause], before: Optional[oom.Counter]) -> Optional[RootCause]:
    """``cause`` (:class:`launcher.failure.RootCause`) with the OOM killer's evidence and victim when the
    kernel's OOM-kill count (``before``: read before torchrun started) rose since and its worker (or
    torchrun) died of SIGKILL, or the worker failed because a process of its own (a DataLoader worker)
    was the OOM killer's victim; else ``cause`` as it was. See :func:`launcher.oom.explain`."""
    if cause is None or outcome.stop_signal is not None or cause.asked is not None:
        return cause
    killed = (outcome.returncode if cause.rank is None else cause.exitcode) == -signal.SIGKILL
    if cause.rank is None and not killed:
        return cause
    found = oom.explain(before, f"{cause.exception}\n{cause.detail}", killed)
    if found is None:
        return cause
    evidence, what = found
    return cause._replace(oom=evidence, oom_what=what,
                          exception=f"out of memory: the kernel's OOM killer sent SIGKILL ({evidence})")


def code_of(klass: str, code: int) -> int:
    """The exit code of a class: the fixed code of a class that has one, else ``code`` (the worker's)."""
    return {codes.RENDEZVOUS: codes.RENDEZVOUS_CODE, codes.HOST_LOST: codes.HOST_LOST_CODE,
            codes.OUT_OF_MEMORY: codes.OUT_OF_MEMORY_CODE,
            codes.HANG: codes.HANG_CODE, codes.BAD_INPUT: codes.BAD_INPUT_CODE,
            codes.NO_PROGRESS: codes.NO_PROGRESS_CODE,
            codes.INTERNAL: codes.INTERNAL_CODE}.get(klass, code)


class TorchrunEnd(NamedTuple):
    """How torchrun's run ended on this host: the root cause read from its evidence (None: none found), the class,
    the exit code and the outcome they were judged on (without its stop when a worker failed before it)."""

    cause: Optional[RootCause]
    klass: str
    code: int
    outcome: Outcome


def class_and_code(outcome: Outcome, cause: Optional[RootCause]) -> tuple[str, int]:
    """The one rule for a torchrun end's class and exit code (:func:`classify`, then :func:`code_of`), from how
    torchrun ended and the root cause."""
    found = failure.exit_code(outcome, cause)
    klass = classify(outcome, cause, found)
    return klass, code_of(klass, found)


def torchrun_end(outcome: Outcome, launch: Launch, memory: Optional[oom.Counter]) -> TorchrunEnd:
    """How torchrun's run of ``launch`` ended: its root cause (:func:`launcher.failure.find_root_cause`, with the
    OOM killer's evidence when ``memory``, the OOM-kill count before it started, rose), class and code. The
    verdict (:func:`judge`) and the generations (:mod:`launcher.generations`) both read an end this way."""
    cause = failure.find_root_cause(outcome, launch)
    if failure.failed_before_stop(outcome, cause):  # its own failure came first: the stop is not how it ended
        outcome = outcome._replace(stop_signal=None)
    cause = out_of_memory(outcome, cause, memory)
    return TorchrunEnd(cause, *class_and_code(outcome, cause), outcome)


def remote_class(kind: str, code: int, head: str) -> str:
    """The class of another host's root cause, from the job watch's event: a loss, or its report's head."""
    if kind == "lost":
        return codes.HOST_LOST
    first = head.split("\n", 1)[0]
    if code == codes.HANG_CODE and "hang" in first:
        return codes.HANG
    if code == codes.RENDEZVOUS_CODE and "rendezvous" in first:
        return codes.RENDEZVOUS
    if ": stopped by " in first:
        return codes.STOPPED
    if " ran out of memory: " in first:
        return codes.OUT_OF_MEMORY
    if " was killed by " in first:
        return codes.WORKER_SIGNAL
    return codes.WORKER_EXIT


def _rounded(later: Optional[float], earlier: Optional[float]) -> Optional[float]:
    return round(later - earlier, 3) if later is not None and earlier is not None and later >= earlier else None


def _utc(stamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(stamp)) + f".{int(stamp % 1 * 1000):03d}Z"


def outcome_data(verdict: Verdict, clock: Clock, host: Optional[str], node_rank: Optional[int],
                 nnodes: Optional[int], platform: Optional[str]) -> dict[str, Any]:
    """The outcome file's object (see ``launcher/outcome.schema.json``)."""
    ended = clock.ended if clock.ended is not None else time.time()
    return {
        "schema": SCHEMA,
        "class": verdict.klass,
        "exit_code": verdict.code,
        "infrastructure": verdict.klass in codes.INFRASTRUCTURE,
        "host": host, "node_rank": None if node_rank is not None and node_rank < 0 else node_rank,  # < 0: no node
        "nnodes": nnodes, "platform": platform,
        "rank": verdict.rank, "local_rank": verdict.local_rank, "signal": verdict.signal,
        "root_cause": verdict.root_cause[:1000], "exception": verdict.exception[:1000],
        "root_cause_host": verdict.root_cause_host,
        "started_at": _utc(clock.started), "ended_at": _utc(ended),
        "durations": {"start": _rounded(clock.torchrun, clock.started),
                      "rendezvous": _rounded(clock.first_worker, clock.torchrun),
                      "total": round(max(0.0, ended - clock.started), 3)},
        "restarts": list(verdict.restarts),
        "recovered": verdict.klass == codes.SUCCESS and bool(verdict.restarts),
        "launcher_version": __version__,
    }


def write_outcome(path: str, data: Mapping[str, Any]) -> Optional[str]:
    """Write ``data`` as JSON to ``path`` atomically (:func:`launcher.filewriter.replace_file`); never raises.

    Returns None when written, else why not (one line).
    """
    text = json.dumps(data, indent=2, ensure_ascii=True) + "\n"
    return replace_file(path, text.encode("ascii"), ".outcome.")


def own_verdict(klass: str, code: int, outcome: Outcome, cause: Optional[RootCause], text: str, host: str) -> Verdict:
    """This host's verdict from its own evidence (``cause``: :class:`launcher.failure.RootCause`)."""
    import signal as signals

    def name(number: int) -> str:
        try:
            return signals.Signals(number).name
        except ValueError:
            return f"signal {number}"

    if klass == codes.SUCCESS:
        return Verdict(klass, code)
    signal = None
    if outcome.stop_signal is not None:
        signal = name(outcome.stop_signal)
    elif klass == codes.OUT_OF_MEMORY:
        signal = "SIGKILL"  # also when torchrun itself was the OOM killer's victim
    elif cause is not None and cause.exitcode is not None and cause.exitcode < 0:
        signal = name(-cause.exitcode)
    rank = cause.rank if cause is not None else None
    local_rank = cause.local_rank if cause is not None else None
    return Verdict(klass, code, rank, local_rank, signal, text.split("\n", 1)[0],
                   cause.exception if cause is not None else "", host)


def remote_verdict(own: Verdict, kind: str, host: str, code: int, head: str) -> Verdict:
    """The verdict when another host's failure or loss is the job's root cause: its class and code."""
    first = head.split("\n", 1)[0]
    named = _SIGNAL_IN_HEAD.search(first) if kind != "lost" else None
    return Verdict(remote_class(kind, code, head), code, None, None, named.group(1) if named else None, first,
                   head.split("\n")[1] if kind != "lost" and "\n" in head else "", host)


def is_primary(watch: JobWatch, node: int, cause: Optional[failure.RootCause], failed: float) -> bool:
    """Whether this host's failure (``cause``; ``failed``: when its first worker failed, monotonic) is the job's
    root cause, by evidence alone, never by a message's words:

    - node 0's decision that ended the job names one node (the first failure in time by node 0's clock, not
      one the job watch stopped; none when a host was lost before any failure): that node's, the same on
      every host;
    - without a decision (node 0 lost, none in time, only some hosts train): a worker of this host failed (not
      torchrun itself, whose rendezvous broke with a peer) and no host was lost before it failed.
    """
    decisions = watch.decisions
    last = decisions[max(decisions)] if decisions else None
    if last is not None and not last.get("restart"):
        named = last.get("cause")
        return isinstance(named, dict) and named.get("node") == node
    return cause is not None and cause.rank is not None and not any(
        e.kind == "lost" and e.at <= failed for e in list(watch.events))


def job_result(cause: Optional[Event], code: int, text: str, primary: bool, off: str = "",
               limit: int = DEFAULT_LIMIT) -> tuple[int, str]:
    """The job's exit code and this host's report, given the job watch's root cause (an
    :class:`launcher.jobwatch.Event`, or None): another host's cause first, then what happened here.

    ``primary`` False when this host's failure is not the root cause (:func:`is_primary`); ``off`` why this host ran
    without the watch. The report is cut once, at ``limit`` (the platform's).
    """
    if code == 0:
        return 0, ""
    if off:
        text = f"{text}\n(job watch off on this host: {off})"
    if cause is None or (primary and not cause.primary):
        return code, text[:limit]
    return cause.code, f"{cause.report}\nthen {text}"[:limit]


def port_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """True if a TCP connection to ``host:port`` is accepted within ``timeout`` (whoever accepts it)."""
    import socket  # only after a failed rendezvous

    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except (OSError, UnicodeError):
        return False


def no_rendezvous_reason(master: str, port: int, node_rank: int) -> str:
    """Why no rendezvous came, as far as this node can tell: the master's port answered or not."""
    if node_rank == 0:
        return "the other nodes did not all join"
    if port_answers(master, port):
        return (f"{master}:{port} answers but gave no rendezvous: another program may hold that port "
                "(or node 0 is still waiting for the other nodes)")
    return f"{master}:{port} never answered: is node 0 up, and is the port open between the hosts?"


def judge(run: Run, outcome: Outcome, memory: Optional[oom.Counter] = None) -> tuple[Verdict, str]:
    """This host's verdict and report (empty on success); with a job watch, the job's root cause first.
    A hang decided by the run's hang detection (:class:`launcher.hangwatch.HangWatch`) is the job's verdict on
    every host. A host outside the training world (:mod:`launcher.groups`) ran the script itself.
    ``memory``: the OOM-kill counter as it was before torchrun started (:func:`launcher.oom.snapshot`)."""
    from launcher.command import address_of, master_port

    cluster, options, launch, outside = run.plan.cluster, run.plan.invocation.options, run.launch, run.direct
    platform, watch, hangs = run.plan.choice.platform, run.watch, run.hangs
    limit = platform.report_limit or DEFAULT_LIMIT
    text = ""
    if outside:
        from launcher import groups

        cause = None
        code = groups.exit_code(outcome, watch is not None and watch.training_ended,
                                watch is not None and watch.stopped_job)
        klass = codes.SUCCESS if code == 0 else (
            codes.STOPPED if outcome.stop_signal is not None else
            codes.WORKER_SIGNAL if outcome.returncode < 0 else codes.WORKER_EXIT)
        text = groups.report(cluster, outcome, code, limit) if code != 0 else ""
    else:
        cause, klass, code, outcome = torchrun_end(outcome, launch, memory)
    if code != 0 and not outside:
        port = master_port(cluster, options)
        rendezvous = (f"{cluster.master_addr}:{port} as node {cluster.node_rank} of {cluster.nnodes}, "
                      f"timeout {options.rdzv_timeout} s") if cluster.nnodes > 1 else ""
        if outcome.no_rendezvous:
            master = address_of(cluster.master_addr or "", options.resolve)
            rendezvous += ": " + no_rendezvous_reason(master, port, cluster.node_rank)
        text = failure.compose_report(cluster, outcome, cause, code, rendezvous, limit)
        from launcher.logspace import disk_full_note

        full = disk_full_note(launch.run_dir)  # the true cause of a failure nothing else explains
        if full:
            head, _, rest = text.partition("\n")
            text = "\n".join(line for line in (head, full, rest) if line)[:limit]
    if hangs is not None and hangs.verdict:  # no progress anywhere: node 0's verdict, the same on every host
        from launcher.hangwatch import report as hang_report

        text = hang_report(hangs, limit)
        rank, host = hangs.culprit
        if watch is not None:
            watch.finish(codes.HANG_CODE, text, True)  # tell the others; they have the same verdict
        return Verdict(codes.HANG, codes.HANG_CODE, rank=rank, root_cause=text.split("\n", 1)[0],
                       root_cause_host=host), text
    verdict = own_verdict(klass, code, outcome, cause, text, cluster.current_host)
    if watch is None:
        return verdict, text
    from launcher.jobwatch import REMOTE_GRACE

    if code != 0 and watch.stopped_job and outcome.stop_signal is not None:
        killed = "; the rest killed after it" if outcome.killed_after_grace else ""
        text = (f"{cluster.current_host}: its workers were stopped because of that (SIGTERM, grace period at most "
                f"{REMOTE_GRACE:g} s{killed})")
        primary = False
    else:
        primary = outside or outcome.stop_signal is not None or is_primary(
            watch, cluster.node_rank, cause, failure.first_failure(outcome, launch.exit_dir, time.monotonic()))
    event = watch.finish(code, text, primary)
    job_code, text = job_result(event, code, text, primary, watch.off, limit)
    if code != 0 and event is not None and not (primary and not event.primary):
        verdict = remote_verdict(verdict, event.kind, event.host, event.code, event.report)
    return verdict._replace(code=job_code, root_cause=text.split("\n", 1)[0]), text


def deliver(verdict: Verdict, text: str, clock: Clock, outcome_path: Optional[str], report_path: Optional[str],
            limit: int, where: tuple[Optional[str], Optional[int], Optional[int], Optional[str]]) -> None:
    """Write the outcome file and the failure report, then print the report as stderr's last lines.

    ``where``: this host's name, node rank, node count and platform. What could not be written is
    said in one line each, before the report. Never raises.
    """
    notes = []
    text = failure.fit_report(text, limit or DEFAULT_LIMIT)  # the file's text is the text shown
    if outcome_path is not None:
        data = outcome_data(verdict, clock._replace(ended=time.time()), *where)
        problem = write_outcome(outcome_path, data)
        if problem:
            notes.append(f"[ddp-launcher] could not write the outcome file {outcome_path}: {problem}")
    if text and report_path is not None:
        problem = failure.write_failure_file(report_path, text, limit or DEFAULT_LIMIT)
        if problem:
            notes.append(f"[ddp-launcher] could not write the failure report to {report_path}: {problem}")
    if text:
        failure.print_report(text, notes)  # the report ends stderr
    elif notes:
        failure.print_report(notes[-1], notes[:-1])
