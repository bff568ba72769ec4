"""SageMaker heterogeneous jobs on simulated hosts in network namespaces (``simulate --instance-groups``).

2 hosts of group ``train`` (2 processes each) and 1 of group ``data``; the hyperparameter
``launcher-instance-groups`` names ``train``. The training world is 4 ranks, rank 0 on algo-1; algo-3
runs the script once, without torchrun and with no ``RANK``, and is stopped (SIGTERM, exit 0) when the
training world ends. A lost ``data`` host (its launcher SIGKILLed) stops every host through the job
watch, with the same root cause everywhere. Every process is proven gone by PID.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from conftest import REPO, assert_gone, launcher_env
from test_simulate import Simulate, job_pids, processes_inside, rank_records, read_json

from launcher import jobwatch
from launcher.simulate import netns

WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}"),
              pytest.mark.job, pytest.mark.lab]
SCRIPTS = os.path.join(REPO, "tests", "scripts")
SCRIPT = os.path.join(SCRIPTS, "hetero_job.py")
GROUPS = "train=ml.g5.xlarge:2,data=ml.c5.xlarge:1"
# The job watch's bound for a host whose launcher is SIGKILLed: its connection closes, a loss at once
# (jobwatch: a definite end), then the remote stop's grace period; plus a margin for a loaded 2-core machine.
LOSS_BOUND = jobwatch.REMOTE_GRACE + 10.0


def start(tmp_path: Any, name: str, *args: str, script_args: tuple[str, ...]) -> tuple[Simulate, str]:
    workdir = str(tmp_path / name)
    sim = Simulate(["--instance-groups", GROUPS, "--nproc-per-node", "2", "--workdir", workdir, "--job-name", name,
                    *args, "--", SCRIPT, "--launcher-instance-groups", "train", *script_args], str(tmp_path),
                   launcher_env(HETERO_SCRIPTS=SCRIPTS))
    return sim, workdir


def outside_runs(workdir: str) -> list[dict[str, Any]]:
    path = os.path.join(workdir, "algo-3", "output", "data", "outside.jsonl")
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def all_pids(sim: Simulate, workdir: str, summary: dict) -> list[int]:
    """Every rank, torchrun and launcher (job_pids), and the data host's script and its ancestors below simulate."""
    pids = set(job_pids(rank_records(workdir, 3), sim.proc.pid, summary))
    for run in outside_runs(workdir):
        if "pid" in run:
            chain = run["ancestors"]
            pids.update([run["pid"], *chain[:chain.index(sim.proc.pid)]])
    return sorted(pids)


def test_two_training_hosts_and_a_data_host_end_cleanly(tmp_path: Any) -> None:
    sim, workdir = start(tmp_path, "hetero-ok", script_args=("--steps", "3"))
    code = sim.finish()
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert_gone(all_pids(sim, workdir, summary))
    assert processes_inside(workdir) == []
    assert code == 0 and [h["exit_code"] for h in summary["hosts"]] == [0, 0, 0], sim.stderr
    assert summary["network"] == "netns"
    records = rank_records(workdir, 3)
    assert [r["rank"] for r in records["algo-1"]] == [0, 1] and [r["rank"] for r in records["algo-2"]] == [2, 3]
    assert records["algo-3"] == []
    assert {r["world_size"] for recs in records.values() for r in recs} == {4}
    assert {r["sum"] for recs in records.values() for r in recs} == {10.0}  # 1+2+3+4: the four ranks
    assert {r["env"]["SM_CURRENT_INSTANCE_GROUP"] for r in records["algo-1"] + records["algo-2"]} == {"train"}
    runs = outside_runs(workdir)
    assert len([r for r in runs if "pid" in r]) == 1, runs  # the script ran once
    env = runs[0]["env"]
    assert "RANK" not in env and "WORLD_SIZE" not in env and "LOCAL_RANK" not in env
    assert env["SM_CURRENT_INSTANCE_GROUP"] == "data" and env["SM_CURRENT_HOST"] == "algo-3"
    assert json.loads(env["SM_INSTANCE_GROUPS"]) == ["data", "train"]  # its own group first
    assert env["MASTER_ADDR"] == "algo-1" and env["MASTER_PORT"].isdigit()
    assert runs[-1].get("sigterm") is True  # stopped when the training world ended, and it chose exit 0
    assert "the training world has ended and this host's script with it" in sim.stderr
    assert "job watch: the training world has ended: SIGTERM to the script" in sim.stderr


