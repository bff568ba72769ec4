"""The frameworks users train with, run as written under the launcher on 2 simulated hosts (namespaced).

Lightning's ``Trainer(strategy="ddp", num_nodes=N)``, transformers' ``Trainer`` (a tiny BERT built from a
config: nothing downloaded, ``HF_HUB_OFFLINE=1``) and accelerate's ``Accelerator``/``prepare``
(train_scripts/train_{lightning,hf_trainer,accelerate}.py). Each framework reads torchrun's variables
itself, wraps the user's exceptions, runs the training loop and keeps its own checkpoints. For each, three
jobs side by side (each its own namespaces), one process per host:

- ``resume``: rank 1 raises a ValueError in the user's step at step 3 of generation 0, ``--max-restarts 1``:
  generation 1 resumes from the framework's own checkpoint of step 3, both generations see a world of 2,
  and the job ends 0 at step 8;
- ``fails``: the same ValueError without restarts: every host exits 1 and its report starts with the user's
  exception and line, not the framework's wrapper or the other rank's lost connection;
- ``hang``: rank 1 blocks for ever in its step inside the framework's loop while rank 0 goes on into the
  gradient all-reduce: with ``--hang-timeout 15`` every host exits 124 and its report names rank 1, on
  algo-2, at its line, with its stack.

Every test proves nothing is left: every process of every job gone, nothing in the work directories.
"""

from __future__ import annotations

import glob
import os
from typing import Any, NamedTuple

import pytest
from conftest import TRAIN_SCRIPTS, assert_gone, launcher_env
from test_simulate import Simulate, processes_inside, read_json
from test_simulate_netns import machine  # noqa: F401  (a fixture used below)

from launcher import codes, hang
from launcher.hang import Frame, Thread
from launcher.simulate import netns

WHY_NOT = netns.unavailable()
STEPS, FAULT_STEP = 8, 3
SCRIPTS = {"lightning": "train_lightning.py", "hf_trainer": "train_hf_trainer.py", "accelerate": "train_accelerate.py"}
# what the user's code holds at the fault: the function the ValueError is raised in, and the one that blocks
USER_STEP = {"lightning": "training_step", "hf_trainer": "compute_loss", "accelerate": "main"}
RANK0_WAITS = ("backward", "_distributed_broadcast_coalesced")  # where rank 0 waits for a rank blocked in its step
# the framework's own wrappers and consequences, never the root cause
NOT_THE_CAUSE = ("ChildFailedError", "Connection closed by peer", "RuntimeError", "lightning/pytorch", "transformers/",
                 "accelerate/")


class Job(NamedTuple):
    """One simulated job: its process, where it runs and where its ranks write what they saw."""

    sim: Simulate
    workdir: str
    out: str


class Result(NamedTuple):
    """How a job ended: simulate's code, each host's exit code, outcome file and failure report, the records."""

    code: int
    exits: dict[str, int]
    outcomes: dict[str, Any]
    reports: dict[str, str]
    records: dict[str, Any]  # "g<gen>.r<rank>" -> what the rank saw


def line_of(framework: str, text: str) -> int:
    """The line of the framework's script that holds ``text`` (once)."""
    with open(os.path.join(TRAIN_SCRIPTS, SCRIPTS[framework]), encoding="utf-8") as fh:
        found = [i for i, line in enumerate(fh, 1) if text in line]
    assert len(found) == 1, (framework, text, found)
    return found[0]


def launch(tmp_path: Any, framework: str, name: str, *script_args: str, **options: str) -> Job:
    """Start the framework's script on 2 hosts; ``options`` are the launcher's (LAUNCHER_<NAME>)."""
    workdir, out = str(tmp_path / f"{framework}-{name}"), str(tmp_path / f"{framework}-{name}-out")
    os.mkdir(out)
    env = launcher_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"),
                       **{f"LAUNCHER_{k.upper()}": v for k, v in options.items()})
    sim = Simulate(["--hosts", "2", "--workdir", workdir, "--job-name", f"{framework}-{name}".replace("_", "-"),
                    "--platform-stop", "off", "--deadline", "300", "--nproc-per-node", "1", "--",
                    os.path.join(TRAIN_SCRIPTS, SCRIPTS[framework]), "--out", out, "--steps", str(STEPS),
                    *script_args], str(tmp_path), env)
    return Job(sim, workdir, out)


def finish(job: Job, framework: str) -> Result:
    """Wait for the job's end; prove nothing of it is left; read what it left behind."""
    try:
        code = job.sim.finish(timeout=420)
    finally:
        if job.sim.proc.poll() is None:
            job.sim.abort()
    summary = read_json(os.path.join(job.workdir, "summary.json"))
    records = {os.path.basename(p)[len(framework) + 1:-5]: read_json(p)
               for p in glob.glob(os.path.join(job.out, f"{framework}.g*.r*.json"))}
    assert_gone({job.sim.proc.pid, *(h["pid"] for h in summary["hosts"]), *(r["pid"] for r in records.values())})
    assert processes_inside(job.workdir) == []
    outcomes, reports = {}, {}
    for host in ("algo-1", "algo-2"):
        data = os.path.join(job.workdir, host, "output")
        if os.path.exists(os.path.join(data, "data", "outcome.json")):
            outcomes[host] = read_json(os.path.join(data, "data", "outcome.json"))
        if os.path.exists(os.path.join(data, "failure")):  # SageMaker's FailureReason: the report
            with open(os.path.join(data, "failure"), encoding="utf-8") as fh:
                reports[host] = fh.read()
    return Result(code, {h["host"]: h["exit_code"] for h in summary["hosts"]}, outcomes, reports, records)


