"""Kubeflow PyTorchJob (training-operator v1): one pod per host, ``<job>-master-0`` then
``<job>-worker-0`` .. ``<job>-worker-<N-2>``.

What the operator puts in each pod's environment, from kubeflow/training-operator v1.9
(``pkg/controller.v1/pytorch/envvar.go`` ``setPodEnv`` and ``master.go``, the last release before the
v1 code was removed in commit 7858371b4):

- ``PYTHONUNBUFFERED=1``;
- ``MASTER_PORT`` and ``PET_MASTER_PORT``: the master's ``pytorchjob-port`` (23456 by default;
  here a free port, as a job spec naming its port);
- ``MASTER_ADDR`` and ``PET_MASTER_ADDR``: ``<job>-master-0``;
- ``WORLD_SIZE`` = pods x ``nprocPerNode`` (x 1 when it is ``auto``), ``RANK`` and ``PET_NODE_RANK``
  = the pod index (master 0, worker i -> i+1);
- ``PET_NPROC_PER_NODE`` = ``spec.nprocPerNode``, which the defaulting webhook sets to ``auto``;
- ``PET_NNODES`` = pods (no ``elasticPolicy``).

``--kubeflow-legacy``: training-operator before 1.7, one process per pod (same ``envvar.go`` at v1.6):
``PYTHONUNBUFFERED=0``, ``MASTER_PORT``, ``MASTER_ADDR``, ``WORLD_SIZE`` = pods, ``RANK`` = pod index.

Kubernetes itself gives every container ``HOSTNAME`` (the pod name) and the API server's service
link variables ``KUBERNETES_SERVICE_*``/``KUBERNETES_PORT*`` (127.0.0.1 here; nothing contacts it).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from launcher.simulate.hosts import kubernetes
from launcher.simulate.hosts.base import HostSpec, plain_hosts
from launcher.simulate.job import Config, PlatformOptions, plain_script

NAME = "kubeflow"
SUMMARY_NOTE = kubernetes.SUMMARY_NOTE
HOSTS_HELP = """JOB-master-0, JOB-worker-i: MASTER_ADDR/PORT, WORLD_SIZE, RANK, PET_NNODES, PET_NODE_RANK,
PET_NPROC_PER_NODE, PET_MASTER_ADDR/PORT (--kubeflow-legacy: MASTER_*, WORLD_SIZE, RANK)"""


@dataclass(frozen=True)
class KubeflowOptions(PlatformOptions):
    """``--kubeflow-legacy``: a training-operator before 1.7."""

    legacy: bool = False


def add_options(parser: argparse.ArgumentParser) -> None:
    """Kubeflow's one option, as a group of ``parser``."""
    group = parser.add_argument_group("Kubeflow (--platform kubeflow)")
    group.add_argument("--kubeflow-legacy", action="store_true",
                       help="a training-operator before 1.7 (one process per pod: MASTER_ADDR, MASTER_PORT, "
                            "WORLD_SIZE = pods, RANK = pod index; no PET_*)")


def check_options(args: argparse.Namespace, hosts: Sequence[str], job_name: str, words: Sequence[str],
                  cwd: str) -> tuple[str, tuple[str, ...], KubeflowOptions]:
    """``-- script.py args...``; the job's name must be a Kubernetes name (it is in the pods' names)."""
    kubernetes.check_job_name(job_name, NAME)
    return (*plain_script(words, cwd), KubeflowOptions(args.kubeflow_legacy))


def host_names(job_name: str, count: int) -> tuple[str, ...]:
    """The pods' names: ``<job>-master-0``, then ``<job>-worker-<i>``."""
    return (f"{job_name}-master-0",) + tuple(f"{job_name}-worker-{i}" for i in range(count - 1))


def pod_variables(job_name: str, count: int, index: int, port: int, nproc: Optional[int],
                  legacy: bool = False) -> dict[str, str]:
    """The variables of pod ``index`` of ``count`` (see the module's docstring for their source)."""
    pods = host_names(job_name, count)
    master = pods[0]
    env = kubernetes.kubernetes_variables(pods[index])
    if legacy:
        env.update({"PYTHONUNBUFFERED": "0", "MASTER_PORT": str(port), "MASTER_ADDR": master,
                    "WORLD_SIZE": str(count), "RANK": str(index)})
        return env
    env.update({"PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
                "MASTER_ADDR": master, "PET_MASTER_ADDR": master,
                "WORLD_SIZE": str(count * (nproc or 1)), "RANK": str(index), "PET_NODE_RANK": str(index),
                "PET_NPROC_PER_NODE": str(nproc) if nproc else "auto", "PET_NNODES": str(count)})
    return env


def make_hosts(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write each pod's directory; the pods run ``python -m launcher script.py args...``."""
    count = len(config.hosts)
    legacy = isinstance(config.options, KubeflowOptions) and config.options.legacy

    def variables(index: int, _base: str) -> dict[str, str]:
        env = pod_variables(config.job_name, count, index, port, config.nproc_per_node, legacy)
        if legacy and config.nproc_per_node:  # the old operator has no such field
            env["LAUNCHER_NPROC_PER_NODE"] = str(config.nproc_per_node)
        return env
    return plain_hosts(config, environ, variables, resolve=config.hosts)
