"""Oracle Cloud Infrastructure (OCI) Data Science job runs, single- and multi-node.

What the service and Oracle's ADS drivers set (checked in github.com/oracle/accelerated-data-science,
``ads/jobs/templates/driver_pytorch.py`` ``Runner.__init__``/``read_metadata`` and ``driver_utils.py``):

- every job run: ``JOB_RUN_OCID`` and ``JOB_OCID``;
- multi-node job runs ("DTv2"): ``NODE_RANK``, ``NODE_COUNT`` or ``INITIAL_CLUSTER_SIZE`` (the latter
  wins, as in ADS), and ``CLUSTER_NODES_METADATA_FILE``: a JSON list of ``{"Rank": .., "IPAddress": ..}``
  that the service fills in as nodes start. ADS polls it until it lists every node; so does the
  launcher (bounded by ``--rdzv-timeout``, with progress; a dry run reads it once). Master = the
  ``Rank`` 0 address;
- older ADS multi-job-run clusters ("DTv1"): ``OCI__MODE``, ``OCI__WORKER_COUNT`` (nodes = workers + 1),
  ``MAIN_JOB_RUN_OCID`` on workers; the main's address is found through OCI's API (job-run logs),
  which the launcher does not call: it asks for ``MASTER_ADDR`` (or multi-node job runs) instead.

Port: ``MASTER_PORT`` if set, else 29400 (the port ADS's torchrun rendezvous uses). Failure report:
the job run's logs (stderr).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Optional

from launcher.cluster import Cluster
from launcher.errors import ConfigError, shown
from launcher.filereader import MAX_CONFIG_BYTES, read_bounded
from launcher.platforms.base import HostView, Platform, node_rank_in, nproc_per_node, port_number, whole_number

DEFAULT_PORT = 29400
EVIDENCE = ("CLUSTER_NODES_METADATA_FILE", "JOB_RUN_OCID", "MAIN_JOB_RUN_OCID", "OCI__MODE", "OCI__WORKER_COUNT",
            "INITIAL_CLUSTER_SIZE")
METADATA = "CLUSTER_NODES_METADATA_FILE"


def _node_table(nodes: Any, path: str, nnodes: int) -> dict[int, str]:
    """Rank -> IP address from the metadata list; a wrong shape is a :class:`ConfigError` naming the file."""
    if not isinstance(nodes, list):
        raise ConfigError(f"{path}: expected a JSON list of {{\"Rank\", \"IPAddress\"}}, found {shown(nodes)}")
    table: dict[int, str] = {}
    for node in nodes:
        rank = node.get("Rank") if isinstance(node, dict) else None
        address = node.get("IPAddress") if isinstance(node, dict) else None
        if isinstance(rank, str) and rank.strip().isdigit() and len(rank.strip()) <= 9:
            rank = int(rank)
        if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(address, str) or not address:
            raise ConfigError(f"{path}: an entry without a whole-number Rank and an IPAddress: {shown(node)}")
        if not 0 <= rank < nnodes:
            raise ConfigError(f"{path}: Rank {rank} is not a node of {nnodes} (0-{nnodes - 1}): {shown(node)}")
        if rank in table:
            raise ConfigError(f"{path}: Rank {rank} is listed twice: {shown(nodes)}")
        table[rank] = address
    return table


def read_nodes(path: str, nnodes: int) -> tuple[Optional[dict[int, str]], str]:
    """One look at the metadata file: (rank -> address once it lists every node, else None; its state)."""
    data = read_bounded(path, MAX_CONFIG_BYTES, METADATA, missing_ok=True)
    if data is None:
        return None, "the file does not exist yet"
    text = data.decode("utf-8", "replace")
    try:
        nodes = json.loads(text)
    except RecursionError:
        raise ConfigError(f"malformed JSON in {shown(path)}: nested too deeply") from None
    except ValueError:  # being written: a later look sees it whole
        return None, f"not complete JSON yet: {shown(text, 80)}"
    table = _node_table(nodes, path, nnodes)
    if len(table) < nnodes:
        return None, f"{len(table)} of {nnodes} nodes listed"
    return table, "complete"


class OCIDataScience(Platform):
    """OCI Data Science job runs (multi-node job runs, and the older ADS clusters with MASTER_ADDR)."""

    name = "oci"
    reads = ("NODE_RANK, NODE_COUNT or INITIAL_CLUSTER_SIZE, CLUSTER_NODES_METADATA_FILE (waits until it lists "
             "every node; master = Rank 0); older ADS: OCI__WORKER_COUNT with MASTER_ADDR; port 29400")

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        return tuple(f"{name} is set" for name in EVIDENCE if environ.get(name))

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        evidence: list[str] = []
        count_name = next((n for n in ("INITIAL_CLUSTER_SIZE", "NODE_COUNT") if environ.get(n, "").strip()), None)
        if count_name:
            nnodes = whole_number(environ, count_name, minimum=1) or 1
        elif environ.get("OCI__WORKER_COUNT", "").strip():
            nnodes = (whole_number(environ, "OCI__WORKER_COUNT") or 0) + 1
            count_name = "OCI__WORKER_COUNT+1"
        else:
            nnodes, count_name = 1, "no node count"
        port = port_number(environ, "MASTER_PORT") or DEFAULT_PORT
        hosts: tuple[str, ...] = ()
        local: Optional[str] = None
        if nnodes == 1:
            rank, master = 0, None
            evidence.append(f"one node ({count_name})")
        elif environ.get(METADATA):
            rank = node_rank_in(nnodes, whole_number(environ, "NODE_RANK"), "NODE_RANK", count_name)
            path = environ[METADATA]
            table = host.wait(lambda: read_nodes(path, nnodes), f"{path} to list all {nnodes} nodes")
            hosts = tuple(table[i] for i in range(nnodes))
            master, local = hosts[0], hosts[rank]
            evidence.append(f"{environ[METADATA]}: {nnodes} nodes, Rank 0 at {master}; NODE_RANK={rank}")
        elif environ.get("MASTER_ADDR"):
            rank_name = "NODE_RANK" if environ.get("NODE_RANK", "").strip() else "RANK"
            rank = node_rank_in(nnodes, whole_number(environ, rank_name), rank_name, count_name)
            master = environ["MASTER_ADDR"]
            evidence.append(f"{count_name}={nnodes}, {rank_name}={rank}, MASTER_ADDR={master} (set by the user)")
        else:
            mode = "; ".join(f"{n}={shown(environ[n])}" for n in ("OCI__MODE", "OCI__WORKER_COUNT", "MAIN_JOB_RUN_OCID")
                             if environ.get(n))
            raise ConfigError(f"OCI job run with {nnodes} nodes ({mode or count_name}) but no {METADATA}: the main "
                              "node's address is only known through OCI's API; set MASTER_ADDR (and NODE_RANK) in "
                              "the job runs' environment, or use multi-node job runs")
        nproc = nproc_per_node(host, evidence)
        return Cluster(platform=self.name, nnodes=nnodes, node_rank=rank, nproc_per_node=nproc,
                       current_host=local or host.name, master_addr=master, master_port=port, hosts=hosts,
                       local_addr=local, job_name=None, evidence=tuple(evidence))


PLATFORM = OCIDataScience()
