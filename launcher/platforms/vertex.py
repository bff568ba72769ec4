"""Google Vertex AI custom training jobs: the ``CLUSTER_SPEC`` variable.

Vertex AI sets ``CLUSTER_SPEC`` in every replica of a distributed custom job (documented in
cloud.google.com/vertex-ai/docs/training/distributed-training, "CLUSTER_SPEC format")::

    {"cluster": {"workerpool0": ["host-0:2222"], "workerpool1": ["host-1:2222", ...],
                 "workerpool2": [...], "workerpool3": [...]},
     "environment": "cloud", "task": {"type": "workerpool1", "index": 0}, "job": {...}}

Worker pool 0 is the primary replica (exactly one), pool 1 the workers, pool 2 reduction servers and
pool 3 evaluators (neither takes part in the DDP group). Node rank: 0 for the primary, 1 + index for a
worker. Master: the primary's host, with the port of its address. Failure report: the job's logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from launcher.cluster import Cluster
from launcher.errors import ConfigError, shown
from launcher.platforms.base import HostView, Platform, host_and_port, nproc_per_node, parse_json

TRAINING_POOLS = ("workerpool0", "workerpool1")


def _pool(cluster: Mapping[str, Any], name: str, spec: str) -> list[str]:
    pool = cluster.get(name, [])
    if not isinstance(pool, list) or not all(isinstance(a, str) and a for a in pool):
        raise ConfigError(f"CLUSTER_SPEC: cluster.{name} is not a list of HOST:PORT addresses: {shown(spec)}")
    return pool


class VertexAI(Platform):
    """Google Vertex AI custom training (worker pool 0 = the primary, pool 1 = the workers)."""

    name = "vertex"
    fixed_port = True  # CLUSTER_SPEC's port: the one the worker pools are given
    reads = "CLUSTER_SPEC (JSON): workerpool0 = node 0 and the master (host:port), workerpool1 = nodes 1.."

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        return ("CLUSTER_SPEC is set",) if environ.get("CLUSTER_SPEC") else ()

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        spec = environ.get("CLUSTER_SPEC", "")
        data = parse_json(spec, "CLUSTER_SPEC", "a JSON object")
        cluster = data.get("cluster") if isinstance(data, dict) else None
        task = data.get("task") if isinstance(data, dict) else None
        if not isinstance(cluster, dict) or not isinstance(task, dict):
            raise ConfigError(f"CLUSTER_SPEC has no \"cluster\" and \"task\" objects: {shown(spec)}")
        primary, workers = (_pool(cluster, name, spec) for name in TRAINING_POOLS)
        if len(primary) != 1:
            raise ConfigError(f"CLUSTER_SPEC: cluster.workerpool0 must hold exactly one address: {shown(spec)}")
        kind, index = task.get("type"), task.get("index")
        if kind not in TRAINING_POOLS:
            raise ConfigError(f"CLUSTER_SPEC: task.type {shown(kind)} is not a training node (workerpool0 or "
                              "workerpool1): run the launcher only in those pools")
        pool = primary if kind == "workerpool0" else workers
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(pool):
            raise ConfigError(f"CLUSTER_SPEC: task.index {shown(index)} is not in {kind} "
                              f"({len(pool)} address(es)): {shown(spec)}")
        addresses = primary + workers
        hosts = tuple(host_and_port(a, "CLUSTER_SPEC")[0] for a in addresses)
        if len(set(hosts)) != len(hosts):
            raise ConfigError(f"CLUSTER_SPEC: a host is listed twice: {shown(addresses)}")
        master, port = host_and_port(primary[0], "CLUSTER_SPEC cluster.workerpool0")
        rank = index if kind == "workerpool0" else 1 + index
        evidence = [f"CLUSTER_SPEC: {len(hosts)} node(s), task {kind}[{index}] -> node {rank}, master {master}:{port}"]
        nproc = nproc_per_node(host, evidence)
        return Cluster(platform=self.name, nnodes=len(hosts), node_rank=rank, nproc_per_node=nproc,
                       current_host=hosts[rank], master_addr=master, master_port=port, hosts=hosts,
                       local_addr=hosts[rank], evidence=tuple(evidence))


PLATFORM = VertexAI()