def test_a_lost_data_host_stops_every_host_with_one_root_cause(tmp_path: Any) -> None:
    # step 50 of the data host: 5 s after the master answered. At step 5 (0.5 s) a CI run under load killed algo-3's
    # launcher 2.3 s into the job, before it had joined the job watch: a host that never reached the hub runs
    # without the watch (Watch.members), so nothing stopped the others and the test ran over.
    sim, workdir = start(tmp_path, "hetero-lost", "--fault", "algo-3:SIGKILL:step=50", "--platform-stop", "off",
                         "--deadline", "300",
                         script_args=("--steps", "0", "--step-sleep", "0.1", "--serve-wait-master"))
    code = sim.finish()
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert_gone(all_pids(sim, workdir, summary))
    assert processes_inside(workdir) == []
    hosts = {h["host"]: h for h in summary["hosts"]}
    assert code == 137 and hosts["algo-3"]["exit_code"] == 137, sim.stderr
    for host in ("algo-1", "algo-2"):
        assert hosts[host]["exit_code"] == 137, sim.stderr
        assert hosts[host]["failure"].startswith("algo-3 lost: connection closed"), hosts[host]["failure"]
    records = rank_records(workdir, 3)
    assert all(r["sigterm"] for recs in records.values() for r in recs)  # stopped, not crashed
    elapsed = summary["fault_to_last_exit"]
    assert elapsed < LOSS_BOUND, elapsed
    print(f"\nthe data host lost (SIGKILL): every host ended {elapsed:.1f} s after the fault "
          f"(bound {LOSS_BOUND:g} s)")


def test_a_failing_rank_stops_the_data_host_with_its_root_cause(tmp_path: Any) -> None:
    sim, workdir = start(tmp_path, "hetero-fail", "--platform-stop", "off", "--deadline", "120",
                         script_args=("--steps", "0", "--step-sleep", "0.1", "--fail-rank", "3", "--exit-code", "7"))
    code = sim.finish()
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert_gone(all_pids(sim, workdir, summary))
    assert processes_inside(workdir) == []
    assert code == 7 and [h["exit_code"] for h in summary["hosts"]] == [7, 7, 7], sim.stderr
    for host in summary["hosts"]:
        assert host["failure"].startswith("algo-2: rank 3 (local rank 1) exited with code 7"), host["failure"]
    with open(os.path.join(workdir, "algo-3", "output", "failure"), encoding="utf-8") as fh:
        assert "\nthen algo-3: its workers were stopped because of that" in fh.read()  # the data host's own part
    runs = outside_runs(workdir)
    assert len([r for r in runs if "pid" in r]) == 1 and runs[-1].get("sigterm") is True


V3_PYTHON = os.path.join(REPO, ".venv-v3", "bin", "python")


@pytest.mark.skipif(not os.access(V3_PYTHON, os.X_OK), reason="no .venv-v3 (SageMaker SDK 3.x): `make test` creates it")
def test_the_same_job_through_sdk_v3_drivers(tmp_path: Any) -> None:
    # ModelTrainer's sm_drivers channel, written by the installed SDK 3.x's own code; each host runs sm_train.sh.
    drivers = str(tmp_path / "drivers")
    subprocess.run([V3_PYTHON, os.path.join(REPO, "tools", "sm_drivers_v3.py"), drivers], check=True, timeout=300,
                   capture_output=True)
    sim, workdir = start(tmp_path, "hetero-v3", "--sdk", "v3", "--sm-drivers", drivers, script_args=("--steps", "3"))
    code = sim.finish()
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert_gone(all_pids(sim, workdir, summary))
    assert processes_inside(workdir) == []
    assert code == 0 and [h["exit_code"] for h in summary["hosts"]] == [0, 0, 0], sim.stderr
    assert "Running Basic Script driver" in sim.stderr + sim.stdout  # the SDK's driver started each launcher
    records = rank_records(workdir, 3)
    assert [r["rank"] for r in records["algo-1"]] == [0, 1] and [r["rank"] for r in records["algo-2"]] == [2, 3]
    assert {r["world_size"] for recs in records.values() for r in recs} == {4}
    runs = outside_runs(workdir)
    assert len([r for r in runs if "pid" in r]) == 1 and runs[-1].get("sigterm") is True
    env = runs[0]["env"]
    assert "RANK" not in env and env["MASTER_ADDR"] == "algo-1"
    # SDK 3.x's drivers set none of the toolkit's group variables: the launcher gives them, as the toolkit would.
    assert env["SM_CURRENT_INSTANCE_GROUP"] == "data" and env["SM_IS_HETERO"] == "true"
    assert json.loads(env["SM_INSTANCE_GROUPS_DICT"])["train"]["hosts"] == ["algo-1", "algo-2"]
