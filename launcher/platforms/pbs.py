"""PBS (OpenPBS, PBS Pro, Torque; e.g. Palmetto): one launcher per node, started by ``pbsdsh -u`` or ssh.

Where the host list becomes ``--node-rank``: ``PBS_NODEFILE`` lists a line per chunk or core, so
hosts repeat; the launcher keeps each host's first line, in order. The first host is the master;
this node is found by its host name, as written or by its short name (the file may hold
``n1.cluster`` where the node calls itself ``n1``, or the reverse); its index is the node rank.

Processes per node: the GPUs the node shows, else 1 (``--nproc-per-node`` overrides it:
:func:`launcher.command.cluster_for`). Master port:
``20000 + (the digits of PBS_JOBID before the server name) % 10000``, so two jobs sharing a node do
not clash; ``--master-port`` chooses another.

Stops: ``qdel`` sends SIGTERM, then SIGKILL after the server's ``kill_delay`` (10 s by default in
OpenPBS and PBS Pro); the grace period (8 s) ends inside it. The report goes to stderr (the job's
error file); the exit code is the worker's own.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence

from launcher.cluster import Cluster, is_host_name
from launcher.errors import ConfigError, shown
from launcher.filereader import read_bounded
from launcher.platforms.base import HostView, Platform, nproc_per_node
from launcher.platforms.slurm import PORT_BASE, PORT_SPAN

#: A node file holds a line per chunk or per MPI rank (``mpiprocs``; Torque: per core), so its size is
#: hosts x cores x name: 10,624 nodes x 208 cores x 50 bytes (Aurora's FQDNs) is 110 MB. Beyond this is garbage.
MAX_NODEFILE_BYTES = 256 << 20


def unique_hosts(lines: Iterable[str]) -> tuple[str, ...]:
    """The node file's hosts, each once, in the order of their first line (blank lines skipped)."""
    seen: dict[str, None] = {}
    for line in lines:
        host = line.strip()
        if host:
            seen.setdefault(host, None)
    return tuple(seen)


def _lines(data: bytes) -> Iterable[str]:
    """The file's lines one at a time (a node file of millions of lines is never held as a list)."""
    return (line.decode("utf-8", "replace") for line in io.BytesIO(data))


def find_host(hosts: Sequence[str], current: str, source: str) -> int:
    """Index of this node in ``hosts``: its name as written, else the one host with its short name."""
    if current in hosts:
        return hosts.index(current)
    short = current.split(".")[0]
    matches = [i for i, host in enumerate(hosts) if host.split(".")[0] == short]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ConfigError(f"this node {current!r} matches several hosts of {source} by its short name: "
                          f"{shown([hosts[i] for i in matches])}")
    raise ConfigError(f"this node {current!r} is not in {source}: {shown(list(hosts))}")


def port_for(job_id: str) -> int:
    """The rendezvous port of a job: ``20000 + digits % 10000`` (``"1234[5].srv"`` -> digits 12345)."""
    digits = "".join(ch for ch in job_id.split(".")[0] if "0" <= ch <= "9")
    return PORT_BASE + int(digits[-9:] or "0") % PORT_SPAN  # the last digits decide the remainder


class Pbs(Platform):
    """PBS jobs: ``pbsdsh -u ddp-launcher train.py`` (one task per node)."""

    name = "pbs"
    reads = "PBS_NODEFILE (de-duplicated, in order), this host name; port 20000 + PBS_JOBID digits % 10000"
    grace_period = 8.0  # qdel: SIGKILL kill_delay (10 s by default) after SIGTERM

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        if not environ.get("PBS_JOBID") and not environ.get("PBS_NODEFILE"):
            return ()
        return tuple(f"{name} is set" for name in ("PBS_JOBID", "PBS_NODEFILE") if environ.get(name))

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        path = environ.get("PBS_NODEFILE", "").strip()
        if not path:
            raise ConfigError("PBS job without a node file: PBS_NODEFILE is not set")
        data = read_bounded(path, MAX_NODEFILE_BYTES, "PBS_NODEFILE") or b""
        hosts = unique_hosts(_lines(data))
        line_count = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
        bad = next((h for h in hosts if not is_host_name(h)), None)
        if bad is not None:
            raise ConfigError(f"PBS_NODEFILE {shown(path)}: {shown(bad)} is not a host name")
        if not hosts:
            raise ConfigError(f"PBS_NODEFILE {path} lists no host")
        source = f"PBS_NODEFILE {path}"
        rank = find_host(hosts, host.name, source)
        evidence = [f"{source}: {line_count} line(s), {len(hosts)} host(s); this node {hosts[rank]!r} is node {rank}"]
        nproc = nproc_per_node(host, evidence)
        job_id = environ.get("PBS_JOBID", "").strip()
        port = port_for(job_id) if job_id else None
        if port is not None:
            evidence.append(f"master port {port} = {PORT_BASE} + PBS_JOBID {job_id!r} digits % {PORT_SPAN}")
        return Cluster(platform=self.name, nnodes=len(hosts), node_rank=rank, nproc_per_node=nproc,
                       current_host=hosts[rank], master_addr=hosts[0], master_port=port, hosts=hosts,
                       local_addr=hosts[rank], job_name=f"pbs-{job_id}" if job_id else None,
                       evidence=tuple(evidence))


PLATFORM = Pbs()
