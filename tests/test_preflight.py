"""Before torchrun starts, every host resolves the names it needs, or says which one it waited for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import PYTHON, assert_gone, launcher_env
from test_platforms import oci_metadata

from launcher.cluster import Cluster
from launcher.platforms import sagemaker


def cluster(nnodes, master, local):
    return Cluster("sagemaker", nnodes, 0, 1, "h", master, local_addr=local)


def test_names_torchrun_needs_several_nodes_only_and_never_an_address():
    names = sagemaker.PLATFORM.names_to_wait_for
    assert names(cluster(2, "algo-1", "algo-2")) == ("algo-1", "algo-2")
    assert names(cluster(2, "algo-1", "algo-1")) == ("algo-1",)
    assert names(cluster(2, "10.0.0.1", "fd00::2")) == ()
    assert names(cluster(1, "algo-1", "algo-1")) == ()  # one node: --standalone, no address at all


def write_host(base, hosts, current):
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "resourceconfig.json").write_text(
        json.dumps({"current_host": current, "hosts": hosts}))
    (base / "train.py").write_text("import sys; sys.exit(0)\n")


def test_a_name_that_never_resolves_ends_the_launch_with_one_line(tmp_path):
    # .invalid never resolves (RFC 2606): the launcher must not start torchrun and retry for ever.
    write_host(tmp_path, ["a.invalid", "b.invalid"], "b.invalid")
    (tmp_path / "tmp").mkdir()
    env = launcher_env(SAGEMAKER_BASE_DIR=str(tmp_path), LAUNCHER_RDZV_TIMEOUT="2", TMPDIR=str(tmp_path / "tmp"))
    start = time.monotonic()
    proc = subprocess.run([PYTHON, "-m", "launcher", "train.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "'a.invalid'" in errors[0] and "gave up waiting" in errors[0], proc.stderr
    assert "torchrun started" not in proc.stderr
    assert time.monotonic() - start < 30
    assert os.listdir(tmp_path / "tmp") == []  # the run directory, made before the wait, removed


@pytest.mark.job
def test_a_single_host_whose_name_does_not_resolve_still_runs(tmp_path):
    write_host(tmp_path, ["solo.invalid"], "solo.invalid")
    env = launcher_env(SAGEMAKER_BASE_DIR=str(tmp_path))
    proc = subprocess.run([PYTHON, "-m", "launcher", "train.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--local-addr" not in proc.stderr


def catches(pid: int) -> int:
    """The mask of the signals that process ``pid`` catches (``SigCgt`` of ``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return int(next(line for line in fh if line.startswith("SigCgt:")).split()[1], 16)


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
        return [int(p) for p in fh.read().split()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
@pytest.mark.parametrize("wait", ["host-names", "node-list"])
def test_a_stop_while_waiting_before_torchrun_ends_as_stopped_and_leaves_nothing(tmp_path, wait, sig):
    # Each wait before torchrun starts, up to the rendezvous timeout (900 s by default): for the host names
    # (SageMaker; after the run directory and the watchdog were made) and for the cluster's node list (OCI;
    # before). A stop there (the platform stops the job, the user presses Ctrl-C) ends the launch as
    # `stopped`, 128 + N, with its outcome file, no traceback, no run directory and no process left: before,
    # the signal's default action killed the launcher where it stood (no outcome file, the run directory
    # left in TMPDIR; Ctrl-C printed a traceback).
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    if wait == "host-names":
        write_host(tmp_path, ["a.invalid", "b.invalid"], "b.invalid")
        (tmp_path / "output" / "data").mkdir(parents=True)  # a SageMaker container has it: the outcome goes there
        env = {"SAGEMAKER_BASE_DIR": str(tmp_path)}
        outcome, what = tmp_path / "output" / "data" / "outcome.json", "host name 'a.invalid' to resolve"
    else:
        env = oci_metadata(tmp_path, [{"Rank": 0, "IPAddress": "127.0.0.1"}], 2)  # 1 of 2 nodes listed
        (tmp_path / "train.py").write_text("import sys; sys.exit(0)\n")
        outcome = tmp_path / "outcome.json"
        env["LAUNCHER_OUTCOME_FILE"] = str(outcome)
        what = f"{env['CLUSTER_NODES_METADATA_FILE']} to list all 2 nodes"
    proc = subprocess.Popen([PYTHON, "-m", "launcher", "train.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=launcher_env(**env, LAUNCHER_RDZV_TIMEOUT="120", TMPDIR=str(tmpdir)))
    try:
        # In the wait once SIGTERM and SIGHUP are caught: nothing else in the launcher catches them before torchrun.
        both = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGHUP - 1))
        deadline = time.monotonic() + 60
        while catches(proc.pid) & both != both:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        started = children(proc.pid)  # the watchdog, once the run directory exists
        assert len(started) == (1 if wait == "host-names" else 0) and len(os.listdir(tmpdir)) == len(started)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    code = 128 + sig
    assert proc.returncode == code, err
    line = f"stopped by {sig.name} while waiting for {what} ("
    assert out == "" and "Traceback" not in err and line in err.splitlines()[-1], err
    if wait == "host-names":  # the report, as for any other end: stderr's last line and SageMaker's failure file
        assert err.splitlines()[-1].startswith("b.invalid: stopped by")
        assert (tmp_path / "output" / "failure").read_text().strip() == err.splitlines()[-1]
    else:  # no plan yet: one line, as for bad input
        assert err.count("\n") == 1 and err.startswith("ddp-launcher: stopped by"), err
    data = json.loads(outcome.read_text())
    assert (data["class"], data["exit_code"], data["signal"], data["infrastructure"]) == ("stopped", code, sig.name,
                                                                                          True), data
    assert line in data["root_cause"] and "before torchrun started" in data["root_cause"]
    assert os.listdir(tmpdir) == []  # the run directory removed
    if started:
        assert_gone(started)
