"""``ddp-launcher simulate``: run N SageMaker hosts as N launcher processes on this machine.

Usage::

    ddp-launcher simulate --hosts N [--nproc-per-node P] [--instance-type ml.m5.xlarge]
        [--channel NAME=DIR ...] [--workdir DIR] [--job-name NAME] [--hyperparameters JSON]
        [--toolkit] [--fault HOST:SIGNAL:AFTER ...] [--grace-period S]
        [-- script.py --key value ...]

``-- script.py --epochs 3 --name "a b" --flag`` stands for the estimator's hyperparameters
``{"train-script": "script.py", "epochs": 3, "name": "a b", "flag": true}``: each value is decoded as
JSON where it parses, a key without a value is ``true``. ``--hyperparameters JSON`` gives them
directly; both may be combined (the ``--`` form wins for a key given twice).

Each host ``algo-i`` gets what a SageMaker host gets, written in AWS's formats:

- ``DIR/algo-i/`` is its ``/opt/ml`` (``SAGEMAKER_BASE_DIR``): ``input/config/`` with
  ``resourceconfig.json``, ``hyperparameters.json`` (JSON-encoded values and the ``sagemaker_*``
  entries, as SDK v2 writes them), ``inputdataconfig.json`` and ``checkpointconfig.json``;
  ``input/data/<channel>``; ``code/``; ``model/``; ``output/data/``; ``checkpoints/``.
- The source bundle (:func:`launcher.bundle.stage_bundle`) is packed once into
  ``DIR/sourcedir.tar.gz``, the file the SDK uploads; ``sagemaker_submit_directory`` names it. Without
  ``--toolkit`` simulate extracts it into each ``code/``; with ``--toolkit`` AWS's toolkit does
  (``files.download_and_extract``), as on SageMaker.
- The environment AWS's toolkit gives the entry point (every ``SM_*`` of
  ``sagemaker_training.environment.Environment.to_env_vars()``, plus ``CURRENT_HOST``,
  ``SAGEMAKER_JOB_NAME``, ``SAGEMAKER_REGION``), ``TRAINING_JOB_NAME``, and what an estimator's
  ``environment=`` would carry for a local run: ``LAUNCHER_RESOLVE`` (every host -> 127.0.0.1),
  ``LAUNCHER_MASTER_PORT`` (a free port), ``LAUNCHER_GRACE_PERIOD``, ``LAUNCHER_NPROC_PER_NODE``.
- It starts as SageMaker starts it: in ``code/``, ``python launch.py <the argv AWS's toolkit renders
  from hyperparameters.json>``; with ``--toolkit``, through AWS's real ``train`` command.

Choices, and why:

- Default work directory ``./runs/<job-name>``: kept after the run, so the model, the failure files
  and ``summary.json`` can be read afterwards (``/runs/`` is git-ignored).
- Channels are symlinks to the user's directories: a copy per host would cost N times the disk and
  the time for a real data set. A script that writes into its channel writes the user's files.
- ``network_interface_name`` is ``lo``: every simulated host is 127.0.0.1, which is on ``lo``.
- ``instance_groups`` lists the current host first: SageMaker does not sort that list.
- When a host ends with a failure, is lost or was stopped on purpose, simulate sends SIGTERM to the
  other launchers, as SageMaker stops the remaining instances of a failed job. Their workers would
  otherwise wait in a collective until gloo gives up (about 20 s, NCCL 10 min). Each launcher gets
  ``--grace-period`` (default 5 s) to stop its workers; a launcher still running 5 s after that is
  killed with its process tree.
- Exit code: that of the first host to end with a non-zero code, in time (the root cause; the others
  mostly end because of it), 0 if every host succeeded.
- Stop signals (SIGINT, SIGTERM, SIGHUP) are forwarded to every launcher; a second one kills every
  host at once. With ``--toolkit`` they go to the launcher the toolkit started: the toolkit forwards
  none (on SageMaker the signal reaches the container's first process only).

Faults: ``--fault algo-2:SIGKILL:5`` kills that host's launcher 5 s after the start (a lost
instance: its watchdog kills the workers); ``SIGTERM`` is a spot interruption. ``AFTER`` may be
``step=N``: the fault fires when a line of that host's output contains ``step=N`` (or ``step N``).

Standard library only; never imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Optional

from launcher import streams
from launcher.errors import ConfigError
from launcher.simulate.config import PROG, Fault, build_config, parse_fault, script_hyperparameters
from launcher.simulate.environment import ADDRESS, free_port, toolkit_env
from launcher.simulate.run import Simulation, log
from launcher.simulate.sagemaker_files import encode_hyperparameters
from launcher.simulate.summary import format_summary, job_report
from launcher.simulate.tree import make_tree, write_json

# The package's public names: main, and what the tests call directly.
__all__ = ["Fault", "build_config", "encode_hyperparameters", "main", "make_tree", "parse_fault",
           "script_hyperparameters", "toolkit_env"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ddp-launcher simulate``. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config = build_config(args, os.getcwd())
        port = free_port()
        specs = make_tree(config, os.environ, port)
    except ConfigError as exc:
        streams.write(sys.stderr, f"{PROG}: error: {exc}\n")
        return 2
    log(f"job {config.job_name}: {len(specs)} host(s) in {config.workdir}, master "
        f"{ADDRESS}:{port}{', through AWS toolkit' if config.toolkit else ''}")
    sim = Simulation(config, specs)
    try:
        sim.run()
    except OSError as exc:
        streams.write(sys.stderr, f"{PROG}: error: cannot start a host: {exc}\n")
        return 1
    for run in sim.runs:
        for armed in run.faults:
            if armed.fired_at is None:
                log(f"fault {armed.fault.host}:{armed.fault.name}:{armed.fault.when()} never fired")
    report = job_report(sim)
    write_json(os.path.join(config.workdir, "summary.json"), report)
    streams.write(sys.stdout, "")  # flushes: the summary comes after the hosts' output
    streams.write(sys.stderr, "\n" + format_summary(report) + "\n")
    return int(report["exit_code"])
