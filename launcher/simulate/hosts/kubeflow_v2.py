"""Kubeflow Trainer v2 (TrainJob on a JobSet): one pod per host, ``<job>-node-0-<i>``, reachable
as ``<job>-node-0-<i>.<job>`` (the JobSet's headless service is the pods' subdomain).

What the torch plugin puts in the trainer container's environment, from kubeflow/trainer
``pkg/runtime/framework/plugins/torch/torch.go`` (``EnforceMLPolicy``) and ``pkg/constants``:
``PET_NNODES`` = ``numNodes``, ``PET_NPROC_PER_NODE`` = ``numProcPerNode`` (``auto`` when unset),
``PET_NODE_RANK`` = the pod's Job completion index, ``PET_MASTER_ADDR`` = ``<job>-node-0-0.<job>``,
``PET_MASTER_PORT`` = ``ContainerTrainerPort`` (29500; here a free port: every host is this machine).
No ``MASTER_ADDR``, ``RANK`` or ``WORLD_SIZE``. Kubernetes adds ``JOB_COMPLETION_INDEX`` (Indexed
Jobs), ``HOSTNAME`` and the API server's service variables.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Optional

from launcher.simulate.hosts import kubernetes
from launcher.simulate.hosts.base import HostSpec, plain_hosts
from launcher.simulate.job import Config, PlatformOptions, plain_script

NAME = "kubeflow-v2"
SUMMARY_NOTE = kubernetes.SUMMARY_NOTE
HOSTS_HELP = "JOB-node-0-i: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR/PORT"


def host_names(job_name: str, count: int) -> tuple[str, ...]:
    """The pods' host names: ``<job>-node-0-0`` .. ``<job>-node-0-<N-1>``."""
    return tuple(f"{job_name}-node-0-{i}" for i in range(count))


def dns_names(job_name: str, count: int) -> tuple[str, ...]:
    """The names other pods reach them by: ``<job>-node-0-<i>.<job>``."""
    return tuple(f"{name}.{job_name}" for name in host_names(job_name, count))


def pod_variables(job_name: str, count: int, index: int, port: int, nproc: Optional[int]) -> dict[str, str]:
    """The variables of pod ``index`` of ``count`` (see the module's docstring for their source)."""
    env = kubernetes.kubernetes_variables(host_names(job_name, count)[index])
    env.update({"JOB_COMPLETION_INDEX": str(index), "PET_NNODES": str(count),
                "PET_NPROC_PER_NODE": str(nproc) if nproc else "auto", "PET_NODE_RANK": str(index),
                "PET_MASTER_ADDR": dns_names(job_name, count)[0], "PET_MASTER_PORT": str(port)})
    return env


def check_options(args: argparse.Namespace, hosts: Sequence[str], job_name: str, words: Sequence[str],
                  cwd: str) -> tuple[str, tuple[str, ...], PlatformOptions]:
    """``-- script.py args...``; the job's name must be a Kubernetes name (it is in the pods' names)."""
    kubernetes.check_job_name(job_name, NAME)
    return (*plain_script(words, cwd), PlatformOptions())


def make_hosts(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write each pod's directory; the pods run ``python -m launcher script.py args...``."""
    count = len(config.hosts)
    return plain_hosts(config, environ,
                       lambda i, _base: pod_variables(config.job_name, count, i, port, config.nproc_per_node),
                       resolve=config.hosts + dns_names(config.job_name, count))
