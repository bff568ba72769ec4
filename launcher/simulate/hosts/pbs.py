"""PBS (OpenPBS, PBS Professional, Torque): one launcher per node, as ``pbsdsh -u python -m launcher
train.py ...`` starts it from the job script; nodes ``node1`` .. ``node<N>``.

What each task gets, from the PBS Professional Reference Guide ("PBS Environment Variables") and
the ``qsub(1B)`` and ``pbsdsh(1B)`` manual pages:

- ``PBS_JOBID`` = ``<sequence number>.<server>``; ``PBS_JOBNAME``; ``PBS_QUEUE`` (and ``PBS_O_QUEUE``,
  the queue it was submitted to); ``PBS_O_WORKDIR`` (where ``qsub`` ran: where simulate runs);
  ``PBS_O_HOST`` (the submission host: this machine); ``PBS_ENVIRONMENT`` = ``PBS_BATCH``;
- ``PBS_NODEFILE``: one file shared by the job, written by PBS under ``$PBS_HOME/aux/<jobid>``
  (here ``DIR/aux/<jobid>``), a line per MPI process slot: ``select=N:ncpus=K:mpiprocs=K`` lists each
  node K times in a row (``node1 node1 node2 node2`` for 2 x 2), K = ``--nproc-per-node`` (else 1);
- from ``pbsdsh`` (the TM interface): ``PBS_TASKNUM`` (the TM task id, counted from 1 here),
  ``PBS_NODENUM`` (the node's index, 0-based) and ``PBS_VNODENUM`` (the node file line of its first
  slot, 0-based).

PBS names no current host in a variable: a node knows itself by its kernel host name, and so does
the launcher (``os.uname().nodename``). Each simulated host therefore runs in its own UTS and mount
namespaces: ``unshare --uts --mount`` as root, else ``unshare --user --map-root-user --uts --mount``
where unprivileged user namespaces are allowed. :mod:`launcher.simulate.become` sets the node's host
name, bind-mounts the job's hosts file (every node at 127.0.0.1, then this machine's ``/etc/hosts``)
over ``/etc/hosts`` as a real node resolves its own and its peers' names (torch looks its host name
up: without it, glibc would ask the DNS server), and ``exec``\\ s the launcher, so the host's PID is
the launcher's. Where neither is permitted, ``--platform pbs`` is refused (exit 2) before anything is
written. The network is the machine's; ``LAUNCHER_RESOLVE`` maps every node to 127.0.0.1 as on the
other platforms. With ``--network netns`` none of this is needed: simulate's lab gives every node its
own network, host name and ``/etc/hosts`` (:mod:`launcher.simulate.netns`).

PBS gives no rendezvous port (the launcher derives one from the job id) and no process count:
``LAUNCHER_MASTER_PORT`` (a free port) and, with ``--nproc-per-node``, ``LAUNCHER_NPROC_PER_NODE``
stand for what the job script would export.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Optional

from launcher.errors import ConfigError
from launcher.simulate import become
from launcher.simulate.hosts.base import HostSpec, in_namespaces, job_number, plain_hosts
from launcher.simulate.job import Config

NAME = "pbs"
SUMMARY_NOTE = "each node's files stay in its directory (a real job's PBS_O_WORKDIR is usually shared)"
HOSTS_HELP = "node1..nodeN: PBS_NODEFILE (a line per slot), PBS_JOBID, ...; own host name (unshare)"
SERVER, QUEUE = "pbs-server", "workq"  # workq: the default queue of OpenPBS and PBS Professional
NAMESPACES = become.unshare_forms("--uts", "--mount")


def host_names(job_name: str, count: int) -> tuple[str, ...]:
    """``node1`` .. ``node<N>``: the execution hosts' names, as the server lists them."""
    return tuple(f"node{i}" for i in range(1, count + 1))


def job_identifier(job_name: str) -> str:
    """``PBS_JOBID``: ``<sequence number>.<server>``."""
    return f"{job_number(job_name)}.{SERVER}"


def node_file_text(hosts: tuple[str, ...], slots: int) -> str:
    """The node file: each host on ``slots`` consecutive lines, hosts in the job's order."""
    return "".join(f"{host}\n" * slots for host in hosts)


def node_variables(job_name: str, count: int, index: int, node_file: str, slots: int, port: int,
                   nproc: Optional[int], submit_dir: str) -> dict[str, str]:
    """Node ``index``'s variables (see the module's docstring for their source)."""
    env = {"PBS_JOBID": job_identifier(job_name), "PBS_JOBNAME": job_name, "PBS_QUEUE": QUEUE,
           "PBS_O_QUEUE": QUEUE, "PBS_O_WORKDIR": submit_dir, "PBS_O_HOST": os.uname().nodename,
           "PBS_ENVIRONMENT": "PBS_BATCH", "PBS_NODEFILE": node_file, "PBS_TASKNUM": str(index + 1),
           "PBS_NODENUM": str(index), "PBS_VNODENUM": str(index * slots), "LAUNCHER_MASTER_PORT": str(port)}
    if nproc:
        env["LAUNCHER_NPROC_PER_NODE"] = str(nproc)
    return env


def namespace_command() -> tuple[str, ...]:
    """The ``unshare`` command that gives a host its own host name here, or ConfigError (exit 2)."""
    command = become.first_permitted(NAMESPACES, lambda form: become.probe_succeeds(
        host_argv(form, "probe", "/etc/hosts", (sys.executable, "-S", "-c", "pass"))))
    if command is not None:
        return command
    raise ConfigError("--platform pbs needs a host name per host: 'unshare --uts --mount' (root) or 'unshare "
                      "--user --map-root-user --uts --mount' (unprivileged user namespaces) is not permitted here")


def host_argv(command: tuple[str, ...], name: str, hosts_file: str, argv: tuple[str, ...]) -> tuple[str, ...]:
    """``argv`` run as host ``name`` with ``hosts_file`` as its ``/etc/hosts``, in new namespaces."""
    return become.command(argv, hostname=name, binds=[(hosts_file, "/etc/hosts")], prefix=command)


def make_hosts(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write the job's node file and each node's directory; each runs under its own host name."""
    command = () if in_namespaces(config) else namespace_command()
    count, submit_dir, slots = len(config.hosts), os.getcwd(), config.nproc_per_node or 1
    aux = os.path.join(config.workdir, "aux")
    node_file, hosts_file = os.path.join(aux, job_identifier(config.job_name)), os.path.join(aux, "hosts")

    def variables(index: int, _base: str) -> dict[str, str]:
        if index == 0:  # the work directory exists now: PBS writes the file before the job starts
            os.makedirs(aux)
            for path, text in ((node_file, node_file_text(config.hosts, slots)),
                               (hosts_file, become.hosts_file_text(become.machine_hosts(), config.hosts))):
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(text)
        return node_variables(config.job_name, count, index, node_file, slots, port, config.nproc_per_node,
                              submit_dir)
    specs = plain_hosts(config, environ, variables, resolve=config.hosts)
    if in_namespaces(config):  # the lab already makes each node a host of its own
        return specs
    return [dataclasses.replace(spec, argv=host_argv(command, spec.name, hosts_file, spec.argv)) for spec in specs]
