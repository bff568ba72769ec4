"""Running the hosts: start each launcher, stream its output with its name in front, fire the faults,
forward stop signals, stop the job when a host ends badly (unless ``--platform-stop off``) or at the
deadline, and leave no process behind. With ``--network netns`` each host starts inside its own
namespaces of a :class:`~launcher.simulate.netns.Lab`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Callable, Optional

from launcher import proctree, streams
from launcher.simulate import faults
from launcher.simulate.hosts.base import HostSpec
from launcher.simulate.job import Config, Fault

if TYPE_CHECKING:
    from launcher.simulate.netns import Lab

BACKSTOP_SECONDS = 5.0  # after the grace period: simulate kills a launcher that is still running
TICK = 0.05
REAP_EVERY = 10  # ticks between collecting the zombies of orphans re-parented to simulate
RESTART_LINE = re.compile(rb"\[ddp-launcher\] restart \d+ of \d+ \(job-wide\): generation (\d+) starts")
MARKER = "DDP_LAUNCHER_SIMULATION"  # in every host's environment, so in everything the hosts start


def log(message: str) -> None:
    """One line of simulate's own, on stderr. Never fails (stderr may be closed or a dead pipe)."""
    streams.write(sys.stderr, f"[simulate] {message}\n")


@dataclass
class ArmedFault:
    """A fault waiting to fire; ``due`` is set by the output reader for ``step=N`` faults."""

    fault: Fault
    due: threading.Event = field(default_factory=threading.Event)
    fired_at: Optional[float] = None
    pattern: Optional[re.Pattern] = None
    undo: Optional[Callable[[], str]] = None  # a transient fault's end, once it fired
    ended_at: Optional[float] = None  # when a transient fault ended

    def __post_init__(self) -> None:
        if self.fault.step is not None:
            self.pattern = re.compile(rf"\bstep[=: ]\s*{self.fault.step}\b".encode())


@dataclass
class HostRun:
    """One started host and what happened to it."""

    spec: HostSpec
    proc: subprocess.Popen
    started: float
    faults: list[ArmedFault]
    pumps: list[threading.Thread] = field(default_factory=list)
    ended: Optional[float] = None
    returncode: Optional[int] = None
    stopped_by: Optional[str] = None  # why simulate sent it a stop signal
    stop_sent: Optional[float] = None
    killed: Optional[str] = None  # why simulate killed its process tree
    generations: list[tuple[int, float]] = field(default_factory=list)  # (generation, when) of each restart

    @property
    def exit_code(self) -> Optional[int]:
        """The host's exit code as a shell shows it: 128+N for signal N."""
        rc = self.returncode
        return None if rc is None else (128 - rc if rc < 0 else rc)

    def fired(self) -> Optional[ArmedFault]:
        """The first fault that fired and ends the host (a transient one does not)."""
        return next((f for f in self.faults if f.fired_at is not None and not f.fault.transient), None)

    def transients(self) -> list[ArmedFault]:
        """The transient faults that fired."""
        return [f for f in self.faults if f.fired_at is not None and f.fault.transient]


