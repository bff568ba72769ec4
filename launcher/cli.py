"""``ddp-launcher`` / ``python -m launcher``: start one torchrun on this host of a training cluster.

Usage::

    ddp-launcher [options] train.py [script args...]
    ddp-launcher --train-script train.py [script args and options in any order]   # SageMaker form
    ddp-launcher simulate --hosts 2 [...] -- train.py [script args...]             # see simulate
    ddp-launcher bundle train.py --out DIR       # stage what a SageMaker estimator uploads

Options (each also ``LAUNCHER_<NAME>`` in the environment; see :mod:`launcher.options`)::

    --train-script PATH      the training script
    --nproc-per-node N       processes per host (default: SM_NUM_GPUS, SM_NUM_NEURONS, GPUs, 1)
    --master-port PORT       rendezvous port on the first host (default 7777, as on SageMaker)
    --rdzv-timeout SECONDS   how long hosts wait for each other (default 900)
    --max-restarts N         torchrun restarts of the workers (default 0)
    --grace-period SECONDS   after SIGTERM/SIGINT/SIGHUP, time before everything is killed (default 90)
    --resolve H=ADDR,...     addresses for host names this machine cannot resolve (simulated hosts)
    --dry-run [--json]       print the platform, evidence, cluster, torchrun argv and environment

Exit codes: 0 when every worker succeeded; else the root-cause worker's own exit code, 128+N when
it died of signal N, 128+N when the launcher was stopped by signal N and the workers did not finish
cleanly, 2 for bad input (nothing is started then).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Optional

from launcher import hyperparameters, streams
from launcher.cluster import Cluster
from launcher.command import Launch, build_launch
from launcher.errors import ConfigError
from launcher.options import Invocation, parse_invocation
from launcher.platforms import resolve_cluster, sagemaker

PROG = "ddp-launcher"
JOB_MARKER = "DDP_LAUNCHER_JOB"  # in torchrun's environment, so in everything the job starts


def log(message: str) -> None:
    """One line of the launcher's own, on stderr. Never fails (stderr may be closed or a dead pipe)."""
    streams.write(sys.stderr, f"[{PROG}] {message}\n")


class Plan(NamedTuple):
    """Everything decided before anything starts."""

    invocation: Invocation
    cluster: Cluster
    launch: Launch
    notes: tuple[str, ...]


def _repair_argv(argv: Sequence[str], environ: Mapping[str, str], notes: list[str]) -> list[str]:
    path = sagemaker.config_path(environ, "hyperparameters.json")
    if not os.path.isfile(path):
        return list(argv)
    raw = sagemaker.read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {raw!r}")
    repaired = hyperparameters.repair_split_argv(argv, raw)
    if repaired is None:
        return list(argv)
    notes.append(f"the argv was split at spaces by an old AWS toolkit; rebuilt it from {path}: "
                 f"{shlex.join(repaired)}")
    return repaired


def _check_script(script: str) -> None:
    if not os.path.isfile(script):
        raise ConfigError(f"training script not found: {script!r} (in {os.getcwd()})")
    if not os.access(script, os.R_OK):
        raise ConfigError(f"training script is not readable: {script!r}")


def plan(argv: Sequence[str], environ: Mapping[str, str], run_dir: Optional[str] = None) -> Plan:
    """Read the options, the platform's files and variables; decide the launch. Starts nothing.

    The run directory (``$TMPDIR/ddp-launcher-<pid>-<random hex>``) and the job's marker variable
    (``DDP_LAUNCHER_JOB=<pid>-<random hex>``, the same token) are new for every run: no run can
    read an earlier one's files or be mistaken for it. :func:`make_run_dir` creates the directory.
    """
    notes: list[str] = []
    invocation = parse_invocation(_repair_argv(argv, environ, notes), environ)
    cluster = resolve_cluster(environ, invocation.options.nproc_per_node)
    _check_script(invocation.script)
    token = f"{os.getpid()}-{os.urandom(8).hex()}"
    run_dir = run_dir or os.path.join(os.environ.get("TMPDIR") or "/tmp", f"{PROG}-{token}")
    launch = build_launch(cluster, invocation.options, invocation.script, invocation.script_args,
                          environ, run_dir)
    launch = launch._replace(env_changes={**launch.env_changes, JOB_MARKER: token})
    return Plan(invocation, cluster, launch, tuple(notes) + launch.notes)