def check_resumed(result: Result, job: Job, framework: str) -> None:
    """Generation 0 failed at the fault, generation 1 resumed from the checkpoint of that step and finished."""
    assert result.code == 0 and result.exits == {"algo-1": 0, "algo-2": 0}, job.sim.stderr[-4000:]
    assert sorted(result.records) == ["g0.r0", "g0.r1", "g1.r0", "g1.r1"], framework
    for key, seen in result.records.items():
        assert seen["world_size"] == 2 and seen["generation"] == int(key[1]), (framework, key, seen)
    assert [result.records[f"g1.r{r}"]["start_step"] for r in (0, 1)] == [FAULT_STEP] * 2, framework
    assert [result.records[f"g1.r{r}"]["end_step"] for r in (0, 1)] == [STEPS] * 2, framework
    assert [result.records[f"g0.r{r}"]["end_step"] for r in (0, 1)] == [None] * 2, framework  # it did fail
    for host, outcome in result.outcomes.items():
        assert outcome["class"] == codes.SUCCESS and outcome["recovered"] is True, (framework, host)
        [restart] = outcome["restarts"]
        assert restart["class"] == codes.WORKER_EXIT and restart["exit_code"] == 1, (framework, restart)
        assert restart["root_cause_host"] == "algo-2" and restart["root_cause"].startswith("algo-2: rank 1 "), restart
    assert len(result.outcomes) == 2


def check_failed(result: Result, job: Job, framework: str) -> None:
    """Every host exits 1 and its report starts with rank 1's own ValueError; the failing host's report ends
    with the user's line (the innermost frame of the traceback's tail)."""
    assert result.exits == {"algo-1": 1, "algo-2": 1}, (framework, job.sim.stderr[-4000:])
    assert len(result.outcomes) == 2 and len(result.reports) == 2, framework
    for host, outcome in result.outcomes.items():
        assert outcome["class"] == codes.WORKER_EXIT and outcome["root_cause_host"] == "algo-2", (framework, outcome)
        assert outcome["root_cause"].startswith("algo-2: rank 1 (local rank 0) exited with code 1"), outcome
        exception = outcome["exception"]
        assert exception.startswith("ValueError: bad batch ") and exception.endswith(f" at step {FAULT_STEP} on rank 1")
        report = result.reports[host].splitlines()
        assert report[0].startswith("algo-2: rank 1 (local rank 0) exited with code 1"), (framework, host, report)
        assert report[1] == exception, (framework, host, report)
        assert not any(word in "\n".join(report[:2]) for word in NOT_THE_CAUSE), (framework, host, report)
    raised = line_of(framework, 'raise ValueError(f"bad batch')
    user = f'{SCRIPTS[framework]}", line {raised}, in {USER_STEP[framework]}'
    assert user in result.reports["algo-2"].splitlines()[-2], (framework, result.reports["algo-2"])
    # algo-1's own part: stopped by the job watch, or, when its worker failed on the lost peer before the stop came,
    # that failure of its own (after the root cause in time)
    part = result.reports["algo-1"].splitlines()[2]
    assert part.startswith(("then algo-1: its workers were stopped because of that",
                            "then algo-1: rank 0 (local rank 0) exited with code 1")), (framework, part)


def check_hung(result: Result, job: Job, framework: str) -> None:
    """Every host exits 124; its report names rank 1 on algo-2 at its blocked line, with rank 0 waiting."""
    assert result.exits == {"algo-1": codes.HANG_CODE, "algo-2": codes.HANG_CODE}, (framework, job.sim.stderr[-4000:])
    where = f"{SCRIPTS[framework]}:{line_of(framework, 'threading.Event().wait()')} in {USER_STEP[framework]}"
    assert len(result.outcomes) == 2 and len(result.reports) == 2, framework
    for host, outcome in result.outcomes.items():
        assert outcome["class"] == codes.HANG and outcome["exit_code"] == codes.HANG_CODE, (framework, outcome)
        first = result.reports[host].splitlines()[0]
        assert first.startswith("hang: no progress for "), (framework, host, first)
        # rank 1 stands out: rank 0 waits for it in DDP's gradient all-reduce (the backward pass) or, where the
        # model has buffers (BERT's position ids), in DDP's broadcast of them at the next forward pass
        assert any(
            f"; rank 1 (algo-2) at {where} (in wait); rank 0 in {wait} (" in first for wait in RANK0_WAITS), \
            (framework, host, first)
    # each host's report has its own ranks' stacks: rank 1's on algo-2
    assert f"rank 1 (algo-2): {where}, in wait" in result.reports["algo-2"], (framework, result.reports["algo-2"])
    assert "rank 0 (algo-1): " in result.reports["algo-1"], (framework, result.reports["algo-1"])


