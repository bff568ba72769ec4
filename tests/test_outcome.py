"""Classes as codes and as data: the outcome file of every run, checked against docs/outcome.schema.json.

Unit tests for the classification and the writer; real runs for success, a worker's own code, bad
input, the launcher's own error. On two hosts, a lost host against a worker the kernel SIGKILLed (both exit
137; the outcome files tell them apart) is checked in tests/test_jobwatch.py, on the jobs that already end so
(test_a_worker_failure_stops_both_hosts_with_its_root_cause, test_a_host_that_loses_power_is_lost).
``conftest.every_outcome_file_matches_the_schema``
also checks every outcome file any test's real run wrote.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from conftest import PYTHON, assert_gone, free_port, launcher_env, validate_outcome
from hypothesis import given, settings
from hypothesis import strategies as st
from test_launcher_processes import WORKER, job_pids, make_host, start_launcher

from launcher import cli, codes, report, rundir
from launcher.failure import RootCause
from launcher.options import parse_invocation
from launcher.outcome import Outcome

CLASSES = (codes.SUCCESS, codes.WORKER_EXIT, codes.WORKER_SIGNAL, codes.OUT_OF_MEMORY, codes.HOST_LOST, codes.HANG,
           codes.RENDEZVOUS, codes.STOPPED, codes.BAD_INPUT, codes.INTERNAL)


def cause(rank=1, exitcode=7, exception="ValueError: bad", asked=None):
    return RootCause(rank, rank, exitcode, exception, "", asked, "")


@pytest.mark.parametrize(("outcome", "root", "code", "klass"), [
    (Outcome(0, 1), None, 0, codes.SUCCESS),
    (Outcome(1, 1), cause(), 7, codes.WORKER_EXIT),
    (Outcome(1, 1), cause(exitcode=-9, exception="killed by SIGKILL"), 137, codes.WORKER_SIGNAL),
    (Outcome(1, 1), cause(exitcode=-6, asked=7), 7, codes.WORKER_EXIT),  # asked 7, then aborted in teardown
    (Outcome(1, 1, stop_signal=15), cause(), 143, codes.STOPPED),
    (Outcome(1, 1, no_rendezvous=True), cause(None, None, "no rendezvous"), 75, codes.RENDEZVOUS),
    (Outcome(1, 1), cause(None, None, "torch.distributed.DistNetworkError: connect() timed out"), 1,
     codes.RENDEZVOUS),
    (Outcome(1, 1), cause(None, None, "torchrun failed"), 1, codes.WORKER_EXIT),
])
def test_each_end_has_its_class_and_code(outcome, root, code, klass):
    assert report.classify(outcome, root, code) == klass
    fixed = report.code_of(klass, code)
    assert fixed == {codes.RENDEZVOUS: 75, codes.OUT_OF_MEMORY: 137}.get(klass, code)


def test_another_hosts_cause_keeps_its_class():
    assert report.remote_class("lost", 137, "algo-2 lost: no heartbeat for 3 s") == codes.HOST_LOST
    head = "algo-2: rank 2 (local rank 0) was killed by SIGKILL (exit code 137)\nkilled by SIGKILL"
    assert report.remote_class("failed", 137, head) == codes.WORKER_SIGNAL
    assert report.remote_class("failed", 7, "algo-2: rank 2 (local rank 0) exited with code 7") == codes.WORKER_EXIT
    assert report.remote_class("failed", 143, "algo-2: stopped by SIGTERM and the workers did not finish "
                                              "cleanly (exit code 143)") == codes.STOPPED


@settings(deadline=None, max_examples=20)  # each example writes and fsyncs a file: no time bound
@given(klass=st.sampled_from(CLASSES), code=st.integers(1, 255), rank=st.none() | st.integers(0, 10**6),
       text=st.text(max_size=3000), signal_name=st.none() | st.sampled_from(["SIGKILL", "SIGTERM"]),
       host=st.none() | st.text(min_size=1, max_size=300), elapsed=st.floats(0, 10**6))
def test_every_class_gives_a_valid_outcome(tmp_path_factory, klass, code, rank, text, signal_name, host, elapsed):
    code = 0 if klass == codes.SUCCESS else report.code_of(klass, code if klass != codes.HOST_LOST else 137)
    if klass == codes.STOPPED:
        code = max(code, 129)
    root_cause = "" if klass == codes.SUCCESS else (text or "x")
    verdict = report.Verdict(klass, code, rank, rank, None if klass == codes.HOST_LOST else signal_name,
                             root_cause, text, host)
    started = time.time() - elapsed
    data = report.outcome_data(verdict, report.Clock(started, started + elapsed / 3, None, started + elapsed),
                               host, 0, 1, "local")
    path = tmp_path_factory.mktemp("o") / "x.outcome.json"
    assert report.write_outcome(str(path), data) is None
    assert validate_outcome(str(path)) == data
    assert data["infrastructure"] == (klass in codes.INFRASTRUCTURE)


def test_the_writer_never_raises_and_says_why(tmp_path):
    (tmp_path / "file").write_text("")
    problem = report.write_outcome(str(tmp_path / "file" / "outcome.json"), {"a": 1})
    assert problem is not None and "File exists" in problem and len(problem.splitlines()) == 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".outcome.")]  # no temporary file left


def test_the_sagemaker_key_names_the_file():
    inv = parse_invocation(["--train-script", "t.py", "--launcher-outcome-file", "/x/o.json", "--epochs", "3"],
                           {"SM_HOSTS": '["algo-1"]'})
    assert inv.options.outcome_file == "/x/o.json" and inv.script_args == ("--epochs", "3")


def sagemaker_outcome(base):
    return validate_outcome(str(base / "output" / "data" / "outcome.json"))


def one_host(tmp_path, args, **env):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    proc = start_launcher(base, ["--nproc-per-node", "2", *args], free_port(), ["algo-1"], **env)
    _out, err = proc.communicate(timeout=180)
    assert_gone(job_pids(proc, base))
    return base, proc.returncode, err


@pytest.mark.job
def test_success_is_written_too_with_its_durations(tmp_path):
    base, code, err = one_host(tmp_path, [WORKER, "--steps", "2"])
    assert code == 0, err[-3000:]
    data = sagemaker_outcome(base)
    assert (data["class"], data["exit_code"], data["host"], data["root_cause"]) == ("success", 0, "algo-1", "")
    assert data["durations"]["rendezvous"] is not None and data["durations"]["total"] >= data["durations"]["start"]
    assert data["launcher_version"] == __import__("launcher").__version__


@pytest.mark.job
def test_a_workers_code_and_the_chosen_file(tmp_path):
    where = tmp_path / "elsewhere" / "run.outcome.json"
    base, code, err = one_host(tmp_path, [f"--outcome-file={where}", WORKER, "--exit-code", "7", "--fail-rank", "1"])
    assert code == 7, err[-3000:]
    data = validate_outcome(str(where))
    assert not (base / "output" / "data" / "outcome.json").exists()  # the option replaces the default
    assert (data["class"], data["exit_code"], data["rank"], data["local_rank"]) == ("worker_exit", 7, 1, 1)
    assert data["root_cause"] == "algo-1: rank 1 (local rank 1) exited with code 7"
    assert data["root_cause_host"] == "algo-1" and not data["infrastructure"]


def test_bad_input_is_written_before_anything_starts(tmp_path):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    env = launcher_env(SAGEMAKER_BASE_DIR=str(base), LAUNCHER_RDZV_TIMEOUT="0")
    proc = subprocess.run([PYTHON, "-m", "launcher", "train.py"], cwd=str(base), env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    data = sagemaker_outcome(base)
    assert (data["class"], data["exit_code"]) == ("bad_input", 2)
    assert data["root_cause"] == proc.stderr.strip().split("error: ", 1)[1]


@pytest.mark.job
def test_the_launchers_own_error_is_internal_and_written(tmp_path, capfd):
    """A real failure of the launcher itself: the Python it was told to start torchrun with is gone."""
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    (base / "train.py").write_text("pass\n")
    environ = {"SAGEMAKER_BASE_DIR": str(base), "PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}
    p = cli.plan(["--nproc-per-node", "1", str(base / "train.py")], environ)
    p = p._replace(launch=p.launch._replace(argv=(str(tmp_path / "no-such-python"), *p.launch.argv[1:])))
    held = rundir.make_run_dir(p.launch.run_dir)
    assert cli.run(p, environ) == codes.INTERNAL_CODE
    os.close(held)
    assert "Traceback" in capfd.readouterr().err
    data = sagemaker_outcome(base)
    assert (data["class"], data["exit_code"]) == ("internal", 70)
    assert "FileNotFoundError" in data["exception"] and not os.path.exists(p.launch.run_dir)


def test_one_limit_per_platform_applied_once():
    """Another host's cause then this host's own report: cut at the platform's limit (Kubernetes 4096), not 1024."""
    from launcher.jobwatch import Event
    from launcher.platforms import kubeflow

    cause = Event("failed", 1, "pod-1", 7, "pod-1: rank 2 (local rank 0) exited with code 7\nValueError: x", True)
    own = "pod-0: rank 0 (local rank 0) exited with code 1\n" + "\n".join(f"  frame {i}" for i in range(600))
    limit = kubeflow.PLATFORM.report_limit
    code, text = report.job_result(cause, 1, own, False, "", limit)
    assert code == 7 and len(text) == limit == 4096
    assert text.splitlines()[:3] == [*cause.report.splitlines(), "then " + own.splitlines()[0]]
    assert report.job_result(None, 1, own, True, "", limit) == (1, own[:limit])
    assert report.job_result(cause, 0, "", True) == (0, "")