def pump(source: IO[bytes], sink: IO[bytes], prefix: bytes, lock: threading.Lock,
         on_line: Callable[[bytes], None]) -> None:
    """Copy a host's lines to ``sink`` with its name in front, as they come."""
    for line in iter(source.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            try:
                sink.write(prefix + line)
                sink.flush()
            except (OSError, ValueError):
                pass  # our own output is gone (a closed pipe): keep draining the host's
        on_line(line)
    source.close()


class Simulation:
    """Starts the hosts, streams their output, fires faults, stops the job, leaves nothing behind."""

    def __init__(self, config: Config, specs: Sequence[HostSpec], lab: Optional[Lab] = None) -> None:
        self.config = config
        self.specs = list(specs)
        self.lab = lab  # the hosts' namespaces (--network netns), every host already added
        self.deadline_hit = False
        self.runs: list[HostRun] = []
        self.lock = threading.Lock()
        self.signals: list[int] = []
        self.user_signal: Optional[int] = None
        self.start = 0.0
        self.marker = proctree.new_marker(MARKER)
        self.watchdog_pid = 0
        self.watchdog: Optional[proctree.Watchdog] = None  # kills and removes what is left if simulate dies
        self.killed: dict[str, list[int]] = {}  # per host, the processes simulate SIGKILLed with their watchdog

    # -- starting -------------------------------------------------------------------------------
    def _start_host(self, spec: HostSpec) -> HostRun:
        env = dict(spec.env)
        env[MARKER] = self.marker.partition("=")[2]
        argv = self.lab.command(spec.name, spec.argv) if self.lab else spec.argv
        proc = subprocess.Popen(argv, cwd=spec.cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        faults = [ArmedFault(f) for f in self.config.faults if f.host == spec.name]
        run = HostRun(spec, proc, time.monotonic(), faults)
        if spec.on_start is not None:
            spec.on_start()
        prefix = f"[{spec.name}] ".encode()
        for source, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            thread = threading.Thread(target=pump, args=(source, sink, prefix, self.lock,
                                                         self._step_watcher(run)), daemon=True)
            thread.start()
            run.pumps.append(thread)
        return run

    @staticmethod
    def _step_watcher(run: HostRun) -> Callable[[bytes], None]:
        def watch(line: bytes) -> None:
            restarted = RESTART_LINE.search(line) if b"(job-wide)" in line else None
            if restarted:  # the launcher's one line per restart (launcher/generations.py)
                run.generations.append((int(restarted.group(1)), time.monotonic()))
            for armed in run.faults:
                if armed.pattern is not None and not armed.due.is_set() and armed.pattern.search(line):
                    armed.due.set()
        return watch

    # -- signals and faults ---------------------------------------------------------------------
    def _targets(self, run: HostRun) -> list[int]:
        """The host's launcher: the process itself, or the one AWS's toolkit or SDK v3's drivers started."""
        if run.spec.signal_targets is not None:
            return run.spec.signal_targets(run.proc.pid)
        return [run.proc.pid]

    def _stop_host(self, run: HostRun, signum: int, reason: str) -> None:
        targets = self._targets(run) or [run.proc.pid]
        for pid in targets:
            faults.send(pid, signum)
        run.stopped_by, run.stop_sent = run.stopped_by or reason, time.monotonic()

    def stop_job(self, signum: int, reason: str) -> None:
        """Send ``signum`` to every host still running that was not told to stop yet."""
        waiting = [r for r in self.runs if r.ended is None and r.stop_sent is None]
        if waiting:
            log(f"{reason}; sending {signal.Signals(signum).name} to "
                f"{', '.join(r.spec.name for r in waiting)} (grace period {self.config.grace_period:g} s)")
        for run in waiting:
            self._stop_host(run, signum, reason)

    def _fire(self, run: HostRun, armed: ArmedFault, now: float) -> bool:
        fault = armed.fault
        if fault.transient:
            return self._fire_transient(run, armed, now)
        if fault.kind != "signal":
            return self._fire_network_fault(run, armed, now)
        targets = self._targets(run)
        if not targets:
            return False  # the toolkit has not started the launcher yet: try again next tick
        log(f"fault: {fault.name} to {run.spec.name}'s launcher (pid {', '.join(map(str, targets))}) "
            f"at {now - self.start:.1f} s: {fault.meaning()}")
        if fault.signum == signal.SIGKILL and run.spec.signal_targets:
            targets.append(run.proc.pid)  # a lost instance takes the toolkit with it
        for pid in targets:
            faults.send(pid, fault.signum)
        armed.fired_at = now
        if fault.signum != signal.SIGKILL:
            run.stopped_by, run.stop_sent = f"{fault.name} by --fault ({fault.meaning()})", now
        return True

    def _fire_network_fault(self, run: HostRun, armed: ArmedFault, now: float) -> bool:
        """``partition``: the host's link goes down. ``poweroff``: that, then every process of the host
        SIGKILLed at once (without a lab, the host's process tree)."""
        name = run.spec.name
        if self.lab is None:  # a poweroff (a partition needs namespaces: refused at the start)
            what = f"SIGKILL to its {self._kill_host(run)} process(es) at once"
        elif armed.fault.kind == "partition":
            self.lab.partition(name)
            what = "its link is down: its packets vanish"
        else:
            killed = self.lab.poweroff(name)
            self.killed.setdefault(name, []).extend(killed)
            what = f"link down, SIGKILL to {len(killed)} process(es) at once: {', '.join(map(str, killed))}"
        log(f"fault: {armed.fault.name} of {name} at {now - self.start:.1f} s ({armed.fault.meaning()}): {what}")
        armed.fired_at = now
        return True

    def _kill_host(self, run: HostRun) -> int:
        """SIGKILL to every process of the host's tree, remembered (:meth:`_remove_run_dirs`); how many."""
        self.killed.setdefault(run.spec.name, []).extend([run.proc.pid, *proctree.descendants([run.proc.pid])])
        return proctree.kill_tree([run.proc.pid])

    def _remove_run_dirs(self) -> None:
        """The run directories of the launchers simulate killed with their watchdog, removed as their
        watchdog would have: a lost cloud host takes its disk along, but the simulated ones share this machine's."""
        from launcher.rundir import remove_dead_run_dirs

        for run in self.runs:
            if run.spec.name in self.killed:
                tmpdir = run.spec.env.get("TMPDIR") or "/tmp"  # the host's whole environment
                for path in remove_dead_run_dirs(tmpdir, self.killed[run.spec.name]):
                    log(f"removed {path}, the run directory of {run.spec.name}'s killed launcher")

    def _host_pids(self, run: HostRun) -> list[int]:
        """Every process of the host: its network namespace's (netns), else its process tree."""
        if self.lab is not None:
            return self.lab.pids(run.spec.name)
        return [run.proc.pid, *proctree.descendants([run.proc.pid])]

    def _fire_transient(self, run: HostRun, armed: ArmedFault, now: float) -> bool:
        """Start a transient fault and keep how it ends (:meth:`_end_transients` calls it after its
        duration, or at the end of the run)."""
        fault, name = armed.fault, run.spec.name
        if fault.kind == "blip" and self.lab is not None:
            self.lab.partition(name)
            what, undo = "its link is down", lambda: self._heal(name)
        elif fault.kind == "pause":
            targets = self._targets(run)
            if not targets:
                return False  # the toolkit has not started the launcher yet: try again next tick
            stopped = faults.stop_all(lambda: targets)
            what = f"SIGSTOP to its launcher (pid {', '.join(map(str, stopped))})"
            undo = lambda: f"SIGCONT to {faults.continue_all(stopped)} process(es)"  # noqa: E731
        elif fault.kind == "vmpause":
            stopped = faults.stop_all(lambda: self._host_pids(run))
            what = f"SIGSTOP to its {len(stopped)} process(es): {', '.join(map(str, stopped))}"
            undo = lambda: f"SIGCONT to {faults.continue_all(stopped)} process(es)"  # noqa: E731
        elif fault.kind == "starve":
            try:
                quota = faults.CpuQuota(name)
            except faults.FaultError as exc:
                log(f"fault: starve of {name} cannot be made: {exc}")
                armed.fired_at = armed.ended_at = now
                return True
            moved = quota.add(lambda: self._host_pids(run))
            what = (f"its {len(moved)} process(es) in the cgroup {quota.path}, at most "
                    f"{faults.QUOTA_US / faults.PERIOD_US:.1%} of a CPU")
            undo = lambda: f"{quota.remove()} process(es) back in {quota.parent}, {quota.path} removed"  # noqa: E731
        elif fault.kind == "saturate":
            cpus = faults.host_cpus(run.proc.pid)
            loops = faults.start_busy_loops(cpus, {**os.environ, MARKER: self.marker.partition("=")[2]})
            for loop in loops:
                if self.watchdog is not None:
                    self.watchdog.guard(loop.pid)
            what = (f"{len(loops)} busy loop(s), pid {', '.join(str(p.pid) for p in loops)}, pinned to CPU(s) "
                    f"{', '.join(map(str, sorted(cpus)))}")
            undo = lambda: f"busy loop(s) {', '.join(map(str, faults.stop_busy_loops(loops)))} killed"  # noqa: E731
        else:
            return False  # a blip without namespaces: refused at the start
        log(f"fault: {fault.kind} of {name} at {now - self.start:.1f} s for {fault.seconds:g} s "
            f"({fault.meaning()}): {what}")
        armed.fired_at, armed.undo = now, undo
        return True

    def _heal(self, name: str) -> str:
        if self.lab is not None:
            self.lab.heal(name)
        return "its link is up again"

    def _end_transients(self, now: float, at_exit: bool = False) -> None:
        """End every transient fault whose time is up (every one still on, ``at_exit``)."""
        for run in self.runs:
            for armed in run.faults:
                if armed.undo is None or armed.ended_at is not None or armed.fired_at is None:
                    continue
                if not at_exit and now - armed.fired_at < (armed.fault.seconds or 0.0):
                    continue
                armed.ended_at = now
                try:
                    what = armed.undo()
                except (OSError, faults.FaultError, RuntimeError) as exc:
                    what = f"its end failed: {exc}"
                log(f"fault: {armed.fault.kind} of {run.spec.name} ended at {now - self.start:.1f} s, after "
                    f"{now - armed.fired_at:.1f} s{' (the run ended)' if at_exit else ''}: {what}")

    def _fire_due_faults(self, now: float) -> None:
        for run in self.runs:
            if run.ended is not None:
                continue
            for armed in run.faults:
                fault = armed.fault
                due = armed.due.is_set() if fault.step is not None else \
                    now - run.started >= (fault.after or 0.0)
                if armed.fired_at is None and due:
                    self._fire(run, armed, now)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)

    def _handle_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            name = signal.Signals(signum).name
            if self.user_signal is None:
                self.user_signal = signum
                self.stop_job(signum, f"received {name}")
            else:
                log(f"received {name} again: killing every host now")
                self._kill_all(f"at the second {name}")

    # -- ends -----------------------------------------------------------------------------------
    def _collect_exits(self, now: float) -> None:
        for run in self.runs:
            if run.ended is not None or run.proc.poll() is None:
                continue
            run.ended, run.returncode = now, run.proc.returncode
            failed = run.exit_code != 0 or run.fired() is not None
            log(f"{run.spec.name} exited with code {run.exit_code} after {now - run.started:.1f} s")
            if failed:
                what = "was lost" if run.returncode == -signal.SIGKILL else \
                    ("was stopped" if run.stopped_by else f"failed (exit code {run.exit_code})")
                if self.config.platform_stop:
                    self.stop_job(signal.SIGTERM, f"{run.spec.name} {what}")
                elif not self.deadline_hit and any(r.ended is None for r in self.runs):
                    log(f"{run.spec.name} {what}; --platform-stop off: the other hosts keep running")

    def _enforce_deadlines(self, now: float) -> None:
        if not self.deadline_hit and now - self.start >= self.config.deadline:
            self.deadline_hit = True
            self.stop_job(signal.SIGTERM, f"--deadline of {self.config.deadline:g} s reached")
        limit = self.config.grace_period + BACKSTOP_SECONDS
        for run in self.runs:
            if run.ended is None and run.stop_sent is not None and not run.killed \
                    and now - run.stop_sent > limit:
                log(f"{run.spec.name} still runs {limit:g} s after the stop signal: killing it")
                self._kill_host(run)
                run.killed = f"still running {limit:g} s after the stop signal"

    def _kill_all(self, why: str) -> None:
        for run in self.runs:
            if run.ended is None and not run.killed:
                self._kill_host(run)
                run.killed = why

    # -- the whole run ----------------------------------------------------------------------------
    def run(self) -> None:
        """Start every host and return when all have ended and nothing of theirs is left.

        A watchdog in a session of its own kills the hosts' trees and everything carrying the job's
        marker if simulate itself is killed, even with its whole process group.
        """
        streams.ensure_standard_fds()
        proctree.become_subreaper()  # orphans of a killed launcher come back to us
        watchdog = proctree.Watchdog()  # forked before any pipe exists: it holds none of them
        watchdog.kill_marked(self.marker)
        self.watchdog_pid, self.watchdog = watchdog.pid, watchdog
        previous = {s: signal.signal(s, self._on_signal)
                    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self.start = time.monotonic()
            for spec in self.specs:
                self.runs.append(self._start_host(spec))
                watchdog.guard(self.runs[-1].proc.pid)
            log(f"started {len(self.runs)} host(s): " +
                ", ".join(f"{r.spec.name} pid {r.proc.pid}" for r in self.runs))
            self._loop()
        finally:  # also when a host could not be started: nothing of the others may stay
            self._end_transients(time.monotonic(), at_exit=True)
            keep = [watchdog.pid] + ([self.lab.pid] if self.lab else [])  # the lab's holder: closed by its owner
            leftovers = proctree.kill_tree([os.getpid()], include_roots=False, exclude=keep, marker=self.marker)
            if leftovers:
                log(f"killed {leftovers} process(es) the hosts left behind")
            for run in self.runs:
                for thread in run.pumps:
                    thread.join(timeout=5)
            self._remove_run_dirs()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            watchdog.release()
            proctree.reap_children()

    def _loop(self) -> None:
        ticks = 0
        while any(r.ended is None for r in self.runs):
            now = time.monotonic()
            self._handle_signals()
            self._fire_due_faults(now)
            self._end_transients(now)
            self._collect_exits(now)
            self._enforce_deadlines(now)
            ticks += 1
            if ticks % REAP_EVERY == 0:
                proctree.reap_orphans([r.proc.pid for r in self.runs] + [self.watchdog_pid])
            time.sleep(TICK)
