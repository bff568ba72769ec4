"""SLURM: one launcher per node, started by ``srun --ntasks-per-node=1`` in a batch script or allocation.

Where the host list becomes ``--node-rank``: the step's node list (``SLURM_STEP_NODELIST``, else
``SLURM_JOB_NODELIST``) is expanded as ``scontrol show hostnames`` does (:mod:`hostlist`); its first
host is the master; this node (``SLURMD_NODENAME``, else the host name) must be in it, and its
index there must equal ``SLURM_NODEID``, the node rank.

Processes per node: ``SLURM_GPUS_ON_NODE``, else the GPU ids this node was given (``SLURM_STEP_GPUS``, else
``SLURM_JOB_GPUS``: ``"2,3"`` is 2; not every SLURM sets ``SLURM_GPUS_ON_NODE``, and a shared node shows all
its GPUs in ``/dev`` where cgroups deny the job all but its own), else the GPUs the node shows, else 1
(``--nproc-per-node`` overrides it: :func:`launcher.command.cluster_for`). Master port: ``20000 + SLURM_JOB_ID % 10000``
(20000-29999, below Linux's ephemeral ports), so two jobs sharing a node do not clash;
``--master-port`` chooses another.

Wrong use is refused before anything starts: a step with several tasks on a node (``SLURM_LOCALID`` > 0,
or more than one task per node in ``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_NTASKS_PER_NODE``): use
``--ntasks-per-node=1``; the batch script itself on a job of several nodes (no step): use ``srun``.

Stops: ``scancel`` sends SIGCONT+SIGTERM to every process of the step, SIGKILL ``KillWait`` (30 s by
default) later; the grace period (25 s) ends inside it. SLURM shows no failure reason: the report
goes to stderr (the job's output file) and the exit code is the worker's own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Optional

from launcher.cluster import Cluster, is_host_name
from launcher.errors import ConfigError, digits_value, shown
from launcher.platforms.base import HostView, Platform, nproc_per_node, whole_number

PORT_BASE, PORT_SPAN = 20000, 10000
#: SLURM job ids are unsigned 32-bit (slurm.h ``uint32_t job_id``): MaxJobId defaults to 67,043,328
#: (read_config.h ``DEFAULT_MAX_JOB_ID`` 0x03ff0000), ids below 2^26 are a cluster's own and a federated id
#: adds its cluster's number (1-63) << 26, up to 4,294,901,759; the bound, 2^32 - 2, lies just beyond it.
MAX_JOB_ID = 2**32 - 2
JOB_ID_RULE = "SLURM job ids are unsigned 32-bit"
NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
GPU_ID_VARIABLES = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS")  # the global ids of this step's / job's GPUs on the node
_TASK_COUNT = re.compile(r"^(\d+)(?:\(x\d+\))?$")  # SLURM's "2(x3)": 2 tasks on each of 3 nodes


def port_for(job_id: int) -> int:
    """The rendezvous port of a job: ``20000 + job_id % 10000``."""
    return PORT_BASE + job_id % PORT_SPAN


def max_tasks_per_node(text: str, name: str) -> int:
    """The largest count in SLURM's task layout (``"2(x3),1"`` -> 2)."""
    counts = []
    for item in text.split(","):
        match = _TASK_COUNT.match(item.strip())
        if not match or digits_value(match.group(1)) is None:
            raise ConfigError(f"{name} is not a SLURM task layout: {shown(text)}")
        counts.append(int(match.group(1)))
    return max(counts)


def gpu_id_count(environ: Mapping[str, str], name: str) -> Optional[int]:
    """How many GPUs ``name`` lists (SLURM's comma list of GPU ids, ``"2,3"`` -> 2); None when unset, empty or
    ``NoDevFiles`` (what SLURM writes for GPUs that gres.conf gives no device files)."""
    text = environ.get(name, "").strip()
    if not text or text == "NoDevFiles":
        return None
    ids = [digits_value(part) for part in text.split(",")]
    if None in ids or len(set(ids)) != len(ids):
        raise ConfigError(f"{name} is not a list of distinct GPU ids (\"0,1\"): {shown(text)}")
    return len(ids)


