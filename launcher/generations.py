"""The generations of a restarted job on this host: supervise, tell node 0, start the next one.

Each generation is one :func:`launcher.supervise.supervise` of a fresh torchrun (``--max-restarts 0``; after the
first, started ahead with its workers held before the script, at the first step of this host's generation before,
else at its end: :mod:`launcher.ahead`)
with the generation in the workers' environment (``TORCHELASTIC_RESTART_COUNT``, set by
:mod:`launcher.bootstrap`) and its rendezvous port (:func:`launcher.command.generation_port`). When it
ends, every worker of it is gone (supervise kills what is left), and only then this host tells node 0
how it ended (:meth:`launcher.jobwatch.Watch.end_generation`): so no script of generation N+1 runs before
every host's generation N is gone (a generation started ahead meets on its own port and holds its workers
before the script until node 0's decision).
Node 0 decides for every host (:class:`launcher.restart.Policy`); one node decides for itself.

A stop signal between two generations (while node 0 decides) ends the job: it is never restarted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from typing import Any, Callable, Optional

from launcher import ahead, codes, failure, oom, report, restart
from launcher.command import Launch, for_generation, generation_port
from launcher.failuretime import FailedAt
from launcher.jobwatch import report_head
from launcher.outcome import Outcome
from launcher.progress import BeatSocket, Progress
from launcher.runcontext import Hangs, Run
from launcher.supervise import STOP_SIGNALS, supervise

DECISION_MARGIN = 30.0  # seconds past the loss timeout and the grace period that node 0's decision may take


class History:
    """The restarts so far and the last decision: what the final verdict and the outcome file say."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.records: list[dict[str, Any]] = []
        self.last: Optional[restart.Decision] = None
        self.memory: Optional[oom.Counter] = None  # the OOM-kill count before the last generation started

    def verdict(self, verdict: report.Verdict, text: str, limit: int,
                log: Callable[[str], None]) -> tuple[report.Verdict, str]:
        """The final verdict and report with the restarts: node 0's root cause's class and code when it ended the
        job (every host the same); ``no_progress`` (93) when restarting did not help; the count of restarts on
        the report's first line; the restarts in the outcome."""
        count = len(self.records)
        last = self.last
        if verdict.code != 0 and last is not None and last.cause is not None and last.why in ("class", "budget"):
            cause = last.cause  # node 0's root cause: every failed host ends with its class and code
            verdict = verdict._replace(klass=cause.klass, code=cause.code, root_cause_host=cause.host)
        if last is not None and last.why == "no_progress":
            head = f"{last.sentence(self.budget)} ({count} restart(s) of {self.budget})"
            text = f"{head}\n{text}"[:limit]
            verdict = verdict._replace(klass=codes.NO_PROGRESS, code=codes.NO_PROGRESS_CODE,
                                       root_cause=head, root_cause_host=last.cause.host if last.cause else None)
        elif text and count:
            first, _, rest = text.partition("\n")
            first = f"{first} (after {count} job-wide restart(s) of {self.budget})"
            text = f"{first}\n{rest}"[:limit] if rest else first[:limit]
            verdict = verdict._replace(root_cause=first)
        if verdict.code == 0 and count:
            log(f"the job recovered: it finished after {count} job-wide restart(s) of {self.budget}")
        return verdict._replace(restarts=tuple(self.records)), text


def _own_end(run: Run, launch: Launch, outcome: Outcome, steps: restart.Steps, memory: Optional[oom.Counter],
             failed: float, first: Optional[FailedAt] = None) -> restart.End:
    """How this host's generation (``launch``) ended, as node 0 needs it (``failed``: when its first worker failed,
    monotonic; ``first``: that failure by its record and its death, ``time.time()``). Its failure is a consequence
    of another host's only when the job watch stopped its workers before any of its own failed (or torchrun itself
    failed, with no worker to blame); what the exception says is no evidence."""
    c, hangs, watch = run.plan.cluster, run.hangs, run.watch
    node, host = c.node_rank, c.current_host
    moved, watched, count = steps.moved(), steps.watched(), steps.progress.steps
    age = round(max(0.0, time.monotonic() - failed), 3)
    record_at, death_at = (None, None) if first is None else first
    if hangs is not None and hangs.verdict:
        from launcher.hangwatch import report as hang_report

        return restart.End(node, host, codes.HANG_CODE, codes.HANG, "hang", report_head(hang_report(hangs, 600)),
                           True, moved, age=age, watched=watched, steps=count)
    cause, klass, code, outcome = report.torchrun_end(outcome, launch, memory)
    if code == 0:
        return restart.End(node, host, 0, codes.SUCCESS, "", "", True, moved, watched=watched, steps=count)
    by_watch = watch is not None and watch.stopped_job and outcome.stop_signal is not None
    signal_name = failure.signal_name(-cause.exitcode) if (
        cause is not None and cause.exitcode is not None and cause.exitcode < 0) else None
    key = restart.root_key(klass, cause.exception if cause else "", cause.detail if cause else "", signal_name,
                           code)
    text = failure.compose_report(c, outcome, cause, code, "", 600)
    primary = not by_watch and (outcome.stop_signal is not None or (cause is not None and cause.rank is not None))
    return restart.End(node, host, code, klass, key, report_head(text), primary, moved,
                       stopped=outcome.stop_signal is not None and not by_watch, age=age, watched=watched,
                       steps=count, record_at=record_at, death_at=death_at)


def _fresh(launch: Launch) -> None:
    """Forget the last generation's evidence: its error file, worker exit records and logs."""
    with contextlib.suppress(OSError):
        os.unlink(launch.error_file)
    with contextlib.suppress(OSError):
        for name in os.listdir(launch.exit_dir):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(launch.exit_dir, name))
    shutil.rmtree(launch.log_dir, ignore_errors=True)


