"""OCI Data Science multi-node job runs: hosts ``node-0`` .. ``node-<N-1>``, known to each other by IP.

What a node gets, from oracle/accelerated-data-science ``ads/jobs/templates/driver_pytorch.py``
(its ``CONST_ENV_*`` and ``Runner.read_metadata``) and OCI's "Job Environment Variables" page:

- ``NODE_RANK`` (this node's rank) and ``INITIAL_CLUSTER_SIZE`` (the service's, multi-node runs),
  ``NODE_COUNT`` (set by the ADS API);
- ``CLUSTER_NODES_METADATA_FILE``: a JSON list of ``{"Rank": r, "IPAddress": ip}`` that fills in as
  the nodes start (ADS's driver waits until it lists ``node_count`` entries). Simulate adds a node's
  entry to every node's file when that node's launcher has started, replacing the file in one step;
- ``JOB_OCID``, ``JOB_RUN_OCID`` (one run for all nodes) and ``FQDN`` (the node's name).

OCI gives no port and no process count: ``LAUNCHER_MASTER_PORT`` (a free port) and, with
``--nproc-per-node``, ``LAUNCHER_NPROC_PER_NODE`` stand for the job's environment variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from launcher.simulate.hosts.base import ADDRESS, HostSpec, host_address, plain_hosts, write_json_atomically
from launcher.simulate.job import Config

NAME = "oci"
SUMMARY_NOTE = "each node's files stay in its directory"
HOSTS_HELP = "node-i: NODE_RANK, NODE_COUNT, INITIAL_CLUSTER_SIZE, CLUSTER_NODES_METADATA_FILE"
METADATA_FILE = "cluster_nodes_metadata.json"


def host_names(job_name: str, count: int) -> tuple[str, ...]:
    """``node-0`` .. ``node-<N-1>``: OCI names nodes by rank (the metadata file holds their IPs)."""
    return tuple(f"node-{i}" for i in range(count))


def ocids(job_name: str) -> dict[str, str]:
    """The job's and the run's OCIDs, in OCI's format (made up: nothing looks them up)."""
    return {"JOB_OCID": f"ocid1.datasciencejob.oc1.iad.simulated-{job_name}",
            "JOB_RUN_OCID": f"ocid1.datasciencejobrun.oc1.iad.simulated-{job_name}"}


def node_variables(job_name: str, count: int, index: int, metadata_file: str, port: int,
                   nproc: Optional[int]) -> dict[str, str]:
    """Node ``index``'s variables (see the module's docstring for their source)."""
    env = {**ocids(job_name), "NODE_RANK": str(index), "NODE_COUNT": str(count),
           "INITIAL_CLUSTER_SIZE": str(count), "CLUSTER_NODES_METADATA_FILE": metadata_file,
           "FQDN": host_names(job_name, count)[index], "LAUNCHER_MASTER_PORT": str(port)}
    if nproc:
        env["LAUNCHER_NPROC_PER_NODE"] = str(nproc)
    return env


def metadata(started: list[int], addresses: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The metadata file's content once the nodes ``started`` are up, in the order they came up;
    ``addresses[rank]`` is a node's address (default 127.0.0.1)."""
    return [{"Rank": rank, "IPAddress": addresses[rank] if addresses else ADDRESS} for rank in started]


def make_hosts(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write each node's directory; its metadata file appears and grows as the nodes start."""
    count = len(config.hosts)
    files = [os.path.join(config.workdir, name, METADATA_FILE) for name in config.hosts]
    started: list[int] = []
    addresses = [host_address(config, i) for i in range(count)]

    def variables(index: int, _base: str) -> dict[str, str]:
        return node_variables(config.job_name, count, index, files[index], port, config.nproc_per_node)

    def on_start(index: int) -> Callable[[], None]:
        def node_up() -> None:
            started.append(index)
            for path in files:
                write_json_atomically(path, metadata(started, addresses))
        return node_up
    return plain_hosts(config, environ, variables, resolve=config.hosts, on_start=on_start)