def make_run_dir(path: str) -> None:
    """Create the run directory, private (0700) and new: an existing one is never reused."""
    try:
        os.mkdir(path, 0o700)
    except OSError as exc:
        raise ConfigError(f"cannot create the run directory {path!r} (TMPDIR): "
                          f"{exc.strerror or exc}"[:300]) from None


def describe(p: Plan, as_json: bool) -> str:
    """The dry run's text: platform, evidence, cluster, torchrun argv, environment changes."""
    if as_json:
        return json.dumps({"platform": p.cluster.platform, "evidence": list(p.cluster.evidence),
                           "cluster": p.cluster.to_dict(), "argv": list(p.launch.argv),
                           "env": dict(p.launch.env_changes), "notes": list(p.notes)}, indent=2)
    c = p.cluster
    master = f"{c.master_addr}:{p.invocation.options.master_port}" if c.nnodes > 1 else "(standalone)"
    lines = [f"platform:  {c.platform}",
             *[("evidence:  " if i == 0 else "           ") + e for i, e in enumerate(c.evidence)],
             f"cluster:   host {c.current_host}, node {c.node_rank} of {c.nnodes}, master {master}, "
             f"{c.nproc_per_node} process(es) per node, world size {c.nnodes * c.nproc_per_node}",
             f"command:   {shlex.join(p.launch.argv)}",
             *[("env:       " if i == 0 else "           ") + f"{k}={v}"
               for i, (k, v) in enumerate(p.launch.env_changes.items())],
             *[f"note:      {n}" for n in p.notes]]
    return "\n".join(lines)


def run(p: Plan, environ: Mapping[str, str]) -> int:
    """Start and supervise torchrun; report the outcome. Returns the launcher's exit code.

    The run directory (made by :func:`make_run_dir`) is removed at the end, or by the watchdog
    after it killed the job if the launcher itself is killed.
    """
    from launcher import failure, proctree  # not needed by --dry-run: imported here to keep start-up short
    from launcher.supervise import supervise

    c = p.cluster
    for note in p.notes:
        log(note)
    log(f"{c.platform} host {c.current_host}: node {c.node_rank} of {c.nnodes}, "
        f"{c.nproc_per_node} process(es) per node; {shlex.join(p.launch.argv)}")
    watchdog = proctree.Watchdog()  # forked before any pipe exists: it holds none of them
    try:
        watchdog.kill_marked(f"{JOB_MARKER}={p.launch.env_changes[JOB_MARKER]}")
        watchdog.remove_dir(p.launch.run_dir)
        options = p.invocation.options
        outcome = supervise(p.launch, environ, options.grace_period, log, watchdog, options.max_restarts)
        cause = failure.find_root_cause(outcome, p.launch)
        code = failure.exit_code(outcome, cause)
        if code != 0:
            rendezvous = (f"{c.master_addr}:{options.master_port} as node {c.node_rank} of {c.nnodes}, "
                          f"timeout {options.rdzv_timeout} s") if c.nnodes > 1 else ""
            report = failure.compose_report(c, outcome, cause, code, rendezvous)
            if c.base_dir is not None:
                failure.write_failure_file(c.base_dir, report)
            streams.write(sys.stdout, "")  # flushes: the report comes after the job's output
            streams.write(sys.stderr, report + "\n")
        elif outcome.stop_signal is not None:
            log("stopped by a signal; every worker finished cleanly")
        return code
    finally:
        import shutil  # only at the end

        shutil.rmtree(p.launch.run_dir, ignore_errors=True)
        watchdog.release()
        proctree.reap_children()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line. Returns the exit code."""
    streams.ensure_standard_fds()
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:
        streams.settle_output()


def _main(args: list[str]) -> int:
    if args and args[0] == "simulate":
        from launcher.simulate import main as simulate_main

        return simulate_main(args[1:])
    if args and args[0] == "bundle":
        from launcher.bundle import main as bundle_main

        return bundle_main(args[1:])
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    environ = dict(os.environ)
    try:
        p = plan(args, environ)
        if not p.invocation.options.dry_run:
            make_run_dir(p.launch.run_dir)
    except ConfigError as exc:
        streams.write(sys.stderr, f"{PROG}: error: {exc}\n")
        return 2
    if p.invocation.options.dry_run:
        print(describe(p, p.invocation.options.json))
        return 0
    return run(p, environ)
