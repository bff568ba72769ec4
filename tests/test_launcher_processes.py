"""The launcher with real torchrun processes (gloo, CPU): hosts, exit codes, signals, failure reports.

Every test proves by PID that no process of the job is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from conftest import PYTHON, REPO, assert_gone, free_port, launcher_env

WORKER = os.path.join(REPO, "tests", "scripts", "launcher_worker.py")


def make_host(root, name, hosts):
    """A SageMaker tree for one host: resourceconfig.json, output/, and a record directory."""
    base = root / name
    (base / "input" / "config").mkdir(parents=True)
    (base / "records").mkdir()
    (base / "output").mkdir(exist_ok=True)  # as in a SageMaker container: the report and outcome go there
    (base / "input" / "config" / "resourceconfig.json").write_text(json.dumps({
        "current_host": name, "hosts": hosts, "network_interface_name": "lo",
        "current_instance_type": "ml.m5.xlarge", "current_group_name": "homogeneousCluster",
        "instance_groups": [{"instance_group_name": "homogeneousCluster", "instance_type": "ml.m5.xlarge",
                             "hosts": list(reversed(hosts))}]}))
    return base


def start_launcher(base, args, port, hosts, **env):
    environ = launcher_env(**{"SAGEMAKER_BASE_DIR": str(base), "WORKER_RECORD_DIR": str(base / "records"),
                              "LAUNCHER_MASTER_PORT": str(port),
                              "LAUNCHER_RESOLVE": ",".join(f"{h}=127.0.0.1" for h in hosts), **env})
    return subprocess.Popen([PYTHON, "-m", "launcher", *args], env=environ, cwd=str(base),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records(base):
    found = {}
    for name in os.listdir(base / "records"):
        if name.endswith(".json"):
            with open(base / "records" / name) as fh:
                data = json.load(fh)
            found[data["rank"]] = data
    return found


def job_pids(launcher, *bases):
    """The launcher, its torchrun and every worker: all must be gone at the end."""
    pids = {launcher.pid} if launcher else set()
    for base in bases:
        for data in records(base).values():
            pids.update({data["pid"], data["ppid"]})
    return pids


def wait_for_records(base, count, timeout=60.0, steps=0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = records(base)
        if len(found) >= count and all(r["steps_done"] >= steps for r in found.values()):
            return found
        time.sleep(0.1)
    raise AssertionError(f"workers did not start in {timeout} s: {records(base)}")


@pytest.mark.job
def test_two_hosts_two_processes_train_together(tmp_path):
    hosts = ["algo-1", "algo-2"]
    bases = [make_host(tmp_path, h, hosts) for h in hosts]
    port = free_port()
    # Start the second host first: the rendezvous does not depend on the order hosts come up.
    # --start abbreviates two of torchrun's options: the script gets it all the same
    procs = [start_launcher(b, ["--nproc-per-node", "2", WORKER, "--steps", "20", "--name", "a b", "--start", "3"],
                            port, hosts) for b in reversed(bases)]
    outputs = [p.communicate(timeout=180) for p in procs]
    for proc, (_out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    first, second = records(bases[0]), records(bases[1])
    assert sorted(first) == [0, 1] and sorted(second) == [2, 3]  # global rank 0 on the first host
    everyone = [*first.values(), *second.values()]
    assert {r["world_size"] for r in everyone} == {4}
    assert all(r["argv"] == ["--steps", "20", "--name", "a b", "--start", "3"] for r in everyone)
    assert all(r["params"] == everyone[0]["params"] for r in everyone)  # DDP kept them identical
    assert "[rank0]:" in outputs[1][0] + outputs[1][1]  # per-rank prefixes on algo-1's output
    assert_gone(job_pids(None, *bases) | {p.pid for p in procs})


def single_host(tmp_path):
    return make_host(tmp_path, "algo-1", ["algo-1"])


def run_single(tmp_path, worker_args, **env):
    base = single_host(tmp_path)
    proc = start_launcher(base, ["--nproc-per-node", "2", WORKER, *worker_args], free_port(), ["algo-1"], **env)
    out, err = proc.communicate(timeout=120)
    assert_gone(job_pids(proc, base))
    failure = (base / "output" / "failure")
    return proc.returncode, err, failure.read_text() if failure.exists() else None


@pytest.mark.job
def test_worker_exit_code_is_the_launchers(tmp_path):
    code, err, failure = run_single(tmp_path, ["--exit-code", "7", "--fail-rank", "1"])
    assert code == 7
    assert failure.startswith("algo-1: rank 1 (local rank 1) exited with code 7")
    assert err.rstrip().endswith(failure.rstrip().splitlines()[-1])  # the report ends stderr
    assert "left behind" not in err  # the launcher's own helpers (its watchdog, its deaths watcher) are no leftovers


@pytest.mark.job
def test_a_rank_that_ends_early_and_cleanly_is_said_beside_the_peer_that_failed_on_it(tmp_path):
    """Rank 1 runs out of batches and its script ends (exit code 0) at step 3; rank 0, in its next all-reduce, fails
    with gloo's "Connection closed by peer ... typically caused by a remote worker crashing". The report names rank
    0's failure, as torchrun does, and says on the line after its exception that rank 1 had ended cleanly before."""
    code, err, failure = run_single(tmp_path, ["--steps", "200", "--step-sleep", "0.05", "--exit-code", "0",
                                               "--fail-rank", "1", "--fail-at-step", "3"])
    lines = failure.splitlines()
    assert code == 1 and lines[0] == "algo-1: rank 0 (local rank 0) exited with code 1", err[-3000:]
    assert "Connection closed by peer" in lines[1], lines
    assert re.fullmatch(r"rank 1 \(local rank 1\) had ended its script with exit code 0, \d+\.\d s before: a rank "
                        r"that ends while the others still run collectives closes its connections, and they fail on "
                        r"them \(does every rank run the same number of steps\?\)", lines[2]), lines


