"""``ddp-launcher simulate``: N SageMaker hosts as N real launchers on this machine (gloo, CPU).

Every test that starts processes records the PIDs of the launchers, torchrun and the workers
(``tests/scripts/ddp_allreduce.py`` writes its own and its ancestors'), and proves with
``assert_gone`` that none is left, and that no process still runs inside the work directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

import pytest
from conftest import PYTHON, REPO, LiveProcess, assert_gone, launcher_env

from launcher import proctree, simulate
from launcher.platforms.sagemaker import argv as aws_argv
from launcher.simulate.hosts import builder

SCRIPT = os.path.join(REPO, "tests", "scripts", "ddp_allreduce.py")
RUN_TIMEOUT = 150.0
DEATH_TO_LAST_EXIT_LIMIT = 10.0
# User hyperparameters with a value with spaces, a list, a dict and a boolean.
HPS_JSON = json.dumps({"lr": 0.1, "opts": {"a": 1, "b": "x y"}})
SCRIPT_WORDS = [SCRIPT, "--steps", "2", "--step-sleep", "0.01", "--name", "a b", "--layers", "[1, 2]",
                "--flag"]
EXPECTED_ARGV = ["--flag", "True", "--layers", "[1, 2]", "--lr", "0.1", "--name", "a b",
                 "--opts", "a=1,b=x y", "--step-sleep", "0.01", "--steps", "2"]
TOOLKIT_VIEW = """
import json, sys
from sagemaker_training import environment, mapping
env = environment.Environment()
print(json.dumps({"env": env.to_env_vars(), "argv": mapping.to_cmd_args(env.hyperparameters)}))
"""
SDK_ENCODING = """
import json, sys
from sagemaker.estimator import EstimatorBase
print(json.dumps(EstimatorBase._json_encode_hyperparameters(json.load(sys.stdin))))
"""


class Simulate(LiveProcess):
    """``python -m launcher simulate`` as a child of the test, its output read as it comes."""

    def __init__(self, args: list[str], cwd: str, env: Optional[dict[str, str]] = None) -> None:
        super().__init__([PYTHON, "-m", "launcher", "simulate", *args], cwd, env)

    def finish(self, timeout: float = RUN_TIMEOUT) -> int:
        """Wait for the end; kill the whole tree and fail if it takes too long."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.abort()
            pytest.fail(f"simulate ran over {timeout} s; stderr:\n" + "\n".join(self.err[-40:]))
        self.join_readers()
        self.duration = time.monotonic() - self.started
        return code

    def abort(self) -> None:
        proctree.kill_tree([self.proc.pid])
        self.proc.wait()


def run(args: list[str], cwd: str) -> tuple[Simulate, int]:
    sim = Simulate(args, cwd)
    return sim, sim.finish()


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def rank_records(workdir: str, hosts: int) -> dict[str, list[dict[str, Any]]]:
    """Each host's worker records, by rank."""
    found: dict[str, list[dict[str, Any]]] = {}
    for i in range(1, hosts + 1):
        data = os.path.join(workdir, f"algo-{i}", "output", "data")
        names = sorted(n for n in os.listdir(data) if n.startswith("rank") and n.endswith(".json"))
        found[f"algo-{i}"] = [read_json(os.path.join(data, n)) for n in names]
    return found


def job_pids(records: dict[str, list[dict[str, Any]]], simulate_pid: int, summary: dict) -> list[int]:
    """Workers, torchrun, launchers (and the toolkit) up to simulate itself, and simulate."""
    pids = {simulate_pid, *(h["pid"] for h in summary["hosts"])}
    for rank_list in records.values():
        for rec in rank_list:
            pids.add(rec["pid"])
            for pid in rec["ancestors"]:
                if pid == simulate_pid:
                    break
                pids.add(pid)
    return sorted(pids)


