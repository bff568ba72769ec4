"""Amazon SageMaker training jobs: files under ``/opt/ml`` and the ``SM_*`` variables.

Where a host list becomes ``--node-rank``: :func:`node_order` sorts the host names as strings, as
SageMaker's own ``resourceconfig.json`` does (``algo-10`` < ``algo-2``), so every host computes the same
order and the same master (the first host); :meth:`SageMaker.resolve` takes this host's index in that
order as its rank. SDK v3's ``SM_HOST_COUNT`` form publishes the rank itself (``SM_CURRENT_HOST_RANK``).

Sources, in order of trust:

1. ``$SAGEMAKER_BASE_DIR/input/config/resourceconfig.json`` (default base ``/opt/ml``);
2. ``SM_HOSTS`` (JSON list) and ``SM_CURRENT_HOST``, set by AWS's toolkit (SDK v2 containers);
3. ``SM_HOST_COUNT``, ``SM_CURRENT_HOST_RANK`` and ``SM_MASTER_ADDR`` (SDK v3 ``ModelTrainer``).

Processes per host: ``SM_NUM_GPUS``, else ``SM_NUM_NEURONS`` (a zero counts as absent), else the GPUs
the host shows, else 1 (``--nproc-per-node`` overrides it: :func:`launcher.command.cluster_for`).
Master port 7777, as AWS's own containers use. Failure report: ``output/failure``, whose first 1024
characters SageMaker shows as the job's FailureReason. StopTrainingJob sends SIGTERM and SIGKILL 120 s later.

SDK 3.x (``ModelTrainer``) jobs need nothing else: SageMaker writes the same ``resourceconfig.json``;
the SDK's basic script driver runs the entry script from ``/opt/ml/input/data/code`` with the
hyperparameters as ``--key value`` pairs in the order given (text as is, anything else as JSON:
``true``, ``[1, 2]``), which is the SageMaker form (:mod:`.argv`); and
:meth:`SageMaker.prepare_argv` leaves such an argv alone (it is never SDK 2.x's rendering split at spaces).

The rest of the SageMaker-only code lives beside this module: ``argv`` (AWS's rendering of
hyperparameters into argv, the repair of an argv an old toolkit split, and the launcher's options
read back from those pairs) and ``bundle`` (what an estimator uploads).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from launcher.cluster import Cluster, is_host_name
from launcher.errors import ConfigError, shown
from launcher.platforms.base import ArgvPairs, HostView, Platform, nproc_per_node, parse_json, read_json, whole_number
from launcher.platforms.devices import rdma_drivers
from launcher.platforms.sagemaker import argv as aws_argv

DEFAULT_BASE_DIR = "/opt/ml"
MASTER_PORT = 7777  # what AWS's PyTorch containers export as MASTER_PORT
SIGNAL_VARIABLES = ("SM_HOSTS", "SM_HOST_COUNT", "SM_CURRENT_HOST", "TRAINING_JOB_NAME")


def base_dir(environ: Mapping[str, str]) -> str:
    """The SageMaker base directory (``SAGEMAKER_BASE_DIR``, as AWS's toolkit names it)."""
    return environ.get("SAGEMAKER_BASE_DIR") or DEFAULT_BASE_DIR


def config_path(environ: Mapping[str, str], name: str) -> str:
    """Path of ``input/config/<name>`` under the base directory."""
    return os.path.join(base_dir(environ), "input", "config", name)


def node_order(hosts: Sequence[str]) -> tuple[str, ...]:
    """SageMaker's node order: the host names sorted as strings (``algo-10`` < ``algo-2``); node 0 is
    the master and a host's node rank is its index here."""
    return tuple(sorted(hosts))


def _check_hosts(hosts: Any, current: Any, source: str) -> tuple[list[str], str]:
    """The host list and the current host as given, or a :class:`ConfigError` naming ``source``: a
    non-empty list of distinct, non-empty names that holds ``current``."""
    if not isinstance(hosts, list) or not hosts:
        raise ConfigError(f"{source}: the host list is empty or not a list: {shown(hosts)}")
    for host in hosts:
        if not isinstance(host, str) or not host.strip():
            raise ConfigError(f"{source}: empty or non-text host name {shown(host)} in {shown(hosts)}")
        if not is_host_name(host):
            raise ConfigError(f"{source}: {shown(host)} is not a host name or IP address")
    seen: set[str] = set()
    for host in hosts:
        if host in seen:
            raise ConfigError(f"{source}: duplicate host {shown(host)} in {shown(hosts)}")
        seen.add(host)
    if not isinstance(current, str) or current not in seen:
        raise ConfigError(f"{source}: current host {shown(current)} is not in the host list {shown(hosts)}")
    return hosts, current


class SageMaker(Platform):
    """Amazon SageMaker training jobs (SDK 2.x estimators and SDK 3.x ``ModelTrainer``)."""

    name = "sagemaker"
    reads = ("$SAGEMAKER_BASE_DIR/input/config/resourceconfig.json (default /opt/ml), else SM_HOSTS + "
             "SM_CURRENT_HOST, else SM_HOST_COUNT + SM_CURRENT_HOST_RANK; SM_NUM_GPUS; port 7777")
    grace_period = 90.0  # StopTrainingJob: SIGKILL 120 s after SIGTERM
    report_limit = 1024  # output/failure: the first 1024 characters become the FailureReason

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        found = [f"{name} is set" for name in SIGNAL_VARIABLES if environ.get(name)]
        path = config_path(environ, "resourceconfig.json")
        if os.path.exists(path):
            found.insert(0, f"{path} exists")
        return tuple(found)

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        evidence: list[str] = []
        resource_path = config_path(environ, "resourceconfig.json")
        interface = environ.get("SM_NETWORK_INTERFACE_NAME") or None
        instance_type = environ.get("SM_CURRENT_INSTANCE_TYPE") or None
        if os.path.exists(resource_path):  # a directory there is an error, not an absence
            config = read_json(resource_path)
            if not isinstance(config, dict):
                raise ConfigError(f"{shown(resource_path)}: expected a JSON object, found {shown(config)}")
            listed, current = _check_hosts(config.get("hosts"), config.get("current_host"), shown(resource_path))
            hosts = node_order(listed)
            interface = _text_or(config.get("network_interface_name"), interface)
            instance_type = _text_or(config.get("current_instance_type"), instance_type)
            evidence.append(f"{resource_path}: {len(hosts)} host(s), current_host {current!r}")
            master: Optional[str] = hosts[0]
            nnodes, rank = len(hosts), hosts.index(current)
        elif environ.get("SM_HOSTS"):
            listed = parse_json(environ["SM_HOSTS"], "SM_HOSTS", "a JSON list of host names")
            listed, current = _check_hosts(listed, environ.get("SM_CURRENT_HOST"), "SM_HOSTS/SM_CURRENT_HOST")
            hosts = node_order(listed)
            evidence.append(f"SM_HOSTS: {len(hosts)} host(s), SM_CURRENT_HOST={current}")
            master = hosts[0]
            nnodes, rank = len(hosts), hosts.index(current)
        elif environ.get("SM_HOST_COUNT"):
            nnodes = whole_number(environ, "SM_HOST_COUNT", minimum=1) or 1
            rank = whole_number(environ, "SM_CURRENT_HOST_RANK", maximum=nnodes - 1)
            if rank is None:
                raise ConfigError(f"SM_CURRENT_HOST_RANK must be 0-{nnodes - 1} for SM_HOST_COUNT={nnodes}: "
                                  "not set")
            hosts = ()
            current = environ.get("SM_CURRENT_HOST") or f"algo-{rank + 1}"
            master = environ.get("SM_MASTER_ADDR") or "algo-1"
            evidence.append(f"SM_HOST_COUNT={nnodes}, SM_CURRENT_HOST_RANK={rank}, master {master}")
        else:
            raise ConfigError(f"SageMaker job without a host list: neither {shown(resource_path)} nor SM_HOSTS "
                              "nor SM_HOST_COUNT is there")
        counts = [(name, whole_number(environ, name)) for name in ("SM_NUM_GPUS", "SM_NUM_NEURONS")]
        nproc = nproc_per_node(host, evidence, counts)
        return Cluster(
            platform=self.name,
            nnodes=nnodes,
            node_rank=rank,
            nproc_per_node=nproc,
            current_host=current,
            master_addr=master,
            master_port=MASTER_PORT,
            hosts=hosts,
            local_addr=current,
            network_interface=interface,
            instance_type=instance_type,
            job_name=environ.get("TRAINING_JOB_NAME") or None,
            evidence=tuple(evidence),
        )

    def report_path(self, environ: Mapping[str, str]) -> Optional[str]:
        return os.path.join(base_dir(environ), "output", "failure")

    def fabric_env(self, cluster: Cluster, host: HostView) -> dict[str, str]:
        """NCCL on the job's interface; libfabric on EFA where the host has an EFA device."""
        env = {}
        if cluster.network_interface:
            env["NCCL_SOCKET_IFNAME"] = cluster.network_interface
        if "efa" in rdma_drivers(host.sys_dir).values():
            env.update({"FI_PROVIDER": "efa", "RDMAV_FORK_SAFE": "1"})
        return env

    argv_help = aws_argv.HELP

    def read_argv(self, argv: Sequence[str], names: Sequence[str]) -> Optional[ArgvPairs]:
        """The SageMaker form: AWS's ``--key value`` pairs with ``train-script`` (:mod:`.argv`)."""
        return aws_argv.read_pairs(argv, names)

    def prepare_argv(self, argv: Sequence[str], environ: Mapping[str, str], notes: list[str]) -> list[str]:
        """Rebuild an argv that an AWS toolkit older than 5.1.4 split at spaces."""
        path = config_path(environ, "hyperparameters.json")
        if not os.path.exists(path):
            return list(argv)
        raw = read_json(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"{shown(path)}: expected a JSON object, found {shown(raw)}")
        repaired = aws_argv.repair_split_argv(argv, raw)
        if repaired is None:
            return list(argv)
        notes.append(f"the argv was split at spaces by an old AWS toolkit; rebuilt it from {path}: "
                     f"{shlex.join(repaired)}")
        return repaired


def _text_or(value: Any, fallback: Optional[str]) -> Optional[str]:
    return value if isinstance(value, str) and value else fallback


PLATFORM = SageMaker()