def _check_one_task_per_node(environ: Mapping[str, str]) -> None:
    advice = "start one launcher per node: srun --ntasks-per-node=1 ..."
    local_id = whole_number(environ, "SLURM_LOCALID")
    if local_id:
        raise ConfigError(f"SLURM_LOCALID={local_id}: several tasks of this step run on this node; {advice}")
    # The step's own layout; SLURM_NTASKS_PER_NODE may be the job's, inherited from the batch script.
    name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE") if environ.get(n, "").strip()),
                None)
    if name is not None and max_tasks_per_node(environ[name], name) > 1:
        raise ConfigError(f"{name}={shown(environ[name])}: more than one task per node; {advice}")


def read_hosts(environ: Mapping[str, str]) -> tuple[str, tuple[str, ...]]:
    """The variable the node list came from, and its hosts in SLURM's order."""
    from launcher.platforms import hostlist

    name = next((n for n in NODELIST_VARIABLES if environ.get(n, "").strip()), None)
    if name is None:
        raise ConfigError(f"SLURM job without a node list: none of {', '.join(NODELIST_VARIABLES)} is set")
    try:
        hosts = hostlist.expand(environ[name])
    except hostlist.HostlistError as exc:
        raise ConfigError(f"{name} is not a SLURM host list ({exc}): {shown(environ[name])}") from None
    bad = next((h for h in hosts if not is_host_name(h)), None)
    if bad is not None:
        raise ConfigError(f"{name}: {shown(bad)} is not a host name: {shown(environ[name])}")
    if len(set(hosts)) != len(hosts):
        duplicate = next(h for h in hosts if hosts.count(h) > 1)
        raise ConfigError(f"{name} names host {duplicate!r} twice: {shown(environ[name])}")
    return name, tuple(hosts)


class Slurm(Platform):
    """SLURM jobs: ``srun --ntasks-per-node=1 ddp-launcher train.py`` on every node of the step."""

    name = "slurm"
    reads = ("SLURM_STEP_NODELIST or SLURM_JOB_NODELIST (expanded), SLURM_NODEID, SLURMD_NODENAME, "
             "SLURM_GPUS_ON_NODE (else SLURM_STEP_GPUS/SLURM_JOB_GPUS); port 20000 + SLURM_JOB_ID % 10000")
    grace_period = 25.0  # scancel: SIGKILL KillWait (30 s by default) after SIGTERM

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        if not environ.get("SLURM_JOB_ID"):
            return ()
        return tuple(f"{name} is set" for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NODEID")
                     if environ.get(name))

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        job_id = whole_number(environ, "SLURM_JOB_ID", minimum=1, maximum=MAX_JOB_ID, rule=JOB_ID_RULE)
        source, hosts = read_hosts(environ)
        if environ.get("SLURM_STEP_ID", "").strip():
            _check_one_task_per_node(environ)  # in the batch script, the task layout is the job's, not ours
        elif len(hosts) > 1:
            raise ConfigError(f"run in the batch script of a {len(hosts)}-node job ({source}="
                              f"{shown(environ[source])}), not in a job step: start it on every node with "
                              "srun --ntasks-per-node=1 ...")
        current = environ.get("SLURMD_NODENAME", "").strip() or host.name
        if current not in hosts:
            short = current.split(".")[0]
            if short not in hosts:
                raise ConfigError(f"this node {current!r} (SLURMD_NODENAME, else the host name) is not in "
                                  f"{source}={shown(environ[source])}")
            current = short
        rank = hosts.index(current)
        node_id = whole_number(environ, "SLURM_NODEID")
        if node_id is not None and node_id != rank:
            raise ConfigError(f"SLURM_NODEID={node_id} but this node {current!r} is number {rank} of "
                              f"{source}={shown(environ[source])}")
        evidence = [f"{source}={environ[source]}: {len(hosts)} host(s); this node {current!r} is node {rank}"]
        counts = [("SLURM_GPUS_ON_NODE", whole_number(environ, "SLURM_GPUS_ON_NODE"))]
        counts += [(name, gpu_id_count(environ, name)) for name in GPU_ID_VARIABLES]
        nproc = nproc_per_node(host, evidence, counts)
        port = port_for(job_id) if job_id is not None else None
        if port is not None:
            evidence.append(f"master port {port} = {PORT_BASE} + SLURM_JOB_ID {job_id} % {PORT_SPAN}")
        step = environ.get("SLURM_STEP_ID", "").strip()
        return Cluster(platform=self.name, nnodes=len(hosts), node_rank=rank, nproc_per_node=nproc,
                       current_host=current, master_addr=hosts[0], master_port=port, hosts=hosts,
                       local_addr=current, job_name=f"slurm-{job_id}" + (f".{step}" if step else ""),
                       evidence=tuple(evidence))


PLATFORM = Slurm()