def test_the_verdict_has_one_home():
    """The job watch keeps its wire protocol; choosing the code and the report is launcher/report.py's."""
    from launcher import jobwatch, preflight

    for name in ("conclude", "job_report", "is_secondary", "REPORT_LIMIT"):
        assert not hasattr(jobwatch, name)
    assert not hasattr(preflight, "no_rendezvous_reason") and hasattr(report, "no_rendezvous_reason")


ROOT_CAUSES = st.none() | st.builds(
    RootCause, rank=st.none() | st.integers(0, 64), local_rank=st.none() | st.integers(0, 8),
    exitcode=st.none() | st.integers(-64, 255), exception=st.sampled_from(
        ["ValueError: bad", "torch.distributed.DistNetworkError: connect() timed out", "RendezvousError: closed",
         "torchrun failed", ""]),
    detail=st.just(""), asked=st.none() | st.integers(0, 255),
    oom=st.sampled_from(["", "the cgroup's oom_kill count rose from 0 to 1"]),
).filter(lambda c: not (c.oom and c.asked is not None))  # report.out_of_memory never blames a code asked for


@settings(max_examples=500)
@given(returncode=st.integers(-64, 255), stop=st.none() | st.integers(1, 64), no_rendezvous=st.booleans(),
       root=ROOT_CAUSES)
