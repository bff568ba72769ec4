"""Amazon SageMaker training jobs: files under ``/opt/ml`` and the ``SM_*`` variables.

Where a host list becomes ``--node-rank``: :func:`resolve` sorts the host names as strings, as
SageMaker's own ``resourceconfig.json`` does, so every host computes the same order, the same
master (the first host) and its own rank as its index in that order.

Sources, in order of trust:

1. ``$SAGEMAKER_BASE_DIR/input/config/resourceconfig.json`` (default base ``/opt/ml``);
2. ``SM_HOSTS`` (JSON list) and ``SM_CURRENT_HOST``, set by AWS's toolkit (SDK v2 containers);
3. ``SM_HOST_COUNT``, ``SM_CURRENT_HOST_RANK`` and ``SM_MASTER_ADDR`` (SDK v3 ``ModelTrainer``).

Processes per host: the ``--nproc-per-node`` option, else ``SM_NUM_GPUS``, else ``SM_NUM_NEURONS``
(a zero counts as absent), else the GPUs the host shows, else 1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Optional

from launcher.cluster import Cluster
from launcher.errors import ConfigError
from launcher.platforms.devices import count_gpus

NAME = "sagemaker"
DEFAULT_BASE_DIR = "/opt/ml"


def base_dir(environ: Mapping[str, str]) -> str:
    """The SageMaker base directory (``SAGEMAKER_BASE_DIR``, as AWS's toolkit names it)."""
    return environ.get("SAGEMAKER_BASE_DIR") or DEFAULT_BASE_DIR


def config_path(environ: Mapping[str, str], name: str) -> str:
    """Path of ``input/config/<name>`` under the base directory."""
    return os.path.join(base_dir(environ), "input", "config", name)


def detect(environ: Mapping[str, str]) -> bool:
    """True on a SageMaker host (or a simulated one)."""
    return (os.path.isfile(config_path(environ, "resourceconfig.json"))
            or any(environ.get(v) for v in ("SM_HOSTS", "SM_HOST_COUNT", "SM_CURRENT_HOST",
                                             "TRAINING_JOB_NAME")))


def read_json(path: str) -> Any:
    """Load a JSON file; a malformed or unreadable one is a :class:`ConfigError` naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"malformed JSON in {path}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def _whole_number(environ: Mapping[str, str], name: str) -> Optional[int]:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name} is not a whole number: {environ[name]!r}") from None
    if value < 0:
        raise ConfigError(f"{name} is negative: {environ[name]!r}")
    return value


def _check_hosts(hosts: Any, current: Any, source: str) -> tuple[tuple[str, ...], str]:
    if not isinstance(hosts, list) or not hosts:
        raise ConfigError(f"{source}: the host list is empty or not a list: {hosts!r}")
    for host in hosts:
        if not isinstance(host, str) or not host.strip():
            raise ConfigError(f"{source}: empty or non-text host name {host!r} in {hosts!r}")
    seen: set[str] = set()
    for host in hosts:
        if host in seen:
            raise ConfigError(f"{source}: duplicate host {host!r} in {hosts!r}")
        seen.add(host)
    if not isinstance(current, str) or current not in seen:
        raise ConfigError(f"{source}: current host {current!r} is not in the host list {hosts!r}")
    return tuple(sorted(hosts)), current


def nproc_per_node(environ: Mapping[str, str], requested: Optional[int], evidence: list[str],
                   dev_dir: str = "/dev") -> int:
    """Processes per host: the option, else SM_NUM_GPUS, else SM_NUM_NEURONS, else GPUs, else 1."""
    if requested is not None:
        evidence.append(f"--nproc-per-node {requested}")
        return requested
    for name in ("SM_NUM_GPUS", "SM_NUM_NEURONS"):
        value = _whole_number(environ, name)
        if value:
            evidence.append(f"{name}={value}")
            return value
        if value == 0:
            evidence.append(f"{name}=0")
    gpus = count_gpus(dev_dir)
    if gpus:
        evidence.append(f"{gpus} GPU device(s) in {dev_dir}")
        return gpus
    evidence.append("no GPU or Neuron device: 1 process (CPU, gloo)")
    return 1


def resolve(environ: Mapping[str, str], requested_nproc: Optional[int] = None,
            dev_dir: str = "/dev") -> Cluster:
    """This host's view of the SageMaker cluster. Raises :class:`ConfigError` on bad input."""
    evidence: list[str] = []
    resource_path = config_path(environ, "resourceconfig.json")
    interface = environ.get("SM_NETWORK_INTERFACE_NAME") or None
    instance_type = environ.get("SM_CURRENT_INSTANCE_TYPE") or None
    if os.path.isfile(resource_path):
        config = read_json(resource_path)
        if not isinstance(config, dict):
            raise ConfigError(f"{resource_path}: expected a JSON object, found {config!r}")
        hosts, current = _check_hosts(config.get("hosts"), config.get("current_host"), resource_path)
        interface = config.get("network_interface_name") or interface
        instance_type = config.get("current_instance_type") or instance_type
        evidence.append(f"{resource_path}: hosts {list(config['hosts'])}, current_host {current!r}")
        master: Optional[str] = hosts[0]
        nnodes, rank = len(hosts), hosts.index(current)
    elif environ.get("SM_HOSTS"):
        try:
            listed = json.loads(environ["SM_HOSTS"])
        except ValueError:
            raise ConfigError(f"SM_HOSTS is not a JSON list of host names: {environ['SM_HOSTS']!r}") \
                from None
        hosts, current = _check_hosts(listed, environ.get("SM_CURRENT_HOST"), "SM_HOSTS/SM_CURRENT_HOST")
        evidence.append(f"SM_HOSTS={environ['SM_HOSTS']}, SM_CURRENT_HOST={current}")
        master = hosts[0]
        nnodes, rank = len(hosts), hosts.index(current)
    elif environ.get("SM_HOST_COUNT"):
        nnodes = _whole_number(environ, "SM_HOST_COUNT") or 0
        if nnodes < 1:
            raise ConfigError(f"SM_HOST_COUNT must be at least 1: {environ['SM_HOST_COUNT']!r}")
        rank = _whole_number(environ, "SM_CURRENT_HOST_RANK")
        if rank is None or rank >= nnodes:
            raise ConfigError(f"SM_CURRENT_HOST_RANK must be 0-{nnodes - 1} for SM_HOST_COUNT={nnodes}: "
                              f"{environ.get('SM_CURRENT_HOST_RANK')!r}")
        hosts = ()
        current = environ.get("SM_CURRENT_HOST") or f"algo-{rank + 1}"
        master = environ.get("SM_MASTER_ADDR") or "algo-1"
        evidence.append(f"SM_HOST_COUNT={nnodes}, SM_CURRENT_HOST_RANK={rank}, master {master}")
    else:
        raise ConfigError(f"SageMaker job without a host list: neither {resource_path} nor SM_HOSTS "
                          "nor SM_HOST_COUNT is there")
    nproc = nproc_per_node(environ, requested_nproc, evidence, dev_dir)
    return Cluster(
        platform=NAME,
        nnodes=nnodes,
        node_rank=rank,
        nproc_per_node=nproc,
        current_host=current,
        master_addr=master,
        hosts=hosts,
        network_interface=interface,
        instance_type=instance_type,
        base_dir=base_dir(environ),
        job_name=environ.get("TRAINING_JOB_NAME") or None,
        evidence=tuple(evidence),
    )
