"""``ddp-launcher simulate``: run N hosts of a cluster platform as N launcher processes on this machine.

Usage::

    ddp-launcher simulate --hosts N | --instance-groups NAME=TYPE:COUNT,... [--platform P]
        [--nproc-per-node K] [--workdir DIR]
        [--job-name NAME] [--fault HOST:KIND:AFTER[:SECONDS] ...] [--grace-period S]
        [--network netns|loopback] [--platform-stop on|off] [--deadline S]
        [SageMaker: --instance-type ml.m5.xlarge --channel NAME=DIR ... --hyperparameters JSON --toolkit]
        [SageMaker SDK 3.x: --sdk v3 --sm-drivers DIR [--code DIR]]
        [kubeflow: --kubeflow-legacy]
        -- script.py args...

``--platform`` is ``sagemaker`` (the default), ``kubeflow``, ``kubeflow-v2``, ``oci``, ``vertex``,
``env``, ``slurm`` or ``pbs``. Each host gets exactly the variables and files that platform gives a real node (each
builder in ``launcher/simulate/hosts/`` cites the platform's source); the launcher on each host must
find its platform by itself (simulate never sets ``LAUNCHER_PLATFORM``). Host names are the
platform's; how they resolve depends on the network (below).

The options every platform has make the neutral job description (:mod:`launcher.simulate.job`, parsed by
:mod:`launcher.simulate.config`); a platform's own options are declared and checked by its builder
(``add_options``, ``check_options``: SageMaker's in :mod:`launcher.simulate.hosts.sagemaker_options`,
``--kubeflow-legacy`` in the Kubeflow builder), shown by ``--help`` in a group per platform, and refused
(exit 2) with another ``--platform``.

Network (``--network``; default ``netns`` where permitted: root, or unprivileged user namespaces;
else ``loopback``, and the log and the summary say so and why):

- ``netns``: every host is a host of its own (:mod:`launcher.simulate.netns`): its own network
  namespace with ``eth0`` at ``10.88.0.<i+1>`` on a bridge, its own hostname (the platform's name for
  it: ``algo-1``, ``<job>-master-0``, ``node-0``, ...) and its own ``/etc/hosts`` mapping every host's
  names to their addresses (``DIR/hosts``, bound over ``/etc/hosts`` in the host's private mount
  namespace). So the launcher resolves names exactly as on the platform: no ``LAUNCHER_RESOLVE``.
  Namespaces, bridge and subnet are private to the run (an outer namespace per run): parallel runs
  never collide, and nothing is left afterwards, even when simulate is SIGKILLed. PIDs are the machine's.
- ``loopback``: every host is 127.0.0.1; ``LAUNCHER_RESOLVE`` maps every name to it (nothing on the
  machine is edited). No ``partition`` or ``blip`` fault.

- ``sagemaker``: hosts ``algo-1`` .. ``algo-N``, each an ``/opt/ml`` tree and the ``SM_*`` variables
  (below); started as ``python launch.py <hyperparameters>`` in ``code/``.
- ``kubeflow`` (PyTorchJob, training-operator v1.9): pods ``<job>-master-0``, ``<job>-worker-<i>``;
  ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``PET_NNODES``, ``PET_NODE_RANK``,
  ``PET_NPROC_PER_NODE`` (``auto`` unless ``--nproc-per-node``), ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``.
  ``--kubeflow-legacy``: an operator before 1.7, one process per pod: ``MASTER_ADDR``, ``MASTER_PORT``,
  ``WORLD_SIZE`` = pods, ``RANK`` = pod index, nothing else.
- ``kubeflow-v2`` (Trainer v2 TrainJob): pods ``<job>-node-0-<i>``, reached as ``<job>-node-0-<i>.<job>``;
  ``PET_NNODES``, ``PET_NPROC_PER_NODE`` (``auto`` unless ``--nproc-per-node``), ``PET_NODE_RANK``,
  ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, and Kubernetes' ``JOB_COMPLETION_INDEX``.
- ``oci`` (Data Science multi-node job runs): nodes ``node-<i>``; ``NODE_RANK``, ``NODE_COUNT``,
  ``INITIAL_CLUSTER_SIZE``, ``JOB_OCID``, ``JOB_RUN_OCID``, ``FQDN`` and ``CLUSTER_NODES_METADATA_FILE``,
  a JSON list of ``{"Rank", "IPAddress"}`` that fills in as the nodes start.
- ``vertex`` (custom training): replicas ``workerpool0-<id>-0`` (the primary), ``workerpool1-<id>-<i>``;
  ``CLUSTER_SPEC`` with ``cluster``, ``environment``, ``task`` (``type``, ``index``) and ``job``.
- ``env`` (Docker Compose, bare metal): hosts ``node-<i>``; ``MASTER_ADDR`` (``node-0``),
  ``MASTER_PORT``, ``NNODES``, ``NODE_RANK``.
- ``slurm``: nodes ``node1`` .. ``nodeN`` with the variables of step 0 of ``srun --ntasks-per-node=1``
  as measured on a real SLURM 22.05 cluster (``SLURM_JOB_ID``, ``SLURM_NODEID``,
  ``SLURM_STEP_NODELIST=node[1-N]``, ``SLURMD_NODENAME``, ... and ``SLURM_TASK_PID``, the launcher's
  own PID).
- ``pbs``: nodes ``node1`` .. ``nodeN``; one ``PBS_NODEFILE`` with a line per process slot (repeats, as
  PBS writes it), ``PBS_JOBID``, ``PBS_O_WORKDIR``, ``PBS_ENVIRONMENT=PBS_BATCH`` and pbsdsh's
  ``PBS_NODENUM``/``PBS_VNODENUM``/``PBS_TASKNUM``. PBS names no current host, so each host runs in
  its own UTS and mount namespace (``unshare``: root, or unprivileged user namespaces) with its
  node's host name and an ``/etc/hosts`` naming every node; where that is not permitted, exit 2.

Every platform but SageMaker starts each host as ``python -m launcher script.py args...`` (the job's
command there) in its own directory ``DIR/<host>/``, with this repository's launcher on ``PYTHONPATH``;
the script and its arguments are passed through untouched. Kubernetes pods also get ``HOSTNAME``
and ``KUBERNETES_SERVICE_HOST``/``_PORT``. Where the platform gives no port (oci, vertex) or no
process count (oci, vertex, env, kubeflow-legacy), simulate sets ``LAUNCHER_MASTER_PORT`` and
``LAUNCHER_NPROC_PER_NODE`` as the job's environment would. Ports are free ports of this machine,
not the platform's fixed ones (23456, 29500), so that ``loopback`` hosts can share the machine.

SageMaker
---------

``-- script.py --epochs 3 --name "a b" --flag`` stands for the estimator's hyperparameters
``{"train-script": "script.py", "epochs": 3, "name": "a b", "flag": true}``: each value is decoded as
JSON where it parses, a key without a value is ``true``. ``--hyperparameters JSON`` gives them
directly; both may be combined (the ``--`` form wins for a key given twice).

Each host ``algo-i`` gets what a SageMaker host gets, written in AWS's formats:

- ``DIR/algo-i/`` is its ``/opt/ml`` (``SAGEMAKER_BASE_DIR``): ``input/config/`` with
  ``resourceconfig.json``, ``hyperparameters.json`` (JSON-encoded values and the ``sagemaker_*``
  entries, as SDK v2 writes them), ``inputdataconfig.json`` and ``checkpointconfig.json``;
  ``input/data/<channel>``; ``code/``; ``model/``; ``output/data/``; ``checkpoints/``.
- ``--instance-groups train=ml.g5.xlarge:2,data=ml.c5.xlarge:1`` (at most 5 groups) makes it a
  heterogeneous job: hosts ``algo-1``.. in the order of the groups; each ``resourceconfig.json`` has
  ``current_group_name``, the group's ``current_instance_type`` and ``instance_groups`` with the
  host's own group first (:mod:`launcher.simulate.hosts.sagemaker_groups`). Which groups train is the
  job's business (the hyperparameter ``launcher-instance-groups``), as on SageMaker.
- The source bundle (:func:`launcher.platforms.sagemaker.bundle.stage_bundle`; a script inside an
  unpacked upload, with ``launch.py`` and ``launcher/`` beside it, takes that directory's other files
  along) is packed once into ``DIR/sourcedir.tar.gz``, the file the SDK uploads;
  ``sagemaker_submit_directory`` names it. Without
  ``--toolkit`` simulate extracts it into each ``code/``; with ``--toolkit`` AWS's toolkit does
  (``files.download_and_extract``), as on SageMaker; with ``--network loopback`` it is told to skip
  its wait for the hosts' names (``SM_STUDIO_LOCAL_MODE``), with ``netns`` it waits as on SageMaker.
- The environment AWS's toolkit gives the entry point (every ``SM_*`` of
  ``sagemaker_training.environment.Environment.to_env_vars()``, plus ``CURRENT_HOST``,
  ``SAGEMAKER_JOB_NAME``, ``SAGEMAKER_REGION``), ``TRAINING_JOB_NAME``, and what an estimator's
  ``environment=`` would carry for a local run: ``LAUNCHER_RESOLVE`` (every host -> 127.0.0.1; only
  with ``--network loopback``), ``LAUNCHER_MASTER_PORT`` (a free port; only with ``--network loopback``: on
  hosts of their own the launcher takes SageMaker's port, 7777, as on SageMaker), ``LAUNCHER_GRACE_PERIOD``,
  ``LAUNCHER_NPROC_PER_NODE``.
- It starts as SageMaker starts it: in ``code/``, ``python launch.py <the argv AWS's toolkit renders
  from hyperparameters.json>``; with ``--toolkit``, through AWS's real ``train`` command.

SageMaker SDK 3.x (``--sdk v3``)
--------------------------------

A job submitted by ``ModelTrainer(source_code=SourceCode(source_dir=..., entry_script="launch.py"))``
runs differently (:mod:`launcher.simulate.hosts.sagemaker_v3` cites the SDK's sources): the code is a
``code`` channel of loose files, the SDK's drivers an ``sm_drivers`` channel, the hyperparameters are
text in the order given (``True`` is ``true``), and the container runs ``/bin/bash -c "chmod +x
/opt/ml/input/data/sm_drivers/sm_train.sh && /opt/ml/input/data/sm_drivers/sm_train.sh"``. Each host
runs exactly that, through the SDK's own files unchanged: ``sm_train.sh`` writes the ``SM_*`` variables
(``SM_HOST_COUNT``, ``SM_CURRENT_HOST_RANK``, ``SM_MASTER_ADDR``, ``SM_HP_*``, ...) with the SDK's
``environment.py``, and its basic script driver starts ``python launch.py --key value ...``. Those files
hard-code ``/opt/ml``, so every host gets a mount namespace of its own (``unshare``: root, or
unprivileged user namespaces; else exit 2) where its tree ``DIR/algo-i`` is ``/opt/ml`` and an
``/etc/hosts`` names every ``algo-i`` at 127.0.0.1. ``--sm-drivers DIR`` is the ``sm_drivers``
channel as uploaded (``.venv-v3/bin/python tools/sm_drivers_v3.py DIR`` writes one with the SDK's own
code); ``--code DIR`` the ``code`` channel as uploaded (default: the bundle staged from the script). The
hosts' ``python3`` is this Python (first on ``PATH``). Stop signals and faults go to each host's
``launch.py`` process: on SageMaker the signal reaches the container's first process, ``bash``, only.

Choices, and why (every platform):

- Default work directory ``./runs/<job-name>``: kept after the run, so the model, the failure files
  and ``summary.json`` can be read afterwards (``/runs/`` is git-ignored).
- OCI's metadata file gets a node's entry once that node's launcher has started, replaced in one step
  (a reader never sees half a file): the first launchers find it incomplete and must wait.
- SageMaker's channels are symlinks to the user's directories: a copy per host would cost N times the
  disk and the time for a real data set. A script that writes into its channel writes the user's files.
- SageMaker's ``network_interface_name`` is the host's own ``eth0`` (``netns``), or ``lo`` (``loopback``:
  every simulated host is 127.0.0.1, which is on ``lo``).
- SageMaker's ``instance_groups`` lists the current host first: SageMaker does not sort that list.
- When a host ends with a failure, is lost or was stopped on purpose, simulate sends SIGTERM to the
  other launchers, as SageMaker stops the remaining instances of a failed job (and Kubeflow's
  default ``runPolicy`` the other pods). Their workers would
  otherwise wait in a collective until gloo gives up (about 20 s, NCCL 10 min). Each launcher gets
  ``--grace-period`` (default 5 s) to stop its workers; a launcher still running 5 s after that is
  killed with its process tree. ``--platform-stop off`` leaves the others running, so that what the
  launchers do by themselves is what gets measured.
- ``--deadline`` (default 86400 s, SageMaker's default ``max_run``): then every host still running is
  stopped the same way, so that no run (a partition with ``--platform-stop off``, say) waits for ever.
- Exit code: that of the first host to end with a non-zero code, in time (the root cause; the others
  mostly end because of it), 0 if every host succeeded.
- Stop signals (SIGINT, SIGTERM, SIGHUP) are forwarded to every launcher; a second one kills every
  host at once. With ``--toolkit`` they go to the launcher the toolkit started: the toolkit forwards
  none (on SageMaker the signal reaches the container's first process only).

Faults: ``--fault algo-2:SIGKILL:5`` kills that host's launcher 5 s after the start (a lost
instance or node: its watchdog kills the workers); ``SIGTERM`` is a spot interruption (or a pod's
eviction). HOST is the platform's name, e.g. ``--platform kubeflow --fault JOB-worker-0:SIGKILL:5``.
``AFTER`` may be ``step=N``: the fault fires when a line of that host's output contains ``step=N``
(or ``step N``). Two faults are not signals: ``algo-2:partition:5`` takes the host's link down (a
partitioned network: its packets vanish both ways, nobody gets a reset; ``netns`` only), and
``algo-2:poweroff:5`` is a power loss: the link goes down, then every process of the host (the
launcher, torchrun, the workers, whatever they started) is SIGKILLed at once; with ``loopback``, the
host's process tree is (its peers then see their connections close). Its launcher's run directory
in ``$TMPDIR``, which its killed watchdog cannot remove, simulate removes at the end.

Transient faults, ``HOST:KIND:AFTER:SECONDS`` (``algo-2:blip:10:5``: 10 s after the host's start, for
5 s; ``algo-1:pause:step=20:10``): each ends by itself after SECONDS, and a host that lives through it
is no failure (the summary lists it: ``transient_faults``; ``--platform-stop`` is not triggered):

- ``blip``: the host's link goes down, then up again (no reset: TCP retransmits; ``netns`` only; the
  master's host too);
- ``pause``: the host's launcher is SIGSTOPped, then SIGCONTinued (a stalled launcher);
- ``vmpause``: every process of the host (its network namespace's; with ``loopback``, its process
  tree) is SIGSTOPped, looked up again until none is new, then SIGCONTinued (a paused VM);
- ``starve``: every process of the host is moved into a cgroup of the ``cpu`` controller (v1
  ``cpu.cfs_quota_us``, or v2 ``cpu.max``) made for the fault next to simulate's own, held to 0.1 %
  of a CPU (1 ms per 1 s), then moved back and the cgroup removed. A keeper process owns the cgroup
  and undoes it also when simulate dies (even by SIGKILL): a host killed while starved would take
  minutes to exit. Needs root or a delegated cgroup, else exit 2 at the start;
- ``saturate``: a busy loop pinned to each CPU the host may run on (its launcher's affinity), started
  by simulate, SIGKILLed by PID at the end (CPU saturation by other processes).

Every transient fault still on when the run ends (the job ended first, the deadline, a stop signal)
is ended then; the log names every PID stopped, moved or started, and the cgroup removed. A bad form
(a transient kind without SECONDS, SECONDS for a signal, SECONDS <= 0) exits 2 with one line.

Standard library only; never imports torch.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Optional

from launcher import streams
from launcher.errors import ConfigError
from launcher.platforms.sagemaker import MASTER_PORT as SAGEMAKER_PORT
from launcher.simulate import faults, netns
from launcher.simulate.config import NETNS_FAULTS, PROG, build_config, parse_fault
from launcher.simulate.hosts import builder
from launcher.simulate.hosts.base import HostSpec, free_port, host_address, write_json
from launcher.simulate.hosts.sagemaker_env import toolkit_env
from launcher.simulate.hosts.sagemaker_files import encode_hyperparameters
from launcher.simulate.hosts.sagemaker_options import script_hyperparameters
from launcher.simulate.job import Config, Fault
from launcher.simulate.run import Simulation, log
from launcher.simulate.summary import format_summary, job_report

# The package's public names: main, and what the tests call directly.
__all__ = ["Fault", "build_config", "encode_hyperparameters", "main", "parse_fault",
           "script_hyperparameters", "toolkit_env"]


def choose_network(config: Config) -> Config:
    """``--network`` decided: netns where permitted unless asked otherwise; raises :class:`ConfigError`
    when namespaces are needed (asked for, or a partition fault) and not permitted."""
    if config.network == "loopback":
        return config
    why = netns.unavailable()
    if why is None:
        return dataclasses.replace(config, network="netns")
    if config.network == "netns":
        raise ConfigError(f"--network netns: {why}")
    partition = next((f for f in config.faults if f.kind in NETNS_FAULTS), None)
    if partition is not None:
        raise ConfigError(f"--fault {partition.host}:{partition.kind} needs network namespaces: {why}")
    return dataclasses.replace(config, network="loopback", network_note=why)


def check_faults(config: Config) -> Config:
    """The faults can be made on this machine; raises :class:`ConfigError` naming the first that cannot."""
    starve = next((f for f in config.faults if f.kind == "starve"), None)
    why = faults.starve_unavailable() if starve is not None else None
    if why is not None:
        raise ConfigError(f"--fault {starve.host}:starve needs a writable cgroup of the cpu controller: {why}")
    return config


def make_lab(config: Config, specs: Sequence[HostSpec]) -> Optional[netns.Lab]:
    """The hosts' namespaces (``--network netns``), every host added, or None."""
    if config.network != "netns":
        return None
    lab = netns.Lab(config.workdir)
    try:
        for i, spec in enumerate(specs):
            lab.add_host(spec.name, host_address(config, i), spec.aliases)
    except BaseException:
        lab.close()
        raise
    return lab


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ddp-launcher simulate``. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config = check_faults(choose_network(build_config(args, os.getcwd())))
        # on hosts of their own (netns) a SageMaker job's launcher takes SageMaker's port, as on SageMaker
        port = SAGEMAKER_PORT if config.platform == "sagemaker" and config.network == "netns" else free_port()
        specs = builder(config.platform).make_hosts(config, os.environ, port)
    except ConfigError as exc:
        streams.write(sys.stderr, f"{PROG}: error: {exc}\n")
        return 2
    network = "netns: each host its own namespaces on a private bridge" if config.network == "netns" else \
        f"loopback: every host is 127.0.0.1{f' ({config.network_note})' if config.network_note else ''}"
    log(f"{config.platform} job {config.job_name}: {len(specs)} host(s) in {config.workdir}, master "
        f"{specs[0].name} ({host_address(config, 0)}):{port}{config.options.started_through()}"
        f"; network {network}")
    try:
        lab = make_lab(config, specs)
    except (OSError, netns.LabError) as exc:
        streams.write(sys.stderr, f"{PROG}: error: cannot make the hosts' network namespaces: {exc}\n")
        return 1
    sim = Simulation(config, specs, lab)
    try:
        sim.run()
    except OSError as exc:
        streams.write(sys.stderr, f"{PROG}: error: cannot start a host: {exc}\n")
        return 1
    finally:
        if lab is not None:
            lab.close()
    for run in sim.runs:
        for armed in run.faults:
            if armed.fired_at is None:
                log(f"fault {armed.fault.host}:{armed.fault.name}:{armed.fault.when()} never fired")
    report = job_report(sim)
    write_json(os.path.join(config.workdir, "summary.json"), report)
    streams.write(sys.stdout, "")  # flushes: the summary comes after the hosts' output
    streams.write(sys.stderr, "\n" + format_summary(report) + "\n")
    return int(report["exit_code"])
