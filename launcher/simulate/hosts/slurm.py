"""SLURM: one launcher per node, as ``srun --ntasks-per-node=1 python -m launcher train.py ...`` starts it
in step 0 of a batch job; nodes ``node1`` .. ``node<N>``.

What each task of that step gets was measured on a real SLURM 22.05 cluster run on this project's
machine (a controller and one ``slurmd`` per node, each node in its own network namespace; see
``launcher/simulate/slurm_lab.py``) when the launcher's ``launcher/platforms/slurm.py`` was written: for node ``i``
of ``N`` (0-based), job ``J``:

- ``SLURM_JOB_ID`` = ``SLURM_JOBID`` = J, ``SLURM_STEP_ID`` = ``SLURM_STEPID`` = 0;
- ``SLURM_NODEID`` = ``SLURM_PROCID`` = ``SLURM_GTIDS`` = i (one task per node), ``SLURM_LOCALID`` = 0;
- ``SLURM_JOB_NODELIST`` = ``SLURM_NODELIST`` = ``SLURM_STEP_NODELIST`` = ``node[1-N]``, compressed as
  SLURM writes it (``node1`` for one node);
- ``SLURM_NNODES`` = ``SLURM_JOB_NUM_NODES`` = ``SLURM_STEP_NUM_NODES`` = N, ``SLURM_NTASKS`` =
  ``SLURM_NPROCS`` = ``SLURM_STEP_NUM_TASKS`` = N, ``SLURM_NTASKS_PER_NODE`` = 1;
- ``SLURM_TASKS_PER_NODE`` = ``SLURM_STEP_TASKS_PER_NODE`` = ``SLURM_JOB_CPUS_PER_NODE`` = ``1(xN)``
  (SLURM's run-length form; ``1`` for one node), ``SLURM_CPUS_ON_NODE`` = 1;
- ``SLURMD_NODENAME`` = ``SLURM_TOPOLOGY_ADDR`` = ``node<i+1>``, ``SLURM_TOPOLOGY_ADDR_PATTERN`` = ``node``;
- ``SLURM_CLUSTER_NAME``, ``SLURM_JOB_NAME``, ``SLURM_JOB_PARTITION``, ``SLURM_SUBMIT_DIR`` (where
  simulate runs, as where ``sbatch`` ran), ``SLURM_SUBMIT_HOST`` (this machine),
  ``SLURM_LAUNCH_NODE_IPADDR`` and ``SLURM_SRUN_COMM_HOST`` (the node ``srun`` ran on: 127.0.0.1);
- ``SLURM_TASK_PID``: the task's own PID. It is known only once the task runs, so each host starts
  under ``sh -c``, which exports its own PID and then ``exec``\\ s the launcher in the same process.

With GPUs SLURM adds ``SLURM_GPUS_ON_NODE`` and ``CUDA_VISIBLE_DEVICES``; simulated nodes have none.
No files. SLURM gives no rendezvous port (the launcher derives one from the job id) and no process
count: ``LAUNCHER_MASTER_PORT`` (a free port, as every node is 127.0.0.1) and, with
``--nproc-per-node``, ``LAUNCHER_NPROC_PER_NODE`` stand for what the batch script would export.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Optional

from launcher.simulate.hosts.base import ADDRESS, HostSpec, job_number, plain_hosts
from launcher.simulate.job import Config

NAME = "slurm"
SUMMARY_NOTE = "each node's files stay in its directory (a real job's submit directory is usually shared)"
HOSTS_HELP = "node1..nodeN: SLURM_JOB_ID, SLURM_NODEID, SLURM_STEP_NODELIST, SLURMD_NODENAME, ..."
CLUSTER, PARTITION = "simulated", "debug"
# The task's PID is the shell's: exec keeps it, so the launcher runs with SLURM_TASK_PID = its own PID.
TASK_PID = ("/bin/sh", "-c", 'SLURM_TASK_PID=$$; export SLURM_TASK_PID; exec "$@"', "sh")


def host_names(job_name: str, count: int) -> tuple[str, ...]:
    """``node1`` .. ``node<N>``: the nodes' names in SLURM's configuration."""
    return tuple(f"node{i}" for i in range(1, count + 1))


def nodelist(count: int) -> str:
    """``node[1-N]`` as SLURM compresses it (``node1`` alone for one node)."""
    return "node1" if count == 1 else f"node[1-{count}]"


def layout(value: int, count: int) -> str:
    """SLURM's run-length form of ``count`` equal values: ``1(x3)``, or ``1`` for one node."""
    return str(value) if count == 1 else f"{value}(x{count})"


def node_variables(job_name: str, count: int, index: int, port: int, nproc: Optional[int],
                   submit_dir: str) -> dict[str, str]:
    """Node ``index``'s variables, ``SLURM_TASK_PID`` aside (see the module's docstring for their source)."""
    name = host_names(job_name, count)[index]
    env = {"SLURM_CLUSTER_NAME": CLUSTER, "SLURM_JOB_NAME": job_name, "SLURM_JOB_PARTITION": PARTITION,
           "SLURM_SUBMIT_DIR": submit_dir, "SLURM_SUBMIT_HOST": os.uname().nodename,
           "SLURM_LAUNCH_NODE_IPADDR": ADDRESS, "SLURM_SRUN_COMM_HOST": ADDRESS, "SLURM_CPUS_ON_NODE": "1",
           "SLURM_TOPOLOGY_ADDR_PATTERN": "node", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1",
           "LAUNCHER_MASTER_PORT": str(port)}
    env.update(dict.fromkeys(("SLURM_JOB_ID", "SLURM_JOBID"), str(job_number(job_name))))
    env.update(dict.fromkeys(("SLURM_STEP_ID", "SLURM_STEPID"), "0"))
    env.update(dict.fromkeys(("SLURM_NODEID", "SLURM_PROCID", "SLURM_GTIDS"), str(index)))
    env.update(dict.fromkeys(("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST"), nodelist(count)))
    env.update(dict.fromkeys(("SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES", "SLURM_NTASKS",
                              "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS"), str(count)))
    env.update(dict.fromkeys(("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE"),
                             layout(1, count)))
    env.update(dict.fromkeys(("SLURMD_NODENAME", "SLURM_TOPOLOGY_ADDR"), name))
    if nproc:
        env["LAUNCHER_NPROC_PER_NODE"] = str(nproc)
    return env


def make_hosts(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write each node's directory; each runs ``python -m launcher script.py args...`` as srun's task."""
    count, submit_dir = len(config.hosts), os.getcwd()
    specs = plain_hosts(config, environ, lambda i, _base: node_variables(
        config.job_name, count, i, port, config.nproc_per_node, submit_dir), resolve=config.hosts)
    return [dataclasses.replace(spec, argv=TASK_PID + spec.argv) for spec in specs]