@pytest.mark.job
def test_worker_exit_code_survives_an_abort_in_interpreter_teardown(tmp_path):
    """sys.exit(7), then an atexit handler aborts (as torch's threads can): the launcher still exits 7."""
    code, err, failure = run_single(tmp_path, ["--exit-code", "7", "--fail-rank", "1", "--abort-at-exit"])
    assert code == 7, err[-3000:]
    assert failure.splitlines()[0] == ("algo-1: rank 1 (local rank 1) exited with code 7 (then aborted in "
                                       "interpreter teardown: terminate called without an active exception)")
    assert "exitcode  : -6" in err  # torchrun saw the abort
    assert err.rstrip().endswith(failure.rstrip().splitlines()[-1])


@pytest.mark.job
def test_worker_killed_by_signal_gives_128_plus_n(tmp_path):
    code, _err, failure = run_single(tmp_path, ["--self-signal", "SIGKILL", "--fail-rank", "0"])
    assert code == 137
    assert failure.startswith("algo-1: rank 0 (local rank 0) was killed by SIGKILL (exit code 137)")


@pytest.mark.job
@pytest.mark.parametrize("clean", [False, True])
def test_sigterm_reaches_the_workers(tmp_path, clean):
    base = single_host(tmp_path)
    args = ["--steps", "100000", "--step-sleep", "0.05"] + (["--clean-stop"] if clean else [])
    proc = start_launcher(base, ["--nproc-per-node", "2", "--grace-period", "20", WORKER, *args], free_port(),
                          ["algo-1"])
    wait_for_records(base, 2, steps=2)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    found = records(base)
    assert all(r["signals"] == ["SIGTERM"] for r in found.values()), found
    if clean:  # the workers saved and exited 0: the job ended cleanly
        assert proc.returncode == 0, err[-2000:]
        assert not (base / "output" / "failure").exists()
    else:
        assert proc.returncode == 143, err[-2000:]
        assert (base / "output" / "failure").read_text().startswith("algo-1: stopped by SIGTERM")
    assert_gone(job_pids(proc, base))


@pytest.mark.job
def test_workers_ignoring_sigterm_are_killed_after_the_grace_period(tmp_path):
    base = single_host(tmp_path)
    script = tmp_path / "stubborn.py"
    script.write_text(
        "import json, os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "d = os.environ['WORKER_RECORD_DIR']\n"
        "json.dump({'rank': int(os.environ['RANK']), 'pid': os.getpid(), 'ppid': os.getppid(),"
        " 'steps_done': 1}, open(os.path.join(d, 'r%s.json' % os.environ['RANK']), 'w'))\n"
        "time.sleep(600)\n")
    proc = start_launcher(base, ["--nproc-per-node", "2", "--grace-period", "2", str(script)], free_port(),
                          ["algo-1"])
    wait_for_records(base, 2)
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.monotonic() - started < 15, err[-2000:]
    assert "grace period of 2 s is over" in err
    assert_gone(job_pids(proc, base))


