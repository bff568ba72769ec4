"""Google Vertex AI custom training: worker pool 0 holds the primary replica, pool 1 the workers.

What a replica gets, from Vertex AI's "Distributed training" page (the ``CLUSTER_SPEC`` section):
``CLUSTER_SPEC``, a JSON object with ``cluster`` (each pool's replicas as ``host:port``, port 2222),
``environment`` (``"cloud"``), ``task`` (this replica's ``type``, its pool, and ``index`` in it) and
``job`` (the ``CustomJobSpec`` the job was created with). Replica host names have the form
``workerpool<p>-<id>-<i>`` (the form seen in ``CLUSTER_SPEC`` values since 2023).

Vertex gives no rendezvous port for torchrun and no process count: ``LAUNCHER_MASTER_PORT`` (a free
port) and, with ``--nproc-per-node``, ``LAUNCHER_NPROC_PER_NODE`` stand for the worker pool spec's
``env``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping
from typing import Any, Optional

from launcher.simulate.hosts.base import HostSpec, plain_hosts
from launcher.simulate.job import Config

NAME = "vertex"
SUMMARY_NOTE = "Vertex would upload only what the script writes to AIP_MODEL_DIR (gs://)"
HOSTS_HELP = "workerpool0-ID-0, workerpool1-ID-i: CLUSTER_SPEC"
PORT = 2222  # Vertex's port in CLUSTER_SPEC


def _job_id(job_name: str) -> str:
    return hashlib.sha1(job_name.encode()).hexdigest()[:10]


def host_names(job_name: str, count: int) -> tuple[str, ...]:
    """``workerpool0-<id>-0`` (the primary), then ``workerpool1-<id>-<i>`` for the workers."""
    job_id = _job_id(job_name)
    return (f"workerpool0-{job_id}-0",) + tuple(f"workerpool1-{job_id}-{i}" for i in range(count - 1))


def job_spec(count: int, command: list[str]) -> dict[str, Any]:
    """The ``CustomJobSpec``: one primary replica in pool 0, ``count - 1`` workers in pool 1."""
    pool = {"machineSpec": {"machineType": "n1-standard-4"},
            "containerSpec": {"imageUri": "simulated", "command": command}, "diskSpec": {}}
    pools = [{**pool, "replicaCount": "1"}]
    if count > 1:
        pools.append({**pool, "replicaCount": str(count - 1)})
    return {"workerPoolSpecs": pools}


def cluster_spec(job_name: str, count: int, index: int, command: list[str]) -> dict[str, Any]:
    """``CLUSTER_SPEC`` for replica ``index`` (0: the primary, in pool 0; i: worker i-1 in pool 1)."""
    names = host_names(job_name, count)
    cluster = {"workerpool0": [f"{names[0]}:{PORT}"]}
    if count > 1:
        cluster["workerpool1"] = [f"{name}:{PORT}" for name in names[1:]]
    task = {"type": "workerpool0", "index": 0} if index == 0 else {"type": "workerpool1", "index": index - 1}
    return {"cluster": cluster, "environment": "cloud", "task": task, "job": job_spec(count, command)}


def replica_variables(job_name: str, count: int, index: int, port: int, nproc: Optional[int],
                      command: list[str]) -> dict[str, str]:
    """Replica ``index``'s variables (see the module's docstring for their source)."""
    env = {"CLUSTER_SPEC": json.dumps(cluster_spec(job_name, count, index, command)),
           "LAUNCHER_MASTER_PORT": str(port)}
    if nproc:
        env["LAUNCHER_NPROC_PER_NODE"] = str(nproc)
    return env


def make_hosts(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write each replica's directory; the replicas run ``python -m launcher script.py args...``."""
    count = len(config.hosts)
    command = [sys.executable, "-m", "launcher", config.script, *config.script_args]
    return plain_hosts(config, environ,
                       lambda i, _base: replica_variables(config.job_name, count, i, port,
                                                          config.nproc_per_node, command),
                       resolve=config.hosts)