def run_generations(run: Run) -> tuple[Outcome, Run, History]:
    """Run generation after generation until node 0 decides the job ends; returns the last generation's
    outcome (with the stop signal, when one came between two generations), the run with that generation's
    hang detection, and the history."""
    p, environ, log, watch = run.plan, run.environ, run.log, run.watch
    options, c = p.invocation.options, p.cluster
    policy = restart.Policy(options.max_restarts, options.restart_on)
    if watch is not None:
        watch.set_policy(lambda gen, ends, lost_at: policy.decide(gen, [restart.end_of(e) for e in ends],
                                                                  lost_at is not None, lost_at).message())
    history = History(options.max_restarts)
    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: signals.append(signum)) for sig in STOP_SIGNALS}
    generation, pending, failed_at = 0, "", None
    spans: Optional[dict[str, Optional[float]]] = None  # the phases of the restart into this generation
    decided_at: Optional[float] = None  # when node 0's decision came (monotonic)
    following = ahead.Next(environ, log)  # the next generation, started ahead and held before the script

    def port_of(gen: int) -> int:
        return generation_port(c, options, p.choice.platform.fixed_port, gen)

    def launch_of(gen: int) -> Launch:
        return for_generation(p.launch, port_of(gen), gen)

    try:
        while True:
            launch = launch_of(generation)
            if generation > 0:
                hangs = run.hangs
                if hangs is not None and p.hang is not None:
                    from launcher import hangwatch

                    hangs = hangwatch.for_cluster(c, p.hang, launch.run_dir, log, watch, previous=hangs,
                                                  worker_env=launch.environment(environ), remake=[launch.exit_dir])
                run = run.with_generation(launch, hangs)
            if spans is not None and decided_at is not None:
                spans["new_torchrun"] = round(max(0.0, time.monotonic() - decided_at), 3)
            steps = _steps(launch.run_dir, run.hangs, log, pending, failed_at, spans)
            history.memory = oom.snapshot()  # a SIGKILL of this generation is told apart by its own count
            started = following.take(launch)
            # the next generation, while a restart may follow; started at this one's first step when its port is
            # not this one's (a fixed port is free only once this generation's torchrun is gone), else at its end
            following.arm(launch_of(generation + 1) if len(history.records) < options.max_restarts else None,
                          None if port_of(generation + 1) == port_of(generation) else
                          lambda steps=steps: steps.progress.first_step is not None)
            try:
                outcome = supervise(run, launch, quick_end=True, started=started, beside=following)
            finally:
                failed_at = time.monotonic()
                steps.close()
            if history.records and steps.to_first_step is not None:
                history.records[-1]["seconds_to_first_step"] = steps.to_first_step
            if run.hangs is not None:
                run.hangs.close()
            first = failure.host_failure(outcome, launch.exit_dir)
            failed = failure.first_failure(outcome, launch.exit_dir, failed_at)
            end = _own_end(run, launch, outcome, steps, history.memory, failed, first)._replace(
                ahead_gone=following.gone())
            if signals and outcome.stop_signal is None:
                return outcome._replace(stop_signal=signals[0]), run, history
            platform_stop = outcome.stop_signal is not None and not (watch is not None and watch.stopped_job)
            if end.code != 0 and not platform_stop:
                following.now()  # another may come: started ahead (unless it was at this generation's first step)
            root: Optional[float] = failed
            if watch is None:
                decision: Optional[restart.Decision] = policy.decide(generation, [end])
                decided_at = time.monotonic()
            else:
                # a success with no restart left: nothing node 0 decides can change this host's end; it goes
                wait = 0.0 if end.code == 0 and len(history.records) >= options.max_restarts else (
                    options.loss_timeout + p.grace_period + DECISION_MARGIN)
                message = watch.end_generation(end.message(), wait)
                decision = None if message is None else restart.decision_of(message)
                decided_at = None if message is None else float(message.get("heard", time.monotonic()))
                if message is not None and message.get("cause_age") is not None:
                    root = decided_at - float(message["cause_age"])  # type: ignore[operator]
            history.last = decision
            if decision is None or not decision.restart:
                return outcome, run, history
            if signals:  # a stop signal while node 0 decided: this host stops; the others hear it
                return outcome._replace(stop_signal=signals[0]), run, history
            if decision.fresh:  # another host's may have met this host's: none is used
                log("a generation started ahead had ended on a host: every host starts the next one afresh")
                following.cancel()
            stopping = watch.stop_at if watch is not None and end.code != 0 and not end.primary else failed
            spans = restart.phases(root, stopping, failed_at, decided_at)
            history.records.append(restart.record(decision, None, spans))
            pending = restart.restart_line(decision, options.max_restarts)
            if watch is not None:
                watch.new_generation()
            _fresh(launch)
            generation += 1
    finally:
        following.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _steps(run_dir: str, hangs: Optional[Hangs], log: Callable[[str], None], pending: str,
           failed_at: Optional[float], spans: Optional[dict[str, Optional[float]]]) -> restart.Steps:
    """This generation's progress: hang detection's beats, else a beat socket of its own."""
    if hangs is not None:
        return restart.Steps(hangs.progress, None, log, pending, failed_at, spans)
    beats = None
    try:
        beats = BeatSocket(run_dir)
    except OSError as exc:
        log(f"progress beats off: {exc}; a repeated failure counts as one without progress")
    return restart.Steps(Progress(), beats, log, pending, failed_at, spans)
