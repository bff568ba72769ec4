"""The job's summary: what happened to each host (``summary.json``) and the table printed at the end."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from launcher.errors import ConfigError
from launcher.filereader import read_bounded
from launcher.simulate.hosts import builder
from launcher.simulate.run import HostRun, Simulation

FAILURE_FILE_LIMIT = 1 << 20  # a host's failure report is at most the platform's limit (4 KiB)


def _first_line(path: Optional[str]) -> str:
    if path is None:
        return ""
    try:
        data = read_bounded(path, FAILURE_FILE_LIMIT, "") or b""
    except ConfigError:  # not a regular file, or larger than any report: not the host's report
        return ""
    return data.decode("utf-8", "replace").partition("\n")[0].strip()


def _model_files(model_dir: Optional[str]) -> list[str]:
    found: list[str] = []
    if model_dir is None:
        return found
    for root, _dirs, files in os.walk(model_dir):
        found += [os.path.relpath(os.path.join(root, f), model_dir) for f in files]
    return sorted(found)


def outcome_text(run: HostRun, start: float, user_signal: Optional[int]) -> str:
    """What happened to the host, in words."""
    armed = run.fired()
    if armed is not None:
        verb = "partitioned" if armed.fault.kind == "partition" else \
            ("lost" if armed.fault.kind == "poweroff" or armed.fault.signum == signal.SIGKILL else "stopped")
        text = (f"{verb}: {armed.fault.name} by --fault at {armed.fired_at - start:.1f} s "
                f"({armed.fault.meaning()})")
    elif run.stopped_by is not None:
        text = f"stopped by simulate after {run.stopped_by}" if user_signal is None else \
            f"stopped: {signal.Signals(user_signal).name} from the user"
    else:
        text = "succeeded" if run.exit_code == 0 else "failed"
    if run.generations:
        text += (f" in generation {run.generations[-1][0]} ({len(run.generations)} job-wide restart(s), logged "
                 f"at {', '.join(f'{when - start:.1f}' for _, when in run.generations)} s)")
    for transient in run.transients():
        text += (f"; {transient.fault.kind} by --fault at {transient.fired_at - start:.1f} s for "
                 f"{transient.fault.seconds:g} s ({transient.fault.meaning()})")
    return text + (f", killed {run.killed}" if run.killed else "")


def host_report(run: HostRun, start: float, user_signal: Optional[int]) -> dict[str, Any]:
    """One row of the summary."""
    model_dir = run.spec.model_dir
    return {"host": run.spec.name, "exit_code": run.exit_code, "pid": run.proc.pid,
            "started": round(run.started - start, 3), "ended": round((run.ended or start) - start, 3),
            "duration": round((run.ended or run.started) - run.started, 3),
            "outcome": outcome_text(run, start, user_signal),
            "fault_at": None if run.fired() is None else round(run.fired().fired_at - start, 3),
            "transient_faults": [{"kind": t.fault.kind, "at": round(t.fired_at - start, 3),
                                  "seconds": t.fault.seconds,
                                  "ended": None if t.ended_at is None else round(t.ended_at - start, 3)}
                                 for t in run.transients()],
            "failure": _first_line(run.spec.failure_file),
            "generations": [{"generation": g, "at": round(when - start, 3)} for g, when in run.generations],
            "model_dir": model_dir, "model_files": _model_files(model_dir)}


def job_report(sim: Simulation) -> dict[str, Any]:
    """The job's summary: each host, the exit code, and how fast the job ended after a death."""
    hosts = [host_report(r, sim.start, sim.user_signal) for r in sim.runs]
    failing = sorted((h["ended"], i) for i, h in enumerate(hosts)
                     if h["exit_code"] != 0 or h["fault_at"] is not None)
    first = hosts[failing[0][1]] if failing else None
    nonzero = sorted((h["ended"], i) for i, h in enumerate(hosts) if h["exit_code"] != 0)
    last = max(h["ended"] for h in hosts)
    return {"job_name": sim.config.job_name, "platform": sim.config.platform, "workdir": sim.config.workdir,
            **sim.config.options.report(), "hosts": hosts,
            "network": sim.config.network, "network_note": sim.config.network_note,
            "platform_stop": sim.config.platform_stop, "deadline_reached": sim.deadline_hit,
            "exit_code": hosts[nonzero[0][1]]["exit_code"] if nonzero else 0,
            "first_failure": first["host"] if first else None,
            "death_to_last_exit": round(last - first["ended"], 3) if first else None,
            "fault_to_last_exit": _fault_to_last(hosts, last),
            "note": builder(sim.config.platform).SUMMARY_NOTE}


def _fault_to_last(hosts: Sequence[Mapping[str, Any]], last: float) -> Optional[float]:
    fired = [h["fault_at"] for h in hosts if h["fault_at"] is not None]
    return round(last - min(fired), 3) if fired else None


def format_summary(report: Mapping[str, Any]) -> str:
    """The table a person reads at the end."""
    rows = [("host", "exit", "time", "outcome", "failure (the platform's report, first line)", "model")]
    for h in report["hosts"]:
        model = (f"{len(h['model_files'])} file(s) in {h['model_dir']}" if h["model_files"]
                 else "nothing")
        rows.append((h["host"], str(h["exit_code"]), f"{h['duration']:.1f}s", h["outcome"],
                     (h["failure"] or "-")[:100], model))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    if report["first_failure"]:
        lines.append(f"first to end badly: {report['first_failure']}; the last host exited "
                     f"{report['death_to_last_exit']:.1f} s after it")
    if report["deadline_reached"]:
        lines.append("the --deadline was reached: simulate stopped every host still running")
    if report["network"] != "netns":
        lines.append(f"network loopback: every host was 127.0.0.1"
                     f"{' (' + report['network_note'] + ')' if report['network_note'] else ''}")
    lines.append(f"exit code {report['exit_code']}; everything is in {report['workdir']} ({report['note']})")
    return "\n".join(lines)