@pytest.mark.job
@pytest.mark.lab
@pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}")
@pytest.mark.usefixtures("machine")
@pytest.mark.parametrize("framework", list(SCRIPTS))
def test_framework_fails_resumes_and_hangs_under_the_launcher(tmp_path: Any, framework: str) -> None:
    fault = ("--fail-at-step", str(FAULT_STEP))
    jobs = {"resume": launch(tmp_path, framework, "resume", *fault, max_restarts="1"),
            "fails": launch(tmp_path, framework, "fails", *fault),
            # the start's bound (until the first step the sampler sees: a loop of the script's own code coming
            # round, which transformers' loop shows only when a look lands in compute_loss) lowered from 540 s
            "hang": launch(tmp_path, framework, "hang", "--hang-at-step", str(FAULT_STEP), hang_timeout="15",
                           hang_start_timeout="60")}
    results = {name: finish(job, framework) for name, job in jobs.items()}
    check_resumed(results["resume"], jobs["resume"], framework)
    check_failed(results["fails"], jobs["fails"], framework)
    check_hung(results["hang"], jobs["hang"], framework)


# --- the launcher's reading of a framework's hang: the backward pass waits for the others ---------------------

SITE = "/venv/lib/python3.11/site-packages"


def test_a_rank_in_the_backward_pass_waits_for_the_others_the_blocked_rank_is_named() -> None:
    # The stacks of a real Lightning hang: rank 0 in DDP's backward (the gradient all-reduce is waited for in the
    # autograd engine, with no torch.distributed frame), rank 1 blocked in the user's training_step.
    backward = (Frame(f"{SITE}/torch/autograd/graph.py", 1072, "_engine_run_backward"),
                Frame(f"{SITE}/torch/autograd/__init__.py", 395, "backward"),
                Frame(f"{SITE}/torch/_tensor.py", 623, "backward"),
                Frame(f"{SITE}/lightning/pytorch/core/module.py", 1137, "backward"),
                Frame("/job/train.py", 114, "main"), Frame("/job/train.py", 121, "<module>"))
    blocked = (Frame("/usr/lib/python3.11/threading.py", 324, "wait"), Frame("/job/train.py", 53, "training_step"),
               Frame(f"{SITE}/lightning/pytorch/strategies/strategy.py", 634, "wrapped_forward"),
               Frame("/job/train.py", 114, "main"), Frame("/job/train.py", 121, "<module>"))
    positions = {0: hang.position([Thread("0x1", True, backward)]), 1: hang.position([Thread("0x1", True, blocked)])}
    assert positions[0] == hang.Position("/job/train.py", 114, "main", "backward", True)
    assert positions[1] is not None and not positions[1].comm
    assert hang.culprit_rank(positions, range(2)) == 1  # type: ignore[arg-type]
    assert hang.culprit_sentence(positions, {0: "algo-1", 1: "algo-2"}, 15, range(2)) == (  # type: ignore[arg-type]
        "hang: no progress for 15 s; rank 1 (algo-2) at train.py:53 in training_step (in wait); "
        "rank 0 in backward (train.py:114)")
    # DDP's buffer broadcast in its forward pass (a BERT has buffers) waits for the others too
    broadcast = (Frame(f"{SITE}/torch/nn/parallel/distributed.py", 2366, "_distributed_broadcast_coalesced"),
                 Frame(f"{SITE}/torch/nn/parallel/distributed.py", 2452, "_default_broadcast_coalesced"),
                 Frame(f"{SITE}/torch/nn/parallel/distributed.py", 1880, "forward"),
                 Frame("/job/train.py", 69, "compute_loss"), Frame("/job/train.py", 130, "main"))
    assert hang.position([Thread("0x1", True, broadcast)]) == hang.Position(
        "/job/train.py", 69, "compute_loss", "_distributed_broadcast_coalesced", True)
    # a backward pass of another library's file of the same name is no wait; every rank in backward: no odd one out
    assert not hang.is_distributed_wait(Frame("/job/mylib/backward.py", 3, "backward"))
    both = {0: positions[0], 1: positions[0]}
    assert hang.culprit_rank(both, range(2)) is None  # type: ignore[arg-type]


def test_the_backward_and_ddp_waits_are_functions_of_the_installed_torch() -> None:
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    autograd = os.path.join(list(spec.submodule_search_locations)[0], "autograd")
    defined: set[str] = set()
    for name in ("__init__.py", "graph.py"):
        with open(os.path.join(autograd, name), encoding="utf-8") as fh:
            defined.update(re.findall(r"^def (\w+)\s*[\[(]", fh.read(), re.MULTILINE))
    assert sorted(hang.BACKWARD_WAITS - defined) == []
    with open(os.path.join(list(spec.submodule_search_locations)[0], "nn", "parallel", "distributed.py"),
              encoding="utf-8") as fh:
        assert sorted(hang.DDP_WAITS - set(re.findall(r"^\s*def (\w+)\s*[\[(]", fh.read(), re.MULTILINE))) == []
