"""Kubeflow on Kubernetes: training-operator v1 ``PyTorchJob`` and Trainer v2 ``TrainJob``.

What the operators inject (checked in their sources):

- training-operator v1, ``pkg/controller.v1/pytorch/envvar.go``, ``master.go``, ``elastic.go``
  (github.com/kubeflow/training-operator): with a Master replica every pod gets ``MASTER_ADDR`` =
  ``<job>-master-0``, ``MASTER_PORT`` = the container port named ``pytorchjob-port`` (23456 by
  default), ``WORLD_SIZE`` = pods x nprocPerNode (``auto`` counts as 1), ``RANK`` = the pod's index
  (master 0, worker i -> i+1: a node index, not a process rank); newer operators add
  ``PET_NPROC_PER_NODE`` (default ``auto``), ``PET_NODE_RANK`` = that index and ``PET_NNODES`` = pods.
  An ``elasticPolicy`` adds ``PET_RDZV_ENDPOINT`` = ``<job>-worker-0:<port>``, ``PET_RDZV_BACKEND``,
  ``PET_NNODES`` (``MIN:MAX``), ``PET_MAX_RESTARTS``, ``PET_RDZV_ID``, ``PET_RDZV_CONF``; a job with
  workers only then has no ``RANK``: the node index is the pod name's (``HOSTNAME``) ``-worker-<i>``.
- Trainer v2, ``pkg/runtime/framework/plugins/torch/torch.go`` and ``pkg/constants``
  (github.com/kubeflow/trainer): only ``PET_NNODES``, ``PET_NPROC_PER_NODE`` (``auto``, ``cpu``,
  ``gpu`` or a number), ``PET_NODE_RANK`` (the Job completion index), ``PET_MASTER_ADDR`` =
  ``<job>-node-0-0.<job>``, ``PET_MASTER_PORT`` = 29500.

The launcher keeps torchrun's static rendezvous (global rank 0 on node 0), so an elastic range
``MIN:MAX`` with MIN != MAX is refused. Kubernetes evidence: ``KUBERNETES_SERVICE_HOST``, which the
kubelet sets in every container. Failure report: ``/dev/termination-log`` (Kubernetes shows its
first 4096 bytes as the container's termination message); the pod's grace period is 30 s by default.
The master's pod name resolves only once that pod runs: :meth:`names_to_wait_for` names it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Optional

from launcher.cluster import Cluster
from launcher.errors import ConfigError, digits_value, shown
from launcher.platforms.base import (
    HostView,
    Platform,
    first_set,
    host_and_port,
    node_count,
    node_rank_in,
    nproc_per_node,
    port_number,
    torchrun_nproc,
    whole_number,
)

TERMINATION_LOG = "/dev/termination-log"
V1_DEFAULT_PORT = 23456  # PyTorchJob's default container port "pytorchjob-port"
_WORKER_POD = re.compile(r"^(?P<job>.+)-worker-(?P<index>\d+)$")


def _kubernetes(environ: Mapping[str, str]) -> list[str]:
    return ["KUBERNETES_SERVICE_HOST is set"] if environ.get("KUBERNETES_SERVICE_HOST") else []


def _nproc(environ: Mapping[str, str], host: HostView, evidence: list[str]) -> int:
    if environ.get("PET_NPROC_PER_NODE", "").strip():
        return torchrun_nproc(environ["PET_NPROC_PER_NODE"], "PET_NPROC_PER_NODE", host, evidence)
    return nproc_per_node(host, evidence)


def _port(environ: Mapping[str, str], names: tuple[str, ...]) -> Optional[int]:
    name = first_set(environ, names)
    return port_number(environ, name) if name else None


class _Kubeflow(Platform):
    grace_period = 25.0  # terminationGracePeriodSeconds: SIGKILL 30 s after SIGTERM by default
    fixed_port = True  # MASTER_PORT: the port the master's Service exposes
    report_limit = 4096  # the kubelet keeps the first 4096 bytes of the termination message
    termination_log = TERMINATION_LOG

    def report_path(self, environ: Mapping[str, str]) -> Optional[str]:
        return self.termination_log if os.access(self.termination_log, os.W_OK) else None

    def _cluster(self, environ: Mapping[str, str], host: HostView, nnodes: int, rank: int, nproc: int,
                 master: Optional[str], port: Optional[int], evidence: list[str]) -> Cluster:
        return Cluster(platform=self.name, nnodes=nnodes, node_rank=rank, nproc_per_node=nproc,
                       current_host=environ.get("HOSTNAME") or host.name, master_addr=master,
                       master_port=port, job_name=None, evidence=tuple(evidence))


class KubeflowV1(_Kubeflow):
    """Kubeflow training-operator v1 ``PyTorchJob``: one process per pod, ``nprocPerNode`` or elastic."""

    name = "kubeflow"
    reads = ("KUBERNETES_SERVICE_HOST with MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK (pod index), or "
             "PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR/PORT, elastic PET_RDZV_ENDPOINT")

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        k8s = _kubernetes(environ)
        operator = [f"{n} is set" for n in ("MASTER_ADDR", "WORLD_SIZE", "RANK") if environ.get(n)]
        if len(operator) < 3:
            operator = ["PET_RDZV_ENDPOINT is set"] if environ.get("PET_RDZV_ENDPOINT") else []
        return tuple(k8s + operator) if k8s and operator else ()

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        evidence: list[str] = []
        if not environ.get("MASTER_ADDR") and environ.get("PET_RDZV_ENDPOINT"):
            return self._elastic(environ, host, evidence)
        master = environ.get("PET_MASTER_ADDR") or environ.get("MASTER_ADDR") or None
        port = _port(environ, ("PET_MASTER_PORT", "MASTER_PORT")) or V1_DEFAULT_PORT
        pod_rank = whole_number(environ, "RANK")
        if environ.get("PET_NODE_RANK", "").strip():  # nprocPerNode: PET_* describe nodes
            nnodes = node_count(environ, "PET_NNODES") or whole_number(environ, "WORLD_SIZE", minimum=1) or 1
            rank = node_rank_in(nnodes, whole_number(environ, "PET_NODE_RANK"), "PET_NODE_RANK", "PET_NNODES")
            if pod_rank is not None and pod_rank != rank:
                raise ConfigError(f"RANK={pod_rank} and PET_NODE_RANK={rank} disagree (both are the pod index)")
            evidence.append(f"PET_NNODES={nnodes}, PET_NODE_RANK={rank}, master {master}:{port}")
        else:  # one process per pod: WORLD_SIZE counts pods, RANK is the pod index
            nnodes = whole_number(environ, "WORLD_SIZE", minimum=1) or 1
            rank = node_rank_in(nnodes, pod_rank, "RANK", "WORLD_SIZE")
            evidence.append(f"WORLD_SIZE={nnodes} pods, RANK={rank} (the pod index), master {master}:{port}")
        if nnodes > 1 and not master:
            raise ConfigError(f"MASTER_ADDR is not set (needed with {nnodes} pods)")
        return self._cluster(environ, host, nnodes, rank, _nproc(environ, host, evidence), master, port,
                             evidence)

    def _elastic(self, environ: Mapping[str, str], host: HostView, evidence: list[str]) -> Cluster:
        endpoint_host, port = host_and_port(environ["PET_RDZV_ENDPOINT"], "PET_RDZV_ENDPOINT")
        nnodes = node_count(environ, "PET_NNODES") or 1
        pod = environ.get("HOSTNAME") or host.name
        match = _WORKER_POD.match(pod)
        if not match:
            raise ConfigError(f"HOSTNAME={shown(pod)} is not a PyTorchJob worker pod name (<job>-worker-<i>): "
                              "the node rank of an elastic job without a Master replica comes from it")
        index = digits_value(match["index"])
        if index is None:
            raise ConfigError(f"HOSTNAME={shown(pod)}: the pod index is not a whole number of at most 18 digits")
        rank = node_rank_in(nnodes, index, f"the pod index of {pod}", "PET_NNODES")
        master = f"{match['job']}-worker-0"
        if endpoint_host != master:
            raise ConfigError(f"PET_RDZV_ENDPOINT={shown(environ['PET_RDZV_ENDPOINT'])} is not on {master} (node 0): "
                              "the static rendezvous needs the first pod as its host (leave rdzvHost unset)")
        evidence.append(f"PET_RDZV_ENDPOINT={endpoint_host}:{port}, PET_NNODES={nnodes}, pod {pod} -> node {rank}")
        return self._cluster(environ, host, nnodes, rank, _nproc(environ, host, evidence), master, port,
                             evidence)


class KubeflowV2(_Kubeflow):
    """Kubeflow Trainer v2 ``TrainJob`` (torch runtime): ``PET_*`` variables only."""

    name = "kubeflow-v2"
    reads = "KUBERNETES_SERVICE_HOST with PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR/PORT"

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        names = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR")
        k8s = _kubernetes(environ)
        if k8s and all(environ.get(n) for n in names):
            return tuple(k8s + [f"{n} is set" for n in names])
        return ()

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        evidence: list[str] = []
        nnodes = node_count(environ, "PET_NNODES") or 1
        rank = node_rank_in(nnodes, whole_number(environ, "PET_NODE_RANK"), "PET_NODE_RANK", "PET_NNODES")
        master = environ.get("PET_MASTER_ADDR") or None
        if nnodes > 1 and not master:
            raise ConfigError(f"PET_MASTER_ADDR is not set (needed with PET_NNODES={nnodes})")
        port = _port(environ, ("PET_MASTER_PORT",))
        evidence.append(f"PET_NNODES={nnodes}, PET_NODE_RANK={rank}, master {master}:{port}")
        return self._cluster(environ, host, nnodes, rank, _nproc(environ, host, evidence), master, port,
                             evidence)


PLATFORM = KubeflowV1()
PLATFORM_V2 = KubeflowV2()
