"""PBS: the node file's corner cases and wrong use. The real 2-host x 2-process job, each host under its own
kernel host name, is tests/test_simulate_hpc.py::test_two_hosts_two_processes[pbs]."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import PYTHON, REPO, launcher_env, resolve_cluster

from launcher import platforms
from launcher.errors import ConfigError
from launcher.options import parse_invocation
from launcher.platforms import pbs

WORKER = os.path.join(REPO, "tests", "scripts", "launcher_worker.py")


def resolve(tmp_path, lines: list[str], host: str, monkeypatch, *argv: str, job: str = "5150.pbs01"):
    node_file = tmp_path / "nodefile"
    node_file.write_text("".join(line + "\n" for line in lines))
    options = parse_invocation([*argv, "train.py"], {}).options
    return resolve_cluster({"PBS_JOBID": job, "PBS_NODEFILE": str(node_file)}, options, hostname=host,
                           platform=pbs.PLATFORM)


@pytest.mark.parametrize("lines, host, rank, hosts", [
    (["n2", "n2", "n1", "n1", "n2"], "n1", 1, ("n2", "n1")),  # a line per chunk or core; first-seen order
    (["n1.cluster.edu", "n1.cluster.edu", "n2.cluster.edu"], "n2", 1, ("n1.cluster.edu", "n2.cluster.edu")),
    (["n1", "n2"], "n2.cluster.edu", 1, ("n1", "n2")),  # the node knows its FQDN, the file short names
    (["n1", "", "n2", "  n3  "], "n3", 2, ("n1", "n2", "n3")),  # blank lines and spaces
])
def test_node_file_hosts_rank_and_master(tmp_path, monkeypatch, lines, host, rank, hosts) -> None:
    c = resolve(tmp_path, lines, host, monkeypatch)
    assert (c.hosts, c.node_rank, c.master_addr, c.nnodes) == (hosts, rank, hosts[0], len(hosts))
    assert (c.current_host, c.master_port, c.nproc_per_node) == (hosts[rank], 25150, 1)


@pytest.mark.parametrize("lines, host, message", [
    (["n1", "n2"], "n3", "this node 'n3' is not in PBS_NODEFILE"),
    (["n1.a", "n1.b"], "n1", "this node 'n1' matches several hosts of PBS_NODEFILE"),
    (["", " "], "n1", "lists no host"),
])
def test_bad_node_files_are_refused(tmp_path, monkeypatch, lines, host, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(tmp_path, lines, host, monkeypatch)


def test_ports_from_job_ids() -> None:
    assert [pbs.port_for(j) for j in ("5150.pbs01", "1234[5].srv", "77", "abc")] == [25150, 22345, 20077, 20000]


def test_detection_and_option() -> None:
    assert platforms.choose({"PBS_JOBID": "1.s", "PBS_NODEFILE": "/x"}).platform is pbs.PLATFORM
    assert not pbs.PLATFORM.detect({"SLURM_JOB_ID": "1"})
    assert pbs.PLATFORM.grace_period + 2 <= 10  # kill_delay's default: SIGKILL 10 s after SIGTERM


def test_this_host_missing_exits_2_before_anything_starts(tmp_path) -> None:
    node_file = tmp_path / "nodefile"
    node_file.write_text("elsewhere1\nelsewhere2\n")
    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    run = subprocess.run([PYTHON, "-m", "launcher", str(script)], capture_output=True, text=True, timeout=30,
                         env=launcher_env(PBS_JOBID="9.s", PBS_NODEFILE=str(node_file)))
    assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, run.stderr
    assert f"is not in PBS_NODEFILE {node_file}: ['elsewhere1', 'elsewhere2']" in run.stderr
    assert not (tmp_path / "train.py.ran").exists()
