"""Job-wide restarts' rules and values (launcher/restart.py, launcher/generations.py, launcher/command.py):
node 0's decision for every class of end, the root cause's identity, the generation's port and environment,
the final verdict, and the bootstrap's TORCHELASTIC_RESTART_COUNT. The real jobs are in test_restart_jobs.py."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from conftest import REPO, launcher_env, resolve_cluster
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher import codes, restart
from launcher.command import BOOTSTRAP, build_launch, for_generation, generation_port
from launcher.generations import History
from launcher.options import DEFAULT_RESTART_ON, RESTARTABLE, parse_invocation
from launcher.progress import SAMPLED, BeatSocket, Progress
from launcher.report import Verdict

CLASSES = [codes.WORKER_EXIT, codes.WORKER_SIGNAL, codes.HANG, codes.RENDEZVOUS, codes.STOPPED, "out_of_memory"]


def end(node: int = 0, code: int = 1, klass: str = codes.WORKER_EXIT, key: str = "exit 1", primary: bool = True,
        progress: bool = False, stopped: bool = False, at: float = 0.0, watched: bool = True,
        exception: str = "ValueError: x", ahead_gone: bool = False) -> restart.End:
    return restart.End(node, f"algo-{node + 1}", code, klass, key, f"algo-{node + 1}: failed\n{exception}",
                       primary, progress, stopped, at=at, watched=watched, ahead_gone=ahead_gone)


ENDS = st.builds(end, node=st.integers(0, 3), code=st.integers(0, 3), klass=st.sampled_from(CLASSES),
                 key=st.sampled_from(["exit 1", "SIGKILL", "hang"]), primary=st.booleans(), progress=st.booleans(),
                 stopped=st.booleans(), at=st.floats(0, 100), watched=st.booleans(), ahead_gone=st.booleans(),
                 exception=st.sampled_from(["ValueError: x", "RuntimeError: Connection reset by peer",
                                            "torch.distributed.DistBackendError: NCCL error"]))


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(0, 4), restart_on=st.sets(st.sampled_from(RESTARTABLE)),
       generations=st.lists(st.tuples(st.lists(ENDS, min_size=1, max_size=4), st.booleans(),
                                      st.none() | st.floats(0, 100)), min_size=1, max_size=8))
def test_the_policy_never_restarts_what_it_must_not(budget: int, restart_on: set, generations: list) -> None:
    policy = restart.Policy(budget, restart_on)
    previous = None
    for gen, (ends, lost, lost_at) in enumerate(generations):
        decision = policy.decide(gen, ends, lost, lost_at)
        assert decision.generation == gen and decision.used <= budget
        failing = [e for e in ends if e.code != 0 and (not lost or lost_at is None or e.at < lost_at)]
        if decision.restart:
            assert not lost and failing and not any(e.stopped for e in ends)
            assert decision.cause is not None and decision.cause.klass in restart_on
            assert gen == 0 or decision.cause.key != previous or not all(e.watched and not e.progress for e in ends)
        elif decision.why == "no_progress":  # only with evidence: every host watched, none stepped
            assert gen > 0 and decision.cause.key == previous and all(e.watched and not e.progress for e in ends)
        if not failing:  # nobody failed, or (a host lost) not before that host was last heard: the loss is the cause
            assert decision.cause is None
        else:  # the cause: the earliest failure by node 0's clock that is no consequence, else the earliest
            assert decision.cause in failing
            candidates = [e for e in failing if e.primary] or failing
            assert decision.cause in candidates and decision.cause.at == min(e.at for e in candidates)
        # a host's next generation started ahead has ended: no host uses its own (it may have met that one)
        assert decision.fresh == any(e.ahead_gone for e in ends)
        if decision.cause is not None:
            previous = decision.cause.key
        if not decision.restart:
            break
    assert policy.used <= budget


@pytest.mark.parametrize(("ends", "lost", "why"), [
    ([end(code=0), end(1, code=0)], False, "success"),
    ([end(), end(1, code=0)], True, "lost"),
    ([end(stopped=True), end(1, primary=False)], False, "stopped"),
    ([end(klass=codes.RENDEZVOUS)], False, "class"),
    ([end(1, primary=False, klass=codes.STOPPED), end(0)], False, "restart"),  # the primary failure decides
])
def test_each_kind_of_end_gets_its_decision(ends: list, lost: bool, why: str) -> None:
    assert restart.Policy(2, DEFAULT_RESTART_ON).decide(0, ends, lost).why == why


def test_the_earliest_failure_is_the_cause_whatever_its_words() -> None:
    # rank 1's network-worded failure came first by node 0's clock: it is the cause, and it is restarted
    reset = end(1, at=10.0, key="RuntimeError@train.py:9", exception="RuntimeError: Connection reset by peer")
    later = end(0, at=10.4, key="ValueError@train.py:3")
    for ends in ([reset, later], [later, reset]):
        decision = restart.Policy(5, DEFAULT_RESTART_ON).decide(0, ends)
        assert decision.cause == reset and decision.why == "restart"


def test_a_consequence_needs_evidence_and_when_all_look_secondary_the_earliest_is_the_cause() -> None:
    stopped = end(0, at=1.0, primary=False, klass=codes.STOPPED)  # its workers were stopped by the job watch
    own = end(1, at=2.0)
    assert restart.Policy(1, DEFAULT_RESTART_ON).decide(0, [stopped, own]).cause == own
    first, second = end(0, at=3.0, primary=False), end(1, at=2.5, primary=False)
    assert restart.Policy(1, DEFAULT_RESTART_ON).decide(0, [first, second]).cause == second
    assert restart.root_cause([end(code=0), end(1, code=0)]) is None


def test_ninety_three_needs_evidence_of_no_progress() -> None:
    policy = restart.Policy(4, DEFAULT_RESTART_ON)
    assert policy.decide(0, [end(key="A")]).why == "restart"
    # a sampled step on one host is progress; a host nobody could watch (no sampler, no beat) is no evidence
    assert policy.decide(1, [end(key="A"), end(1, code=0, progress=True)]).why == "restart"
    assert policy.decide(2, [end(key="A", watched=False), end(1, code=0)]).why == "restart"
    decision = policy.decide(3, [end(key="A"), end(1, code=0)])
    assert decision.why == "no_progress" and "no step from any rank: no beat, no sampled step" in decision.sentence(4)


def test_sampled_steps_are_progress_and_moves_alone_are_not(tmp_path: Any) -> None:
    lines: list[str] = []
    progress = Progress()
    spans = restart.phases(0.0, 0.5, 1.5, 1.6)
    steps = restart.Steps(progress, None, lines.append, "restart 1 of 2 (job-wide): x", 0.0, spans)
    try:
        assert not steps.watched() and not steps.moved()
        progress.beat(3, SAMPLED[0])  # the sampler saw the main thread move: watched, no step
        assert steps.watched() and not steps.moved()
        progress.beat(3, SAMPLED[1])  # it went round a loop of the script's own code: a step
        assert steps.moved() and progress.steps == 1
    finally:
        steps.close()
    [line] = lines
    assert line.startswith("restart 1 of 2 (job-wide): x; first step ")
    assert "phases: detection 0.50 s, stop 1.00 s, barrier 0.10 s, new torchrun ? s, first step " in line
    assert spans["first_step"] is not None and spans["first_step"] >= 0


def test_the_sampler_of_a_real_script_that_never_beats_gives_steps(tmp_path: Any) -> None:
    # a loop with two lines that take time (its work, then a pause), as a training loop has: no explicit beat
    script = tmp_path / "loop.py"
    script.write_text("import time\nfor _ in range(12):\n    time.sleep(0.2)\n    time.sleep(0.2)\n")
    beats = BeatSocket(str(tmp_path))
    progress = Progress()
    try:
        subprocess.run([sys.executable, BOOTSTRAP, str(script)], env=launcher_env(RANK="0", DDP_LAUNCHER_PROGRESS=
                       beats.path), check=True, cwd=REPO, timeout=120)
        beats.drain(progress)
    finally:
        beats.close()
    assert progress.steps > 0 and progress.beats == 0  # sampled steps only


def test_the_budget_is_job_wide_and_a_repeat_without_progress_stops_at_once() -> None:
    policy = restart.Policy(2, DEFAULT_RESTART_ON)
    assert policy.decide(0, [end(key="A"), end(1, primary=False)]).why == "restart"
    assert policy.decide(1, [end(key="A", progress=True)]).why == "restart"  # progress: worth another try
    decision = policy.decide(2, [end(key="A")])
    assert (decision.why, decision.used) == ("budget", 2)
    policy = restart.Policy(5, DEFAULT_RESTART_ON)
    assert policy.decide(0, [end(key="A")]).why == "restart"
    assert policy.decide(1, [end(key="B")]).why == "restart"  # another cause: worth another try
    decision = policy.decide(2, [end(key="B"), end(1, code=0, progress=False)])
    assert decision.why == "no_progress" and not decision.restart and decision.used == 2
    assert "generation 2 failed with the same root cause as generation 1 (B)" in decision.sentence(5)


def test_messages_travel_whole_and_malformed_ones_raise() -> None:
    decision = restart.Policy(1, DEFAULT_RESTART_ON).decide(0, [end(key="SIGKILL"), end(1, ahead_gone=True)])
    assert decision.fresh and restart.decision_of(json.loads(json.dumps(decision.message()))) == decision
    assert restart.end_of(json.loads(json.dumps(end().message()))) == end()
    assert restart.end_of(json.loads(json.dumps(end(ahead_gone=True).message()))) == end(ahead_gone=True)
    for bad in ({}, {**end().message(), "code": "x"}, {**end().message(), "node": None}):
        with pytest.raises((KeyError, TypeError, ValueError)):
            restart.end_of(bad)


@pytest.mark.parametrize(("klass", "exception", "detail", "signal", "key"), [
    (codes.HANG, "", "", None, "hang"),
    (codes.WORKER_SIGNAL, "", "", "SIGKILL", "SIGKILL"),
    (codes.WORKER_EXIT, "ValueError: bad", 'File "/a/b/train.py", line 3, in f\nFile "/a/lib.py", line 9', None,
     "ValueError@lib.py:9"),
    (codes.WORKER_EXIT, "", "no traceback", None, "exit 3"),
])
def test_the_root_cause_is_its_exception_and_line_or_signal(klass: str, exception: str, detail: str,
                                                             signal: Any, key: str) -> None:
    assert restart.root_key(klass, exception, detail, signal, 3) == key


def test_each_generation_meets_on_a_port_of_its_own_unless_the_port_is_fixed(tmp_path: Any) -> None:
    env = {"SM_HOSTS": '["algo-1","algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_CPUS": "2",
           "SM_NUM_GPUS": "0", "SM_MODULE_NAME": "x"}
    options = parse_invocation(["train.py"], {}).options
    cluster = resolve_cluster(env, options)
    base = generation_port(cluster, options, False, 0)
    assert [generation_port(cluster, options, False, g) for g in range(3)] == [base, base + 1, base + 2]
    assert generation_port(cluster, options, True, 2) == base  # the platform fixes it (Kubeflow's MASTER_PORT)
    fixed = parse_invocation(["--master-port", "65535", "train.py"], {}).options
    assert generation_port(cluster, fixed, False, 3) == 65535  # the user fixed it
    launch = build_launch(cluster, options, "train.py", [], {}, str(tmp_path))
    assert launch.argv[launch.argv.index("--max-restarts") + 1] == "0"  # torchrun never restarts by itself
    second = for_generation(launch, base + 1, 1)
    assert second.argv[second.argv.index("--master-port") + 1] == str(base + 1)
    assert second.env_changes["DDP_LAUNCHER_GENERATION"] == "1"
    assert len(second.argv) == len(launch.argv)


def test_the_port_wraps_inside_the_unprivileged_range() -> None:
    options = parse_invocation(["train.py"], {}).options
    env = {"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1", "SM_NUM_CPUS": "2", "SM_NUM_GPUS": "0",
           "SM_MODULE_NAME": "x"}
    cluster = resolve_cluster(env, options)._replace(master_port=65535)
    assert generation_port(cluster, options, False, 1) == 1024


def test_workers_see_the_generation_as_torchelastic_restart_count(tmp_path: Any) -> None:
    script = tmp_path / "show.py"
    script.write_text("import os\nprint(os.environ['TORCHELASTIC_RESTART_COUNT'])\n")
    env = launcher_env(TORCHELASTIC_RESTART_COUNT="0", DDP_LAUNCHER_GENERATION="2")
    out = subprocess.run([sys.executable, BOOTSTRAP, str(script)], env=env, capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert out.stdout == "2\n"


def test_the_final_verdict_says_the_restarts_and_the_no_progress_class() -> None:
    history = History(3)
    history.records.append({"generation": 1, "class": codes.WORKER_EXIT})
    lines: list[str] = []
    own = Verdict(codes.WORKER_EXIT, 1, root_cause="algo-2: rank 1 exited with code 1")
    verdict, text = history.verdict(own, "algo-2: rank 1 exited with code 1\nValueError: x", 4096, lines.append)
    assert text.splitlines() == ["algo-2: rank 1 exited with code 1 (after 1 job-wide restart(s) of 3)",
                                 "ValueError: x"]
    assert verdict.code == 1 and verdict.restarts == ({"generation": 1, "class": codes.WORKER_EXIT},)
    history.last = restart.Decision(1, False, "no_progress", 1, end(1, key="ValueError@t.py:3"))
    verdict, text = history.verdict(own, "algo-2: rank 1 exited with code 1", 4096, lines.append)
    assert (verdict.klass, verdict.code) == (codes.NO_PROGRESS, codes.NO_PROGRESS_CODE)
    assert text.startswith("restarting does not help: generation 1 failed with the same root cause as generation 0 "
                           "(ValueError@t.py:3)") and verdict.root_cause == text.splitlines()[0]
    # the budget spent: every host ends with the root cause's class and code, whatever its own end was
    history.last = restart.Decision(2, False, "budget", 3, end(1, code=1, key="OSError@t.py:9"))
    stopped = Verdict(codes.STOPPED, 143, root_cause="algo-1: its workers were stopped because of that")
    verdict, text = history.verdict(stopped, "algo-2: rank 1 exited with code 1\nthen algo-1: stopped", 4096,
                                    lines.append)
    assert (verdict.klass, verdict.code, verdict.root_cause_host) == (codes.WORKER_EXIT, 1, "algo-2")
    verdict, text = History(2).verdict(Verdict(codes.SUCCESS, 0), "", 4096, lines.append)
    assert text == "" and verdict.restarts == () and lines == []


@pytest.mark.parametrize("value", ["host_lost", "stopped", "bad_input", "internal", "success", ""])
def test_restart_on_refuses_a_class_that_is_never_restarted(value: str) -> None:
    out = subprocess.run([sys.executable, "-m", "launcher", "--restart-on", value, "--dry-run", "x.py"],
                         env=launcher_env(), capture_output=True, text=True, cwd=REPO)
    assert out.returncode == codes.BAD_INPUT_CODE and len(out.stderr.strip().splitlines()) == 1
    assert "--restart-on" in out.stderr


def test_restart_on_default_and_list() -> None:
    assert parse_invocation(["x.py"], {}).options.restart_on == DEFAULT_RESTART_ON
    assert parse_invocation(["x.py"], {"LAUNCHER_RESTART_ON": "hang"}).options.restart_on == ("hang",)


def test_torchrun_counts_as_done_once_its_failure_table_is_printed() -> None:
    from launcher.supervise import StderrTail, failure_reported

    tail = StderrTail()
    table = ["[W] warning", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 60,
             "bootstrap.py FAILED", "-" * 60, "Failures:", "  <NO_OTHER_FAILURES>", "-" * 60,
             "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 0)"]
    tail.feed("\n".join(table).encode())
    assert not failure_reported(tail)  # the table's root cause is still being written
    tail.feed(b"\n  exitcode  : 3 (pid: 12)\n" + b"=" * 60 + b"\n")
    assert failure_reported(tail)
    tail.feed(b"Root Cause (first observed failure):\n")  # a second table begins: wait for its end too
    assert not failure_reported(tail)


def test_a_hosts_failure_is_primary_by_evidence_only_never_by_its_words() -> None:
    """Node 0's decision that ended the job names the one primary host; without one, a worker's own failure is
    primary unless a host was lost before it; what the exception says never counts."""
    from types import SimpleNamespace

    from launcher import report
    from launcher.failure import RootCause
    from launcher.jobwatch import Event

    def watch(decisions, *events):
        return SimpleNamespace(decisions=decisions, events=list(events))

    reset = RootCause(1, 0, 1, "RuntimeError: Connection reset by peer", "")
    bug = RootCause(1, 0, 1, "ValueError: bad batch", "")
    ended = restart.Policy(0, DEFAULT_RESTART_ON).decide(0, [end(0, primary=False), end(1)]).message()
    assert ended["why"] == "budget"
    for cause in (reset, bug):  # the decision's node, whatever either exception says
        assert report.is_primary(watch({0: ended}), 1, cause, 5.0)
        assert not report.is_primary(watch({0: ended}), 0, cause, 5.0)
    lost = Event("lost", 2, "algo-3", 137, "algo-3 lost: connection closed", False, at=4.0)
    before = end(1, at=5.0)
    after_loss = restart.Policy(0, DEFAULT_RESTART_ON).decide(0, [before], True, 4.0).message()
    assert after_loss["why"] == "lost" and after_loss["cause"] is None  # the loss came first: no host is primary
    assert not report.is_primary(watch({0: after_loss}, lost), 1, bug, 5.0)
    earlier = restart.Policy(0, DEFAULT_RESTART_ON).decide(0, [end(1, at=3.0)], True, 4.0).message()
    assert report.is_primary(watch({0: earlier}, lost), 1, reset, 3.0)  # failed before the lost host's last word
    restarted = restart.Policy(1, DEFAULT_RESTART_ON).decide(0, [end(1)]).message()
    for decisions in ({}, {0: restarted}):  # no decision ended the job: the evidence this host has
        assert report.is_primary(watch(decisions), 1, reset, 5.0)
        assert report.is_primary(watch(decisions, lost), 1, reset, 3.0)
        assert not report.is_primary(watch(decisions, lost), 1, bug, 5.0)  # a host was lost before it failed
        assert not report.is_primary(watch(decisions), 1, RootCause(None, None, None, "torchrun failed", ""), 5.0)
        assert not report.is_primary(watch(decisions), 1, None, 5.0)