@pytest.mark.job
def test_sigkill_of_the_launcher_leaves_nothing(tmp_path):
    base = single_host(tmp_path)
    proc = start_launcher(base, ["--nproc-per-node", "2", WORKER, "--steps", "100000", "--step-sleep", "0.05"],
                          free_port(), ["algo-1"])
    wait_for_records(base, 2, steps=1)
    pids = job_pids(proc, base)
    proc.kill()
    proc.communicate(timeout=30)
    waited = assert_gone(pids, within=10)
    print(f"all {len(pids)} processes gone {waited:.2f} s after SIGKILL of the launcher")


def test_config_error_starts_nothing(tmp_path):
    base = tmp_path / "algo-1"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "resourceconfig.json").write_text('{"hosts": ["algo-1"], "current_host": "x"}')
    proc = start_launcher(base, [WORKER], free_port(), ["algo-1"], WORKER_RECORD_DIR=str(tmp_path))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == ""
    assert err.count("\n") == 1 and "current host 'x' is not in the host list" in err
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.job
def test_through_aws_sagemaker_training_toolkit(tmp_path):
    """AWS's real `train` command runs our launcher as the entry point with SDK v2 hyperparameters."""
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    code = base / "code"
    subprocess.run([PYTHON, "-m", "launcher", "bundle", WORKER, "--out", str(code)], check=True,
                   env=launcher_env(), capture_output=True)
    hps = {"train-script": "launcher_worker.py", "launcher-nproc-per-node": 2, "steps": 3, "name": "a b c",
           "layers": [1, 2], "cfg": {"lr": 0.1, "opt": "sgd"}, "flag": True}
    encoded = {k: json.dumps(v) for k, v in hps.items()}
    encoded.update(sagemaker_program=json.dumps("launch.py"), sagemaker_submit_directory=json.dumps(str(code)),
                   sagemaker_region=json.dumps("us-east-1"), sagemaker_job_name=json.dumps("toolkit-test"),
                   sagemaker_container_log_level="20")
    config = base / "input" / "config"
    (config / "hyperparameters.json").write_text(json.dumps(encoded))
    (config / "inputdataconfig.json").write_text("{}")
    env = launcher_env(SAGEMAKER_BASE_DIR=str(base), WORKER_RECORD_DIR=str(base / "records"),
                       LAUNCHER_MASTER_PORT=str(free_port()), LAUNCHER_RESOLVE="algo-1=127.0.0.1",
                       SM_STUDIO_LOCAL_MODE="true", AWS_REGION="us-east-1")
    env.pop("PYTHONPATH")  # the launcher must come from the bundle, as in the container
    train = os.path.join(os.path.dirname(PYTHON), "train")
    proc = subprocess.run([train], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = records(base)
    expected = ["--cfg", "lr=0.1,opt=sgd", "--flag", "True", "--layers", "[1, 2]", "--name", "a b c",
                "--steps", "3"]
    assert sorted(found) == [0, 1]
    assert all(r["argv"] == expected for r in found.values()), found[0]["argv"]
    assert all(r["steps_done"] == 3 and "params" in r for r in found.values())
    assert_gone(job_pids(None, base))


@pytest.mark.job
@pytest.mark.parametrize("lone", ["algo-2", "algo-1"])
def test_lone_host_reports_the_rendezvous_it_waited_for(tmp_path, lone):
    # the other host never comes up: no decision of node 0 to wait for (its job watch never met that host)
    hosts = ["algo-1", "algo-2"]
    base = make_host(tmp_path, lone, hosts)
    port = free_port()
    proc = start_launcher(base, ["--rdzv-timeout", "3", WORKER], port, hosts)
    _out, err = proc.communicate(timeout=90)
    assert proc.returncode == 75, err[-2000:]  # the rendezvous class: the infrastructure's, worth a retry
    assert json.loads((base / "output" / "data" / "outcome.json").read_text())["class"] == "rendezvous"
    first = (base / "output" / "failure").read_text().splitlines()[0]
    # torchrun's own rendezvous timeout, or (a slow start) the launcher's bound and its diagnosis: both 75
    assert first.startswith(f"{lone}: torchrun failed before or around the workers (exit code 75); "
                            f"rendezvous algo-1:{port} as node {hosts.index(lone)} of 2, timeout 3 s")
    torchrun = re.search(r"torchrun started as pid (\d+)", err).group(1)
    assert_gone([proc.pid, torchrun])