def test_the_one_rule_gives_every_torchrun_end_a_class_and_its_code(returncode, stop, no_rendezvous, root):
    # report.class_and_code: the rule the verdict and the generations share (report.torchrun_end), over every end.
    outcome = Outcome(returncode, 1, stop_signal=stop, no_rendezvous=no_rendezvous)
    klass, code = report.class_and_code(outcome, root)
    assert klass in CLASSES and 0 <= code <= 255
    assert (code == 0) == (klass == codes.SUCCESS)  # success and exit code 0 go together, nothing else gives 0
    fixed = {codes.RENDEZVOUS: codes.RENDEZVOUS_CODE, codes.OUT_OF_MEMORY: codes.OUT_OF_MEMORY_CODE}
    if returncode == 0:
        assert klass == codes.SUCCESS
    elif stop is not None:
        assert (klass, code) == (codes.STOPPED, 128 + stop)
    elif no_rendezvous:
        assert (klass, code) == (codes.RENDEZVOUS, codes.RENDEZVOUS_CODE)
    elif root is not None and root.asked is not None:  # the script's own code survives a crash in teardown
        assert code == fixed.get(klass, root.asked) and klass != codes.WORKER_SIGNAL
    if klass in fixed:
        assert code == fixed[klass]
    if klass == codes.OUT_OF_MEMORY:
        assert root is not None and root.oom
    if klass == codes.WORKER_SIGNAL:  # a worker's own signal: 128 + N
        assert root is not None and root.rank is not None and root.exitcode < 0 and code == 128 - root.exitcode
    if klass == codes.RENDEZVOUS and not no_rendezvous:  # torchrun's own words, before any worker
        assert root is not None and root.rank is None and ("Rendezvous" in root.exception or "Dist" in root.exception)
