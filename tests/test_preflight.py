"""Before torchrun starts, every host resolves the names it needs, or says which one it waited for."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from conftest import PYTHON, launcher_env

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
    env = launcher_env(SAGEMAKER_BASE_DIR=str(tmp_path), LAUNCHER_RDZV_TIMEOUT="2")
    start = time.monotonic()
    proc = subprocess.run([PYTHON, "-m", "launcher", "train.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "'a.invalid'" in errors[0] and "gave up waiting" in errors[0], proc.stderr
    assert "torchrun started" not in proc.stderr
    assert time.monotonic() - start < 30


@pytest.mark.job
def test_a_single_host_whose_name_does_not_resolve_still_runs(tmp_path):
    write_host(tmp_path, ["solo.invalid"], "solo.invalid")
    env = launcher_env(SAGEMAKER_BASE_DIR=str(tmp_path))
    proc = subprocess.run([PYTHON, "-m", "launcher", "train.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--local-addr" not in proc.stderr
