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

from launcher import hyperparameters
from launcher.cluster import Cluster
from launcher.command import Launch, build_launch
from launcher.errors import ConfigError
from launcher.options import Invocation, parse_invocation
from launcher.platforms import resolve_cluster, sagemaker

PROG = "ddp-launcher"


def log(message: str) -> None:
    """One line of the launcher's own, on stderr."""
    sys.stderr.write(f"[{PROG}] {message}\n")
    sys.stderr.flush()


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
    """Read the options, the platform's files and variables; decide the launch. Starts nothing."""
    notes: list[str] = []
    invocation = parse_invocation(_repair_argv(argv, environ, notes), environ)
    cluster = resolve_cluster(environ, invocation.options.nproc_per_node)
    _check_script(invocation.script)
    run_dir = run_dir or os.path.join(os.environ.get("TMPDIR") or "/tmp", f"{PROG}-{os.getpid()}")
    launch = build_launch(cluster, invocation.options, invocation.script, invocation.script_args,
                          environ, run_dir)
    return Plan(invocation, cluster, launch, tuple(notes) + launch.notes)


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
    """Start and supervise torchrun; report the outcome. Returns the launcher's exit code."""
    from launcher import failure  # not needed by --dry-run: imported here to keep start-up short
    from launcher.supervise import supervise

    c = p.cluster
    for note in p.notes:
        log(note)
    log(f"{c.platform} host {c.current_host}: node {c.node_rank} of {c.nnodes}, "
        f"{c.nproc_per_node} process(es) per node; {shlex.join(p.launch.argv)}")
    try:
        outcome = supervise(p.launch, environ, p.invocation.options.grace_period, log)
        cause = failure.find_root_cause(outcome, p.launch)
        code = failure.exit_code(outcome, cause)
        if code != 0:
            options = p.invocation.options
            rendezvous = (f"{c.master_addr}:{options.master_port} as node {c.node_rank} of {c.nnodes}, "
                          f"timeout {options.rdzv_timeout} s") if c.nnodes > 1 else ""
            report = failure.compose_report(c, outcome, cause, code, rendezvous)
            notes = []
            if c.base_dir is not None:
                path = os.path.join(c.base_dir, "output", "failure")
                problem = failure.write_failure_file(path, report, failure.REPORT_LIMIT)
                if problem:
                    notes.append(f"[{PROG}] could not write the failure report to {path}: {problem}")
            failure.print_report(report, notes)
        elif outcome.stop_signal is not None:
            log("stopped by a signal; every worker finished cleanly")
        return code
    finally:
        import shutil  # only at the end

        shutil.rmtree(p.launch.run_dir, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
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
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    if p.invocation.options.dry_run:
        print(describe(p, p.invocation.options.json))
        return 0
    return run(p, environ)
