"""``simulate --platform slurm|pbs``: each host gets what SLURM's step 0 or PBS's pbsdsh gives a real node.

Pure tests hold every host's variables and files against the list measured on a real SLURM 22.05
cluster and PBS's documentation (an oracle written here: the node list expanded by python-hostlist,
an independent implementation; the node file read line by line), then prove a round trip through
the launcher's own ``slurm``/``pbs`` modules: every host a distinct node rank, one master. Real
processes prove the command prefixes (SLURM_TASK_PID is the launcher's PID; a PBS host has its own
host name and resolves its peers) and the end-to-end jobs: 2 hosts x 2 processes, world size 4,
global rank 0 on the first host, every PID gone.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import hostlist
import pytest
from conftest import PYTHON, REPO, assert_gone, launcher_env, resolve_cluster
from test_simulate_platforms import two_by_two

from launcher import platforms, simulate
from launcher.errors import ConfigError
from launcher.options import parse_invocation
from launcher.platforms import pbs as pbs_platform
from launcher.simulate.hosts import builder
from launcher.simulate.hosts import pbs as pbs_builder
from launcher.simulate.hosts import slurm as slurm_builder

WORKER = os.path.join(REPO, "tests", "scripts", "launcher_worker.py")
PORT = 23999
COMMON = {"PYTHONPATH", "PYTHONUNBUFFERED", "LAUNCHER_GRACE_PERIOD", "LAUNCHER_RESOLVE"}
# SLURM 22.05, a task of step 0 of `srun --ntasks-per-node=1` on a CPU node (SLURM_TASK_PID: set at exec).
SLURM_VARIABLES = {
    "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_NODEID", "SLURM_PROCID", "SLURM_GTIDS",
    "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE",
    "SLURMD_NODENAME", "SLURM_TOPOLOGY_ADDR", "SLURM_TOPOLOGY_ADDR_PATTERN", "SLURM_CLUSTER_NAME", "SLURM_JOB_NAME",
    "SLURM_JOB_PARTITION", "SLURM_SUBMIT_DIR", "SLURM_SUBMIT_HOST", "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_SRUN_COMM_HOST", "SLURM_CPUS_ON_NODE"}
PBS_VARIABLES = {"PBS_JOBID", "PBS_NODEFILE", "PBS_O_WORKDIR", "PBS_ENVIRONMENT", "PBS_JOBNAME", "PBS_O_HOST",
                 "PBS_QUEUE", "PBS_O_QUEUE", "PBS_TASKNUM", "PBS_NODENUM", "PBS_VNODENUM"}
LAUNCHER_STAND_INS = {"LAUNCHER_MASTER_PORT", "LAUNCHER_NPROC_PER_NODE"}  # what the job script would export


def namespaces_permitted() -> bool:
    try:
        pbs_builder.namespace_command()
    except ConfigError:
        return False
    return True


def launcher_argv() -> tuple[str, ...]:
    """Every host's job command (what comes after the platform's prefix)."""
    return (sys.executable, "-m", "launcher", WORKER, "--steps", "2")


def build(tmp_path: Any, platform: str, hosts: int, *extra: str, environ: Any = None) -> tuple[Any, list]:
    config = simulate.build_config(["--platform", platform, "--hosts", str(hosts), "--workdir",
                                    str(tmp_path / "job"), "--job-name", "hpc", *extra, "--", WORKER,
                                    "--steps", "2"], str(tmp_path))
    return config, builder(platform).make_hosts(config, environ or launcher_env(), PORT)


def added(env: Any, caller: dict[str, str]) -> set[str]:
    return {k for k in env if k not in caller or caller[k] != env[k]} - COMMON


@pytest.fixture
def any_namespace(monkeypatch: Any) -> None:
    """The variables and files do not depend on which unshare form this machine permits."""
    monkeypatch.setattr(pbs_builder, "namespace_command", lambda: pbs_builder.NAMESPACES[0])


# ------------------------------------------------------------------------------------------------
# SLURM
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 3, 12])
def test_slurm_hosts_get_step_zero_variables(tmp_path: Any, monkeypatch: Any, count: int) -> None:
    monkeypatch.chdir(tmp_path)
    config, specs = build(tmp_path, "slurm", count, "--nproc-per-node", "2")
    assert config.hosts == tuple(f"node{i}" for i in range(1, count + 1))
    caller = launcher_env()
    for i, spec in enumerate(specs):
        env = dict(spec.env)
        assert added(env, caller) == SLURM_VARIABLES | LAUNCHER_STAND_INS, spec.name
        same = [("SLURM_JOB_ID", "SLURM_JOBID"), ("SLURM_STEP_ID", "SLURM_STEPID"),
                ("SLURM_NODEID", "SLURM_PROCID", "SLURM_GTIDS"),
                ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST"),
                ("SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES", "SLURM_NTASKS", "SLURM_NPROCS",
                 "SLURM_STEP_NUM_TASKS"),
                ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE"),
                ("SLURMD_NODENAME", "SLURM_TOPOLOGY_ADDR")]
        for names in same:
            assert len({env[n] for n in names}) == 1, names
        assert re.fullmatch(r"\d+", env["SLURM_JOB_ID"]) and env["SLURM_STEP_ID"] == "0"
        assert (env["SLURM_NODEID"], env["SLURM_LOCALID"], env["SLURM_NTASKS_PER_NODE"]) == (str(i), "0", "1")
        assert hostlist.expand_hostlist(env["SLURM_JOB_NODELIST"]) == list(config.hosts)
        assert env["SLURM_JOB_NODELIST"] == ("node1" if count == 1 else f"node[1-{count}]")
        assert env["SLURM_TASKS_PER_NODE"] == ("1" if count == 1 else f"1(x{count})")
        assert env["SLURM_NNODES"] == str(count) and env["SLURMD_NODENAME"] == spec.name == f"node{i + 1}"
        assert env["SLURM_TOPOLOGY_ADDR_PATTERN"] == "node" and env["SLURM_JOB_NAME"] == "hpc"
        assert env["SLURM_SUBMIT_DIR"] == str(tmp_path) and env["SLURM_SUBMIT_HOST"] == os.uname().nodename
        assert env["SLURM_LAUNCH_NODE_IPADDR"] == env["SLURM_SRUN_COMM_HOST"] == "127.0.0.1"
        assert not {"SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES"} & set(env)  # a CPU node
        assert (env["LAUNCHER_MASTER_PORT"], env["LAUNCHER_NPROC_PER_NODE"]) == (str(PORT), "2")
        assert spec.argv == slurm_builder.TASK_PID + launcher_argv() and "LAUNCHER_PLATFORM" not in env
        assert set(dict(item.split("=") for item in env["LAUNCHER_RESOLVE"].split(",")).items()) == \
            {(h, "127.0.0.1") for h in config.hosts}
    assert len({spec.env["SLURM_JOB_ID"] for spec in specs}) == 1
    assert sorted(os.listdir(tmp_path / "job")) == sorted(config.hosts)  # SLURM writes no files


def test_slurm_round_trip_through_the_launcher(tmp_path: Any) -> None:
    config, specs = build(tmp_path, "slurm", 3)
    views = []
    for spec in specs:
        env = dict(spec.env)
        assert platforms.choose(env).platform.name == "slurm"  # detected, not named
        cluster = resolve_cluster(env, parse_invocation(["train.py"], env).options,
                                  platform=platforms.PLATFORMS["slurm"])
        views.append((cluster.node_rank, cluster.nnodes, cluster.master_addr, cluster.master_port,
                      cluster.current_host))
    assert [v[0] for v in views] == [0, 1, 2] and [v[4] for v in views] == list(config.hosts)
    assert {v[1:4] for v in views} == {(3, "node1", views[0][3])}


def test_slurm_task_pid_is_the_launchers_own_pid(tmp_path: Any) -> None:
    _, specs = build(tmp_path, "slurm", 2)
    assert specs[1].argv[-len(launcher_argv()):] == launcher_argv()
    prefix = specs[1].argv[:-len(launcher_argv())]
    probe = [PYTHON, "-c", "import os; print(os.getpid(), os.environ['SLURM_TASK_PID'])"]
    proc = subprocess.Popen([*prefix, *probe], stdout=subprocess.PIPE, text=True, env=dict(specs[1].env))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.split() == [str(proc.pid)] * 2, out
    assert_gone([proc.pid])


def test_the_callers_own_job_variables_never_reach_a_host(tmp_path: Any) -> None:
    """simulate run inside an sbatch or qsub job: the hosts must not see that job."""
    caller = launcher_env(SLURM_JOB_ID="77", SLURM_GPUS_ON_NODE="4", SLURM_LOCALID="3", SLURMD_NODENAME="login1",
                          SLURM_STEP_NODELIST="login1", PBS_JOBID="9.srv", PBS_NODEFILE="/nonexistent")
    for platform in ("env", "slurm"):
        _, specs = build(tmp_path / platform, platform, 2, environ=caller)
        for spec in specs:
            assert platforms.choose(dict(spec.env)).platform.name == platform
            assert not {"SLURM_GPUS_ON_NODE", "PBS_JOBID", "PBS_NODEFILE"} & set(spec.env)
            assert spec.env.get("SLURM_LOCALID", "0") == "0" and spec.env.get("SLURMD_NODENAME") != "login1"


# ------------------------------------------------------------------------------------------------
# PBS
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("count, nproc", [(2, 2), (3, None), (1, 4)])
def test_pbs_hosts_get_the_node_file_and_variables(tmp_path: Any, monkeypatch: Any, any_namespace: None,
                                                   count: int, nproc: Any) -> None:
    monkeypatch.chdir(tmp_path)
    config, specs = build(tmp_path, "pbs", count, *(("--nproc-per-node", str(nproc)) if nproc else ()))
    slots = nproc or 1
    caller = launcher_env()
    node_files = {spec.env["PBS_NODEFILE"] for spec in specs}
    assert len(node_files) == 1  # one file for the job
    lines = Path(node_files.pop()).read_text(encoding="utf-8").splitlines()
    assert lines == [host for host in config.hosts for _ in range(slots)]  # repeats, as PBS writes them
    expected = PBS_VARIABLES | {"LAUNCHER_MASTER_PORT"} | ({"LAUNCHER_NPROC_PER_NODE"} if nproc else set())
    for i, spec in enumerate(specs):
        env = dict(spec.env)
        assert added(env, caller) == expected, spec.name
        assert re.fullmatch(r"\d+\.[\w-]+", env["PBS_JOBID"]) and env["PBS_ENVIRONMENT"] == "PBS_BATCH"
        assert (env["PBS_JOBNAME"], env["PBS_O_WORKDIR"], env["PBS_O_HOST"]) == \
            ("hpc", str(tmp_path), os.uname().nodename)
        assert env["PBS_NODENUM"] == str(i) and lines[int(env["PBS_VNODENUM"])] == spec.name
        assert lines.index(spec.name) == int(env["PBS_VNODENUM"])  # the node's first slot
        assert int(env["PBS_TASKNUM"]) >= 1 and spec.name == f"node{i + 1}"
        # Run as node<i+1>: the namespace command, become.py with the node's name and the job's hosts file.
        prefix = pbs_builder.NAMESPACES[0]
        assert spec.argv[:len(prefix)] == prefix and spec.argv[len(prefix) + 3].endswith("become.py")
        options, program = spec.argv[len(prefix) + 4:spec.argv.index("--")], spec.argv[spec.argv.index("--") + 1:]
        assert options[:2] == ("--hostname", spec.name) and options[2] == "--bind" and options[4] == "/etc/hosts"
        assert program == launcher_argv()
        hosts_file = options[3]
        hosts_lines = Path(hosts_file).read_text(encoding="utf-8").splitlines()
        assert hosts_lines[:count] == [f"127.0.0.1 {host}" for host in config.hosts]
    assert len({spec.env["PBS_TASKNUM"] for spec in specs}) == count


def test_pbs_round_trip_through_the_launcher(tmp_path: Any, monkeypatch: Any, any_namespace: None) -> None:
    config, specs = build(tmp_path, "pbs", 3, "--nproc-per-node", "2")
    views = []
    for spec in specs:
        env = dict(spec.env)
        assert platforms.choose(env).platform.name == "pbs"
        options = parse_invocation(["train.py"], env).options
        cluster = resolve_cluster(env, options, hostname=spec.name, platform=pbs_platform.PLATFORM)
        views.append((cluster.node_rank, cluster.nnodes, cluster.master_addr, cluster.master_port,
                      options.nproc_per_node))
    assert [v[0] for v in views] == [0, 1, 2]
    assert {v[1:] for v in views} == {(3, "node1", views[0][3], 2)}


@pytest.mark.skipif(not namespaces_permitted(), reason="unshare --uts --mount is not permitted here")
def test_pbs_host_has_its_own_name_and_resolves_its_peers(tmp_path: Any) -> None:
    _, specs = build(tmp_path, "pbs", 2)
    prefix = specs[1].argv[:-len(launcher_argv())]
    probe = [PYTHON, "-c", "import os, socket; print(os.getpid(), os.uname().nodename, "
                           "socket.gethostbyname('node1'), socket.gethostbyname(socket.gethostname()))"]
    with open("/etc/hosts", encoding="utf-8") as fh:
        machine_hosts = fh.read()
    proc = subprocess.Popen([*prefix, *probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.split() == [str(proc.pid), "node2", "127.0.0.1", "127.0.0.1"]  # one process: exec, no fork
    assert os.uname().nodename != "node2"  # this machine is untouched
    with open("/etc/hosts", encoding="utf-8") as fh:
        assert fh.read() == machine_hosts
    assert_gone([proc.pid])


def test_pbs_refused_where_namespaces_are_not_permitted(tmp_path: Any) -> None:
    """An ``unshare`` that fails (as in a container without the capability): one line, exit 2, nothing written."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "unshare").write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    (fake / "unshare").chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.run([PYTHON, "-m", "launcher", "simulate", "--platform", "pbs", "--hosts", "2", "--", WORKER],
                          cwd=str(run_dir), env=launcher_env(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "--platform pbs needs a host name per host" in proc.stderr
    assert os.listdir(run_dir) == []


# ------------------------------------------------------------------------------------------------
# Real jobs: 2 hosts x 2 processes
# ------------------------------------------------------------------------------------------------

@pytest.mark.job
@pytest.mark.lab
@pytest.mark.parametrize("platform", ["slurm", pytest.param("pbs", marks=pytest.mark.skipif(
    not namespaces_permitted(), reason="unshare --uts --mount is not permitted here"))])
def test_two_hosts_two_processes(tmp_path: Any, platform: str) -> None:
    sim, code, summary, records = two_by_two(tmp_path, platform, "hj", OMP_NUM_THREADS="1")
    assert [r["world_size"] for r in records] == [4] * 4 and [r["group_rank"] for r in records] == [0, 0, 1, 1]
    assert all(r["params"] == records[0]["params"] for r in records)  # DDP kept every replica identical
    assert any(line.startswith(f"[node1] [ddp-launcher] {platform} host node1: node 0 of 2") for line in sim.err)
    assert any(line.startswith("[node1] [rank0]:rank 0 of 4 done") for line in sim.out), sim.stdout
    if platform == "pbs":  # each host ran under its own kernel host name, the one in the node file
        assert [r["host"] for r in records] == ["node1", "node1", "node2", "node2"]
        assert not [line for line in sim.err if "Unable to resolve hostname" in line]
    assert [h["exit_code"] for h in summary["hosts"]] == [0, 0] and summary["platform"] == platform
    print(f"\n{platform}, 2 hosts x 2 processes: {sim.duration:.1f} s")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