def processes_inside(workdir: str) -> list[int]:
    """PIDs whose working directory is inside the work directory (launchers, torchrun, workers)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cwd = os.readlink(f"/proc/{name}/cwd")
            except OSError:
                continue
            if cwd == workdir or cwd.startswith(workdir + os.sep):
                found.append(int(name))
    return found


def assert_nothing_left(sim: Simulate, workdir: str, hosts: int) -> dict[str, list[dict[str, Any]]]:
    summary = read_json(os.path.join(workdir, "summary.json"))
    records = rank_records(workdir, hosts)
    assert_gone(job_pids(records, sim.proc.pid, summary))
    assert processes_inside(workdir) == []
    return records


def toolkit_view(base_dir: str, job_name: str) -> dict[str, Any]:
    """AWS's own Environment built from a host's tree (in a subprocess: it reads paths at import)."""
    env = launcher_env(SAGEMAKER_BASE_DIR=base_dir, TRAINING_JOB_NAME=job_name)
    out = subprocess.run([PYTHON, "-c", TOOLKIT_VIEW], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def sm_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("SM_")}


def summary_row(stderr: str, host: str) -> str:
    rows = [line for line in stderr.splitlines() if line.startswith(host + "  ")]
    assert rows, f"no summary row for {host}:\n{stderr}"
    return rows[-1]


# ------------------------------------------------------------------------------------------------
# The tree and the environment, without training
# ------------------------------------------------------------------------------------------------

def test_tree_and_environment_match_aws(tmp_path: Any) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("x")
    workdir = str(tmp_path / "job")
    config = simulate.build_config(["--hosts", "3", "--channel", f"train={data}", "--workdir", workdir,
                                    "--job-name", "tree-test", "--hyperparameters", HPS_JSON,
                                    "--", *SCRIPT_WORDS], str(tmp_path))
    specs = builder("sagemaker").make_hosts(config, launcher_env(), 12345)
    sdk = json.loads(subprocess.run(
        [PYTHON, "-c", SDK_ENCODING], input=json.dumps(dict(config.options.hyperparameters)),
        env=launcher_env(SAGEMAKER_SUPPRESS_V2_WARNING="1"), capture_output=True, text=True,
        timeout=120, check=True).stdout.strip().splitlines()[-1])
    for spec in specs:
        conf = os.path.join(spec.base_dir, "input", "config")
        resource = read_json(os.path.join(conf, "resourceconfig.json"))
        assert resource["hosts"] == ["algo-1", "algo-2", "algo-3"]
        assert resource["current_host"] == spec.name
        assert resource["network_interface_name"] == "lo"
        assert resource["current_group_name"] == "homogeneousCluster"
        assert sorted(resource["instance_groups"][0]["hosts"]) == resource["hosts"]
        raw = read_json(os.path.join(conf, "hyperparameters.json"))
        assert {k: raw[k] for k in sdk} == sdk  # SDK v2's own encoding of the user's values
        assert json.loads(raw["sagemaker_program"]) == "launch.py"
        assert json.loads(raw["sagemaker_submit_directory"]) == os.path.join(workdir, "sourcedir.tar.gz")
        assert json.loads(raw["sagemaker_job_name"]) == "tree-test"
        assert {"sagemaker_region", "sagemaker_container_log_level"} <= set(raw)
        assert read_json(os.path.join(conf, "inputdataconfig.json"))["train"]["TrainingInputMode"] == "File"
        assert read_json(os.path.join(conf, "checkpointconfig.json"))["LocalPath"] == \
            os.path.join(spec.base_dir, "checkpoints")
        assert os.path.realpath(os.path.join(spec.base_dir, "input", "data", "train")) == str(data)
        for sub in ("model", "output/data", "checkpoints", "code/launch.py", "code/launcher/cli.py",
                    "code/ddp_allreduce.py"):
            assert os.path.exists(os.path.join(spec.base_dir, sub)), sub
        aws = toolkit_view(spec.base_dir, "tree-test")
        assert sm_vars(dict(spec.env)) == aws["env"]
        assert list(spec.argv[2:]) == aws["argv"]
        assert spec.argv[1] == "launch.py" and spec.cwd == os.path.join(spec.base_dir, "code")
        assert spec.env["SAGEMAKER_BASE_DIR"] == spec.base_dir
        assert spec.env["LAUNCHER_RESOLVE"] == "algo-1=127.0.0.1,algo-2=127.0.0.1,algo-3=127.0.0.1"
        assert spec.env["LAUNCHER_MASTER_PORT"] == "12345"


# ------------------------------------------------------------------------------------------------
# Real runs
# ------------------------------------------------------------------------------------------------

def check_training(workdir: str, records: dict[str, list[dict[str, Any]]], job_name: str) -> None:
    """World size 4, rank 0 on algo-1, AWS's argv, and AWS's environment on every rank."""
    assert [r["rank"] for r in records["algo-1"]] == [0, 1]
    assert [r["rank"] for r in records["algo-2"]] == [2, 3]
    for host, rank_list in records.items():
        aws = toolkit_view(os.path.join(workdir, host), job_name)
        expected_argv = list(aws["argv"])
        i = expected_argv.index("--train-script")
        del expected_argv[i:i + 2]
        assert expected_argv == EXPECTED_ARGV
        for rec in rank_list:
            assert rec["world_size"] == 4 and rec["sum"] == 10.0 and rec["steps"] == 2
            assert rec["argv"] == EXPECTED_ARGV
            ours = {k: v for k, v in sm_vars(rec["env"]).items() if k != "SM_STUDIO_LOCAL_MODE"}
            assert ours == aws["env"]


@pytest.mark.job
@pytest.mark.lab
def test_two_hosts_two_processes(tmp_path: Any) -> None:
    data = tmp_path / "data"
    data.mkdir()
    workdir = str(tmp_path / "job")
    sim, code = run(["--hosts", "2", "--nproc-per-node", "2", "--channel", f"train={data}",
                     "--workdir", workdir, "--job-name", "two-by-two", "--hyperparameters", HPS_JSON,
                     "--", *SCRIPT_WORDS], str(tmp_path))
    assert code == 0, sim.stderr
    records = assert_nothing_left(sim, workdir, 2)
    check_training(workdir, records, "two-by-two")
    assert any(line.startswith("[algo-1] [rank0]:step=1") for line in sim.out)
    assert any(line.startswith("[algo-2] [rank3]:step=2") for line in sim.out)
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert [(h["host"], h["exit_code"], h["outcome"]) for h in summary["hosts"]] == \
        [("algo-1", 0, "succeeded"), ("algo-2", 0, "succeeded")]
    assert summary["hosts"][0]["model_files"] == ["model.json"]
    assert "1 file(s) in " + os.path.join(workdir, "algo-1", "model") in summary_row(sim.stderr, "algo-1")
    print(f"\n2 hosts x 2 processes: {sim.duration:.1f} s")


@pytest.mark.job
@pytest.mark.lab
def test_toolkit_runs_each_host_through_aws_train(tmp_path: Any) -> None:
    workdir = str(tmp_path / "job")
    sim, code = run(["--hosts", "2", "--nproc-per-node", "2", "--workdir", workdir, "--toolkit",
                     "--job-name", "toolkit", "--hyperparameters", HPS_JSON, "--", *SCRIPT_WORDS],
                    str(tmp_path))
    assert code == 0, sim.stderr
    records = assert_nothing_left(sim, workdir, 2)
    check_training(workdir, records, "toolkit")
    for host in ("algo-1", "algo-2"):
        base = os.path.join(workdir, host)
        assert os.path.isfile(os.path.join(base, "output", "success"))  # written by AWS's trainer
        assert os.path.isfile(os.path.join(base, "code", "launch.py"))  # extracted by the toolkit
        rec = records[host][0]
        assert rec["env"]["SM_MODULE_DIR"] == os.path.join(workdir, "sourcedir.tar.gz")
        ours = simulate.toolkit_env(base, read_json(os.path.join(base, "input/config/resourceconfig.json")),
                                    read_json(os.path.join(base, "input/config/inputdataconfig.json")),
                                    read_json(os.path.join(base, "input/config/hyperparameters.json")),
                                    "toolkit")
        assert {k: v for k, v in sm_vars(rec["env"]).items() if k != "SM_STUDIO_LOCAL_MODE"} == ours
    assert sum("Reporting training SUCCESS" in line for line in sim.err + sim.out) == 2
    print(f"\n--toolkit, 2 hosts x 2 processes: {sim.duration:.1f} s")


def fault_run(tmp_path: Any, fault: str, nproc: int) -> tuple[Simulate, int, str, dict]:
    workdir = str(tmp_path / "job")
    sim, code = run(["--hosts", "2", "--nproc-per-node", str(nproc), "--workdir", workdir,
                     "--fault", fault, "--", SCRIPT, "--steps", "0", "--step-sleep", "0.1"],
                    str(tmp_path))
    return sim, code, workdir, read_json(os.path.join(workdir, "summary.json"))


@pytest.mark.job
@pytest.mark.lab
def test_sigkill_of_one_launcher_ends_every_host(tmp_path: Any) -> None:
    sim, code, workdir, summary = fault_run(tmp_path, "algo-2:SIGKILL:step=3", 2)
    assert code == 128 + signal.SIGKILL, sim.stderr
    records = assert_nothing_left(sim, workdir, 2)
    assert max(r["steps"] for r in records["algo-2"]) >= 3  # it was killed mid-run
    hosts = {h["host"]: h for h in summary["hosts"]}
    assert hosts["algo-2"]["outcome"].startswith("lost: SIGKILL by --fault")
    assert hosts["algo-1"]["exit_code"] != 0
    # simulate stops algo-1 once algo-2 is gone, unless the job watch (the closed connection) ended it first
    assert hosts["algo-1"]["outcome"] in ("stopped by simulate after algo-2 was lost", "failed")
    assert hosts["algo-1"]["failure"].startswith("algo-2 lost: "), hosts["algo-1"]["failure"]
    assert summary["first_failure"] == "algo-2"
    assert "lost: SIGKILL" in summary_row(sim.stderr, "algo-2")
    elapsed = summary["death_to_last_exit"]
    print(f"\nSIGKILL of algo-2's launcher: last host exited {elapsed:.2f} s after algo-2 died "
          f"(limit {DEATH_TO_LAST_EXIT_LIMIT} s); whole run {sim.duration:.1f} s")
    assert elapsed <= DEATH_TO_LAST_EXIT_LIMIT


@pytest.mark.job
@pytest.mark.lab
def test_sigterm_to_one_host_is_a_spot_interruption(tmp_path: Any) -> None:
    sim, code, workdir, summary = fault_run(tmp_path, "algo-2:SIGTERM:step=3", 1)
    assert code != 0, sim.stderr
    records = assert_nothing_left(sim, workdir, 2)
    assert [r["sigterm"] for r in records["algo-2"]] == [True]  # the worker itself got SIGTERM
    hosts = {h["host"]: h for h in summary["hosts"]}
    assert hosts["algo-2"]["outcome"].startswith("stopped: SIGTERM by --fault")
    assert "spot interruption" in summary_row(sim.stderr, "algo-2")
    # algo-1 ends because of algo-2's stop: simulate stops it once algo-2 has exited (the platform's stop), unless
    # the job watch, which heard algo-2 first, already ended it (a race on a loaded machine: both are right)
    assert hosts["algo-1"]["outcome"] in ("stopped by simulate after algo-2 was stopped", "failed")
    assert hosts["algo-1"]["exit_code"] != 0
    assert hosts["algo-1"]["failure"].startswith("algo-2: stopped by SIGTERM"), hosts["algo-1"]["failure"]
    assert summary["death_to_last_exit"] <= DEATH_TO_LAST_EXIT_LIMIT
    print(f"\nSIGTERM to algo-2: the job ended {summary['fault_to_last_exit']:.2f} s after the fault")


def start_endless_job(tmp_path: Any) -> tuple[Simulate, str]:
    """Two hosts training until stopped (``--steps 0``)."""
    workdir = str(tmp_path / "job")
    return Simulate(["--hosts", "2", "--workdir", workdir, "--", SCRIPT, "--steps", "0",
                     "--step-sleep", "0.1"], str(tmp_path)), workdir


@pytest.mark.job
@pytest.mark.lab
def test_sigterm_to_simulate_reaches_every_worker(tmp_path: Any) -> None:
    sim, workdir = start_endless_job(tmp_path)
    sim.wait_for("[algo-2] [rank1]:step=3")
    os.kill(sim.proc.pid, signal.SIGTERM)
    stopped = time.monotonic()
    code = sim.finish()
    records = assert_nothing_left(sim, workdir, 2)
    assert code == 128 + signal.SIGTERM, sim.stderr
    assert [r["sigterm"] for host in ("algo-1", "algo-2") for r in records[host]] == [True, True]
    assert "stopped: SIGTERM from the user" in summary_row(sim.stderr, "algo-1")
    print(f"\nSIGTERM to simulate: everything ended {time.monotonic() - stopped:.1f} s later")


@pytest.mark.job
@pytest.mark.lab
def test_sigkill_of_simulate_leaves_nothing(tmp_path: Any) -> None:
    sim, workdir = start_endless_job(tmp_path)
    sim.wait_for("[algo-2] [rank1]:step=2")
    records = rank_records(workdir, 2)
    os.kill(sim.proc.pid, signal.SIGKILL)
    sim.finish()
    pids = [sim.proc.pid] + [p for recs in records.values() for r in recs
                             for p in [r["pid"], *r["ancestors"]] if p != sim.proc.pid]
    pids = pids[:1] + [p for p in pids[1:] if p not in ancestors_of_test()]
    assert_gone(pids)
    assert processes_inside(workdir) == []


def ancestors_of_test() -> set[int]:
    """This test process and its ancestors (not to be waited for)."""
    chain, pid = {os.getpid()}, os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        pid = int(stat[stat.rfind(b")") + 2:].split()[1])
        chain.add(pid)
    return chain


# ------------------------------------------------------------------------------------------------
# Bad input: exit 2, one line, nothing written, nothing started
# ------------------------------------------------------------------------------------------------

BAD_INPUTS = [
    (["--hosts", "0"], "--hosts must be 1-64: 0"),
    (["--hosts", "65"], "--hosts must be 1-64: 65"),
    (["--hosts", "2", "--channel", "train=no-such-dir"], "'no-such-dir'"),
    (["--hosts", "2", "--hyperparameters", '{"epochs": 3'], "'{\"epochs\": 3'"),
    (["--hosts", "2", "--hyperparameters", "[1, 2]"], "must be a JSON object"),
    (["--hosts", "2", "--fault", "algo-3:SIGKILL:5"], "'algo-3'"),
    (["--hosts", "2", "--fault", "algo-2:SIGNOPE:5"], "'SIGNOPE'"),
    (["--hosts", "2", "--fault", "algo-2:blip:5"], "blip lasts SECONDS: HOST:blip:AFTER:SECONDS"),
    (["--hosts", "2", "--fault", "algo-2:SIGKILL:5:3"], "'SIGKILL' takes no duration"),
    (["--hosts", "2", "--fault", "algo-2:pause:5:0"], "SECONDS must be seconds > 0"),
    (["--hosts", "2", "--fault", "algo-2:starve:5:inf"], "'inf'"),
    (["--hosts", "2", "--fault", "algo-2:vmpause:-1:5"], "AFTER must be seconds >= 0"),
    (["--hosts", "2", "--fault", "algo-2:saturate:step=x:5"], "'step=x'"),
    (["--hosts", "2", "--fault", "algo-2:blip:1:2:3"], "HOST:KIND:AFTER:SECONDS"),
    (["--hosts", "2", "--network", "loopback", "--fault", "algo-2:blip:1:2"], "blip needs --network netns"),
    (["--hosts", "2", "--job-name", "bad_name"], "'bad_name'"),
    (["--hosts", "2", "--grace-period", "0"], "--grace-period"),
]


@pytest.mark.parametrize("args,named", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Any, args: list[str], named: str) -> None:
    check_refused(tmp_path, [*args, "--", SCRIPT, "--steps", "1"], named)


def test_missing_script_is_refused(tmp_path: Any) -> None:
    check_refused(tmp_path, ["--hosts", "2", "--", "no_such_script.py"], "'no_such_script.py'")


def test_unwritable_workdir_leaves_nothing_half_made(tmp_path: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    check_refused(tmp_path, ["--hosts", "2", "--workdir", str(blocker / "job"), "--", SCRIPT],
                  "cannot write the work directory")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_toolkit_missing_is_a_clear_error(tmp_path: Any) -> None:
    # -S: the same interpreter without site-packages, so sagemaker_training cannot be imported.
    check_refused(tmp_path, ["--hosts", "2", "--toolkit", "--", SCRIPT], "sagemaker-training",
                  python_flags=["-S"])


def check_refused(tmp_path: Any, args: list[str], named: str,
                  python_flags: Optional[list[str]] = None) -> None:
    before = sorted(os.listdir(tmp_path))
    proc = subprocess.run([PYTHON, *(python_flags or []), "-m", "launcher", "simulate", *args],
                          cwd=str(tmp_path), env=launcher_env(), capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp-launcher simulate: error: "), proc.stderr
    assert named in lines[0]
    assert sorted(os.listdir(tmp_path)) == before  # no ./runs/, no work directory
    assert processes_inside(str(tmp_path)) == []


# ------------------------------------------------------------------------------------------------
# The '--' form of the hyperparameters
# ------------------------------------------------------------------------------------------------

def test_script_words_become_hyperparameters() -> None:
    script, hps = simulate.script_hyperparameters(
        ["t.py", "--epochs", "3", "--name", "a b", "--flag", "--lr=0.5", "-b", "-1", "--cfg", '{"a": 1}'])
    assert script == "t.py"
    assert hps == {"epochs": 3, "name": "a b", "flag": True, "lr": 0.5, "b": -1, "cfg": {"a": 1}}
    raw = simulate.encode_hyperparameters(hps)
    assert aws_argv.render_args(aws_argv.decode(raw)) == \
        ["-b", "-1", "--cfg", "a=1", "--epochs", "3", "--flag", "True", "--lr", "0.5", "--name", "a b"]


def test_fault_specs() -> None:
    hosts = ("algo-1", "algo-2")
    assert simulate.parse_fault("algo-2:SIGKILL:5", hosts) == simulate.Fault("algo-2", 9, after=5.0)
    assert simulate.parse_fault("algo-1:term:step=7", hosts) == simulate.Fault("algo-1", 15, step=7)
    assert simulate.parse_fault("algo-1:15:0.5", hosts).after == 0.5
    for kind in ("blip", "pause", "vmpause", "starve", "saturate"):  # transient: AFTER, then SECONDS
        fault = simulate.parse_fault(f"algo-2:{kind}:10:5", hosts)
        assert fault == simulate.Fault("algo-2", 0, after=10.0, kind=kind, seconds=5.0) and fault.transient
        assert simulate.parse_fault(f"algo-1:{kind}:step=3:0.5", hosts) == \
            simulate.Fault("algo-1", 0, step=3, kind=kind, seconds=0.5)
    for kind in ("partition", "poweroff", "SIGKILL"):
        assert not simulate.parse_fault(f"algo-2:{kind}:1", hosts).transient


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
