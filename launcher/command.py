"""A :class:`Cluster` and the options become the exact torchrun command: a value, printable first.

Several nodes use torchrun's static rendezvous (``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``), the only one where ``--node-rank`` decides placement, so global rank 0 is always
on the first host. One node uses ``--standalone`` (a free port, no master needed).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Optional

from launcher.cluster import Cluster
from launcher.options import Options
from launcher.platforms.devices import has_efa

LOG_PREFIX_TEMPLATE = "[rank${rank}]:"


class Launch(NamedTuple):
    """What would be started: argv, the environment changes, and where torchrun leaves its files."""

    argv: tuple[str, ...]
    env_changes: Mapping[str, str]
    run_dir: str
    error_file: str
    log_dir: str
    notes: tuple[str, ...] = ()

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with the changes applied: the environment torchrun gets."""
        env = dict(base)
        env.update(self.env_changes)
        return env


def address_of(host: str, resolve: Mapping[str, str]) -> str:
    """The address to use for a host name: the ``--resolve`` map's, else the name itself."""
    return resolve.get(host, host)


def _setdefault(changes: dict[str, str], environ: Mapping[str, str], name: str, value: str,
                notes: list[str]) -> None:
    """Set ``name`` unless the user already did: a variable the user set always wins."""
    if name in environ:
        if environ[name] != value:
            notes.append(f"kept {name}={environ[name]} (set by the user) instead of {value}")
    else:
        changes[name] = value


def build_launch(cluster: Cluster, options: Options, script: str, script_args: Sequence[str],
                 environ: Mapping[str, str], run_dir: str, python: Optional[str] = None,
                 dev_dir: str = "/dev") -> Launch:
    """The torchrun argv and environment for this host. Pure: starts and writes nothing."""
    log_dir = os.path.join(run_dir, "logs")
    error_file = os.path.join(run_dir, "torchrun_error.json")
    argv = [python or sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(cluster.nnodes),
            "--nproc-per-node", str(cluster.nproc_per_node)]
    if cluster.nnodes > 1:
        master = address_of(cluster.master_addr or "", options.resolve)
        argv += ["--node-rank", str(cluster.node_rank),
                 "--master-addr", master,
                 "--master-port", str(options.master_port),
                 "--rdzv-backend", "static",
                 "--rdzv-id", cluster.job_name or "ddp-launcher",
                 "--rdzv-conf", f"timeout={options.rdzv_timeout}"]
    else:
        argv += ["--standalone"]
    if cluster.platform != "local":
        argv += ["--local-addr", address_of(cluster.current_host, options.resolve)]
    argv += ["--max-restarts", str(options.max_restarts),
             "--log-dir", log_dir,
             "--tee", "3",
             "--log-line-prefix-template", LOG_PREFIX_TEMPLATE,
             script, *script_args]

    notes: list[str] = []
    changes = {"TORCHELASTIC_ERROR_FILE": error_file}
    _setdefault(changes, environ, "PYTHONUNBUFFERED", "1", notes)
    if cluster.network_interface:
        _setdefault(changes, environ, "NCCL_SOCKET_IFNAME", cluster.network_interface, notes)
    if has_efa(dev_dir):
        _setdefault(changes, environ, "FI_PROVIDER", "efa", notes)
        _setdefault(changes, environ, "RDMAV_FORK_SAFE", "1", notes)
    return Launch(tuple(argv), changes, run_dir, error_file, log_dir, tuple(notes))
