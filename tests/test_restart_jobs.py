"""Job-wide restarts in place (``--max-restarts``, launcher/restart.py): real gloo jobs on namespaced hosts.

tests/scripts/restart_worker.py fails on purpose in chosen generations (it reads the generation from
``TORCHELASTIC_RESTART_COUNT``), keeps a checkpoint and resumes from it, and records each rank's pid per
generation and the pids of the generation before that still exist when its process group is up. Several
independent jobs run side by side (each its own namespaces) to keep the suite's time down. Each test proves
nothing is left: every process of every job gone, nothing in the work directories, the machine's network as before.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import time
from typing import Any, NamedTuple, Optional, Union

import pytest
from conftest import REPO, assert_gone, is_alive, launcher_env
from test_simulate import Simulate, processes_inside, read_json
from test_simulate_netns import machine, machine_state  # noqa: F401  (machine: a fixture used below)

from launcher import ahead, codes
from launcher.simulate import netns

WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}"),
              pytest.mark.usefixtures("machine"), pytest.mark.job, pytest.mark.lab]

SCRIPT = os.path.join(REPO, "tests", "scripts", "restart_worker.py")
STEPS = 6


class Job(NamedTuple):
    """One simulated job of a test: its process, where it runs, how many hosts."""

    sim: Simulate
    workdir: str
    out: str
    hosts: int


class Result(NamedTuple):
    """How a job ended: simulate's code, each host's exit code, outcome file and log lines, the records."""

    code: int
    exits: dict[str, int]
    outcomes: dict[str, Any]
    logs: dict[str, list[str]]
    records: dict[str, Any]  # "g<gen>.r<rank>" -> the rank's record
    checkpoint: Any
    summary: Any


def launch(tmp_path: Any, name: str, hosts: int, *script_args: str, sim_args: tuple[str, ...] = (),
           platform: str = "sagemaker", environ: Optional[dict[str, str]] = None, **options: str) -> Job:
    """Start a job; ``options`` are the launcher's (LAUNCHER_<NAME> in every host's environment), ``environ`` more
    of that environment."""
    workdir, out = str(tmp_path / name), str(tmp_path / f"{name}-out")
    os.mkdir(out)
    env = launcher_env(**{f"LAUNCHER_{k.upper()}": v for k, v in options.items()}, **(environ or {}))
    sim = Simulate(["--hosts", str(hosts), "--workdir", workdir, "--job-name", name, "--platform", platform,
                    "--platform-stop", "off", "--deadline", "240", "--nproc-per-node", "1", *sim_args, "--", SCRIPT,
                    "--out", out, "--steps", str(STEPS), *script_args], str(tmp_path), env)
    return Job(sim, workdir, out, hosts)


def finish(job: Job) -> Result:
    """Wait for the job's end; prove nothing of it is left; read what it left behind."""
    try:
        code = job.sim.finish(timeout=400)
    finally:
        if job.sim.proc.poll() is None:
            job.sim.abort()
    summary = read_json(os.path.join(job.workdir, "summary.json"))
    records = {os.path.basename(p)[:-5]: read_json(p) for p in glob.glob(os.path.join(job.out, "g*.r*.json"))}
    pids = {job.sim.proc.pid, *(h["pid"] for h in summary["hosts"]), *(r["pid"] for r in records.values())}
    assert_gone(pids)
    assert processes_inside(job.workdir) == []
    names = [f"algo-{i}" for i in range(1, job.hosts + 1)] if summary["platform"] == "sagemaker" else \
        [h["host"] for h in summary["hosts"]]
    outcomes = {}
    for host in names:
        path = os.path.join(job.workdir, host, "output", "data", "outcome.json")
        if os.path.exists(path):
            outcomes[host] = read_json(path)
    # SDK 3.x's driver passes the launcher's stderr on as its stdout: both streams are read
    logs = {h["host"]: [line for line in job.sim.err + job.sim.out if line.startswith(f"[{h['host']}] [ddp-launcher]")]
            for h in summary["hosts"]}
    ckpt = os.path.join(job.out, "ckpt.json")
    return Result(code, {h["host"]: h["exit_code"] for h in summary["hosts"]}, outcomes, logs, records,
                  read_json(ckpt) if os.path.exists(ckpt) else None, summary)


def restart_lines(result: Result, host: str) -> list[str]:
    """The host's restart lines (one per restart)."""
    return [line for line in result.logs[host] if re.search(r"\] restart \d+ of \d+ \(job-wide\)", line)]


def uninterrupted_sum(world: int) -> float:
    """What rank 0's checkpoint holds after an uninterrupted run: each step all-reduces rank + 1."""
    return STEPS * world * (world + 1) / 2


V3_PYTHON = os.path.join(REPO, ".venv-v3", "bin", "python")
PLATFORMS = ("slurm", "pbs", "vertex", "oci", "env")  # and SageMaker (SDK 2.x, 3.x) and Kubeflow, below


def test_one_failure_restarts_every_host_once_and_the_job_finishes(tmp_path: Any) -> None:
    # Side by side: a worker exits 3 once (SageMaker, budget 1: one failure costs exactly one restart) and a
    # worker is SIGKILLed once (Kubeflow, whose MASTER_PORT is fixed: the new rendezvous reuses it); and on every
    # other platform, a worker exits 3 once (budget 1).
    # And the first job again with the next generation's torchrun started after the decision, not ahead of it.
    jobs = {"exits": launch(tmp_path, "exits", 2, "--fail", "exit", max_restarts="1"),
            "ahead-off": launch(tmp_path, "ahead-off", 2, "--fail", "exit", max_restarts="1",
                                environ={ahead.VARIABLE: "0"}),
            "killed": launch(tmp_path, "killed", 2, "--fail", "kill", platform="kubeflow", max_restarts="2")}
    for platform in PLATFORMS:
        jobs[platform] = launch(tmp_path, platform, 2, "--fail", "exit", platform=platform, max_restarts="1")
    if os.access(V3_PYTHON, os.X_OK):  # `make test` creates .venv-v3 (SageMaker SDK 3.x): ModelTrainer's drivers
        drivers = str(tmp_path / "drivers")
        subprocess.run([V3_PYTHON, os.path.join(REPO, "tools", "sm_drivers_v3.py"), drivers], check=True,
                       timeout=300, capture_output=True)
        jobs["sdk-v3"] = launch(tmp_path, "v3", 2, "--fail", "exit", sim_args=("--sdk", "v3", "--sm-drivers", drivers),
                                max_restarts="1")
    results = {name: finish(job) for name, job in jobs.items()}
    for name, result in results.items():
        job = jobs[name]
        assert result.code == 0 and list(result.exits.values()) == [0, 0], f"{name}: {job.sim.stderr[-4000:]}"
        for host, lines in result.logs.items():
            said = restart_lines(result, host)
            assert len(said) == 1 and "generation 1 starts" in said[0] and "first step" in said[0], (name, lines)
            assert "rank 1" in said[0] and ("SIGKILL" if name == "killed" else "exited with code 3") in said[0]
        # every rank ran generations 0 and 1 (TORCHELASTIC_RESTART_COUNT), none of generation 0 left by then
        assert sorted(result.records) == ["g0.r0", "g0.r1", "g1.r0", "g1.r1"], name
        assert {r["generation"] for k, r in result.records.items() if k.startswith("g1")} == {1}
        assert all(r["old_alive"] == [] for r in result.records.values()), name
        assert result.records["g1.r0"]["steps"] == STEPS - 2, name  # resumed after the 2 complete steps
        assert result.checkpoint == {"step": STEPS, "sum": uninterrupted_sum(2)}, name
    for name, result in results.items():  # generation 1's torchrun was started ahead on every host, unless off
        for lines in result.logs.values():
            started = [line for line in lines if "torchrun started as pid" in line]
            assert len(started) == 2 and ["(started ahead" in line for line in started] == [
                False, name != "ahead-off"], (name, lines)
    assert_started_alike(results["exits"].records, results["ahead-off"].records)
    if "sdk-v3" in jobs:  # the SDK's own driver started each host's launcher
        assert "Running Basic Script driver" in jobs["sdk-v3"].sim.stderr + jobs["sdk-v3"].sim.stdout
    ports = {k: r["master_port"] for k, r in results["killed"].records.items()}
    assert len(set(ports.values())) == 1  # Kubeflow's fixed MASTER_PORT, reused by generation 1
    for host in results["killed"].logs:  # rank 1 is on the worker pod: the root cause named on every host
        assert "killed-worker-0: rank 1" in restart_lines(results["killed"], host)[0]
        assert "SIGKILL" in restart_lines(results["killed"], host)[0]
    for host, outcome in results["exits"].outcomes.items():
        assert outcome["class"] == codes.SUCCESS and outcome["recovered"] is True, host
        [restart] = outcome["restarts"]
        assert restart["generation"] == 1 and restart["class"] == codes.WORKER_EXIT and restart["exit_code"] == 3
        assert restart["root_cause_host"] == "algo-2" and "exited with code 3" in restart["root_cause"]
        assert "Gloo" not in restart["root_cause"]  # the worker's own exit, not a restart race
        assert restart["seconds_to_first_step"] is not None
    assert len(results["exits"].outcomes) == 2


def assert_started_alike(ahead_on: dict[str, Any], ahead_off: dict[str, Any]) -> None:
    """A rank of generation 1 whose torchrun was started ahead (``ahead_on``'s records) is started as one whose
    torchrun was started after the decision (``ahead_off``'s, the same job otherwise): each differs from its own
    generation 0 in the same environment variables (the generation, its port), and in nothing else it was started
    with: ``sys.argv``, ``__main__``, the signals it blocks, ignores and catches, its parent-death signal."""
    for rank in (0, 1):
        changed = []
        for records in (ahead_on, ahead_off):
            first, second = records[f"g0.r{rank}"], records[f"g1.r{rank}"]
            assert set(first["env"]) == set(second["env"]), set(first["env"]) ^ set(second["env"])
            changed.append(sorted(k for k in first["env"] if first["env"][k] != second["env"][k]))
            for fact in ("argv", "main", "signals", "pdeathsig"):
                assert first[fact] == second[fact], (rank, fact, first[fact], second[fact])
        assert changed[0] == changed[1] and "TORCHELASTIC_RESTART_COUNT" in changed[0], changed
        on, off = ahead_on[f"g1.r{rank}"], ahead_off[f"g1.r{rank}"]
        assert set(on["env"]) == set(off["env"]) - {ahead.VARIABLE} and (on["signals"], on["pdeathsig"]) == (
            off["signals"], off["pdeathsig"]), (on, off)


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory: Any) -> dict[str, tuple[Job, Union[Result, BaseException]]]:
    """Six jobs side by side, each to its end (its result, or what proving it left nothing raised):

    - ``same``: the same exception twice without progress (budget 3);
    - ``budget``: a budget used up (a worker exits 3 in every generation, after progress; budget 1);
    - ``lost``: a lost host (budget 2);
    - ``stop``: a SIGTERM from the platform inside a restart, before the new generation's first step (budget 2);
    - ``hang``: rank 1 stops taking part at step 3 of generation 0, the others wait in the collective: no progress
      anywhere for the hang timeout (above a loaded machine's torch import and rendezvous, which print nothing);
    - ``four``: 4 hosts, a worker exits 3 in generations 0 and 1 (budget 2)."""
    tmp_path = tmp_path_factory.mktemp("side-by-side")
    before = machine_state()
    jobs = {"same": launch(tmp_path, "same", 2, "--fail", "raise", "--fail-step", "0", "--fail-in", "all",
                           max_restarts="3"),
            "budget": launch(tmp_path, "budget", 2, "--fail", "exit", "--fail-in", "all", max_restarts="1"),
            "lost": launch(tmp_path, "lost", 2, "--steps", "20", sim_args=("--fault", "algo-2:SIGKILL:step=2"),
                           max_restarts="2"),
            "stop": launch(tmp_path, "stop", 2, "--fail", "exit", "--window-in", "1",
                           sim_args=("--fault", "algo-1:SIGTERM:step=99"), max_restarts="2"),
            "hang": launch(tmp_path, "hang", 2, "--fail", "hang", max_restarts="1", hang_timeout="15"),
            "four": launch(tmp_path, "four", 4, "--fail", "exit", "--fail-in", "0,1", "--fail-step", "2",
                           max_restarts="2")}
    ended: dict[str, tuple[Job, Union[Result, BaseException]]] = {}
    for name, job in jobs.items():
        try:
            ended[name] = (job, finish(job))
        except Exception as exc:  # noqa: BLE001  (the test of that job raises it)
            ended[name] = (job, exc)
    assert machine_state() == before  # every lab is gone: namespaces, links, hosts file, hostname
    return ended


def result_of(jobs: dict[str, tuple[Job, Union[Result, BaseException]]], name: str) -> tuple[Job, Result]:
    """The job and its result; what it raised, raised again here."""
    job, result = jobs[name]
    if isinstance(result, BaseException):
        raise result
    return job, result


def test_restarting_stops_where_it_cannot_help(side_by_side: dict[str, tuple[Job, Any]]) -> None:
    ended = {name: result_of(side_by_side, name) for name in ("same", "budget", "lost", "stop")}
    same, budget, lost, stop = (ended[name][0] for name in ("same", "budget", "lost", "stop"))
    results = {name: result for name, (_, result) in ended.items()}

    result = results["same"]  # generation 1 failed like generation 0 and made no progress: stopped, 93
    assert set(result.exits.values()) == {codes.NO_PROGRESS_CODE}, same.sim.stderr[-4000:]
    assert sorted(result.records) == ["g0.r0", "g0.r1", "g1.r0", "g1.r1"]  # no third generation
    for host, outcome in result.outcomes.items():
        assert outcome["class"] == codes.NO_PROGRESS and outcome["exit_code"] == codes.NO_PROGRESS_CODE
        assert outcome["root_cause"].startswith("restarting does not help: generation 1 failed with the same root "
                                                "cause as generation 0 (RuntimeError@restart_worker.py:")
        assert "(1 restart(s) of 3)" in outcome["root_cause"] and len(outcome["restarts"]) == 1
        assert len(restart_lines(result, host)) == 1
    assert len(result.outcomes) == 2

    result = results["budget"]  # the last failure's code, every host; the restart named the real cause
    assert set(result.exits.values()) == {3}, budget.sim.stderr[-4000:]
    for outcome in result.outcomes.values():
        assert outcome["class"] == codes.WORKER_EXIT and outcome["root_cause_host"] == "algo-2"
        assert "exited with code 3" in outcome["root_cause"] and "(after 1 job-wide restart(s) of 1)" in \
            outcome["root_cause"]
        assert "Gloo" not in outcome["root_cause"] and "connectFullMesh" not in outcome["root_cause"]
        assert [r["exit_code"] for r in outcome["restarts"]] == [3]
    assert len(result.outcomes) == 2 and "g2.r0" not in result.records

    result = results["lost"]  # never restarted: 137 on the host that is left, no restart anywhere
    assert result.exits["algo-1"] == codes.HOST_LOST_CODE, lost.sim.stderr[-4000:]
    assert result.outcomes["algo-1"]["class"] == codes.HOST_LOST and result.outcomes["algo-1"]["restarts"] == []
    assert not any(k.startswith("g1") for k in result.records)
    assert not any(restart_lines(result, host) for host in result.logs)

    result = results["stop"]  # SIGTERM while generation 1 starts: the job stops, nothing restarts again
    assert 0 not in result.exits.values(), stop.sim.stderr[-4000:]
    assert result.outcomes["algo-1"]["class"] == codes.STOPPED
    assert not any(k.startswith(("g1", "g2")) for k in result.records)  # generation 1 never formed its group
    assert not any("restart 2 of" in line for lines in result.logs.values() for line in lines)


def test_a_hang_is_restarted_once_and_the_job_finishes(side_by_side: dict[str, tuple[Job, Any]]) -> None:
    job, result = result_of(side_by_side, "hang")
    assert set(result.exits.values()) == {0}, job.sim.stderr[-4000:]
    for host, outcome in result.outcomes.items():
        [restart] = outcome["restarts"]
        assert restart["class"] == codes.HANG and restart["exit_code"] == codes.HANG_CODE, host
        assert outcome["recovered"] is True
        assert len(restart_lines(result, host)) == 1
    assert len(result.outcomes) == 2
    assert result.checkpoint == {"step": STEPS, "sum": uninterrupted_sum(2)}
    assert all(r["old_alive"] == [] for r in result.records.values())


def test_three_generations_on_four_hosts_leave_no_old_process(side_by_side: dict[str, tuple[Job, Any]]) -> None:
    job, result = result_of(side_by_side, "four")
    assert set(result.exits.values()) == {0}, job.sim.stderr[-4000:]
    assert sorted(result.records) == [f"g{g}.r{r}" for g in range(3) for r in range(4)]
    for host in result.summary["hosts"]:  # simulate's summary shows the generations
        assert [g["generation"] for g in host["generations"]] == [1, 2]
        assert host["outcome"].startswith("succeeded in generation 2 (2 job-wide restart(s), logged at ")
    # every rank of generations 1 and 2 found no process of the generation before alive (by its pid)
    assert all(r["old_alive"] == [] for r in result.records.values())
    assert len({r["pid"] for r in result.records.values()}) == 12
    for host, outcome in result.outcomes.items():
        assert [r["generation"] for r in outcome["restarts"]] == [1, 2], host
        said = [line.split("] restart ", 1)[1][:6] for line in restart_lines(result, host)]
        assert said == ["1 of 2", "2 of 2"], host
    assert len(result.outcomes) == 4
    assert result.checkpoint == {"step": STEPS, "sum": uninterrupted_sum(4)}


def test_the_first_failure_in_time_is_restarted_whatever_it_says_and_progress_is_what_the_sampler_sees(
        tmp_path: Any) -> None:
    # Side by side, 2 hosts of 1 rank each:
    # - "reset": at step 3, rank 1 raises a network-worded RuntimeError once (budget 5): its words are no evidence
    #   that another host failed first; it is the first failure in time, so it is restarted;
    # - "progress": rank 1 raises the same OSError at the same line in generations 0-2, each time 8 steps further
    #   than the generation before (it resumes from its checkpoint); the script sends no beat, so its progress is
    #   what the bootstrap's sampler sees (budget 3: restarted 3 times, then it finishes);
    # - "recurring": the same, in every generation (budget 2): restarted until the budget is spent, then it ends
    #   with its own class and code on both hosts, not 93.
    shape = ("--fail", "oserror", "--fail-step", "9", "--steps", "30", "--beats", "no", "--step-work", "0.2",
             "--step-sleep", "0.2")
    jobs = {"reset": launch(tmp_path, "reset", 2, "--fail", "raise", "--message",
                            "Connection reset by peer (while talking to 10.0.0.7:29500)", max_restarts="5"),
            "progress": launch(tmp_path, "progress", 2, *shape, "--fail-in", "0,1,2", max_restarts="3"),
            "recurring": launch(tmp_path, "recurring", 2, *shape, "--fail-in", "all", max_restarts="2")}
    results = {name: finish(job) for name, job in jobs.items()}

    for name, gens in (("reset", 2), ("progress", 4)):
        result = results[name]
        assert result.code == 0 and result.exits == {"algo-1": 0, "algo-2": 0}, jobs[name].sim.stderr[-4000:]
        assert sorted(result.records) == [f"g{g}.r{r}" for g in range(gens) for r in range(2)], name
        assert len(result.outcomes) == 2
        restarts = [outcome["restarts"] for outcome in result.outcomes.values()]
        for outcome in result.outcomes.values():
            assert outcome["class"] == codes.SUCCESS and outcome["recovered"] is True
            for record in outcome["restarts"]:  # both hosts name the same root cause: rank 1's, on algo-2
                assert record["class"] == codes.WORKER_EXIT and record["exit_code"] == 1, (name, record)
                assert record["root_cause_host"] == "algo-2" and "rank 1" in record["root_cause"], (name, record)
                assert set(record["phases"]) == {"detection", "stop", "barrier", "new_torchrun", "first_step"}
                assert record["phases"]["barrier"] is not None and record["phases"]["new_torchrun"] is not None
        assert [[(r["class"], r["exit_code"], r["root_cause_host"]) for r in rs] for rs in restarts[:1]] == \
            [[(r["class"], r["exit_code"], r["root_cause_host"]) for r in rs] for rs in restarts[1:]], name
        assert [len(rs) for rs in restarts] == [gens - 1] * 2, name
        for host in result.logs:
            said = restart_lines(result, host)
            assert len(said) == gens - 1 and all("phases: detection" in line for line in said), (name, said)
    assert results["reset"].checkpoint == {"step": STEPS, "sum": uninterrupted_sum(2)}
    assert results["progress"].checkpoint == {"step": 30, "sum": 30 * 3.0}
    # the reset's restart: every phase measured on the host where the failure was (it stepped after it)
    phases = results["reset"].outcomes["algo-2"]["restarts"][0]["phases"]
    assert all(value is not None and value >= 0 for value in phases.values()), phases

    result = results["recurring"]  # the budget spent after real progress: the fault's own class and code
    assert result.exits == {"algo-1": 1, "algo-2": 1}, jobs["recurring"].sim.stderr[-4000:]
    assert sorted(result.records) == [f"g{g}.r{r}" for g in range(3) for r in range(2)]
    assert len(result.outcomes) == 2
    for outcome in result.outcomes.values():
        assert outcome["class"] == codes.WORKER_EXIT and outcome["exit_code"] == 1, outcome
        assert outcome["root_cause_host"] == "algo-2" and "rank 1" in outcome["root_cause"], outcome
        assert outcome["exception"].startswith("OSError: [Errno 5] Input/output error"), outcome
        assert "(after 2 job-wide restart(s) of 2)" in outcome["root_cause"]
        assert len(outcome["restarts"]) == 2


def test_a_death_without_an_exit_record_comes_before_the_failures_it_causes(tmp_path: Any) -> None:
    # Side by side, 2 hosts of 1 rank, no --max-restarts: at step 3 rank 1 (algo-2) sleeps 1 s while rank 0 waits in
    # the collective, stops its torchrun (SIGSTOP: it never looks at its worker again), then ends in a way that writes
    # no exit record: SIGKILL, os._exit(3), SIGSEGV. Rank 0 fails on the closed connection at once and writes its
    # record; algo-1 ends its generation and node 0 stops algo-2's workers, whose torchrun is killed without a table.
    # Only the kernel's word on the death (launcher/deaths.py: when, how, which rank) dates it before the failure it
    # caused: both hosts name rank 1, with its own code.
    expected = {"kill": (137, "was killed by SIGKILL"), "os_exit": (3, "exited with code 3"),
                "segv": (139, "was killed by SIGSEGV")}
    jobs = {mode: launch(tmp_path, mode.replace("_", "-"), 2, "--fail", mode, "--fail-after", "1",
                         "--pause-torchrun", "yes") for mode in expected}
    for mode, job in jobs.items():
        result = finish(job)
        code, words = expected[mode]
        assert result.exits == {"algo-1": code, "algo-2": code}, (mode, job.sim.stderr[-4000:])
        assert len(result.outcomes) == 2
        for host, outcome in result.outcomes.items():
            assert outcome["exit_code"] == code and outcome["root_cause_host"] == "algo-2", (mode, host, outcome)
            assert f"rank 1 (local rank 0) {words}" in outcome["root_cause"], (mode, host, outcome)


def test_without_restarts_the_first_failure_in_time_is_every_hosts_root_cause_whatever_it_says(tmp_path: Any) -> None:
    # Side by side, no --max-restarts (node 0 still names the root cause for every host):
    # - "hosts": 2 hosts of 1 rank; at step 3 rank 1 (algo-2) raises a network-worded RuntimeError; rank 0 then
    #   fails in its collective with gloo's own lost-peer words;
    # - "ranks": 2 hosts of 2 ranks; rank 3 (algo-2's local rank 1) raises it; its host neighbour rank 2 and
    #   algo-1's ranks fail in their collectives after it;
    # - "abort": as "hosts", but rank 0 then aborts (SIGABRT, as NCCL's error handling ends a rank whose peer
    #   left): a death with no lost-peer words, after the first failure.
    # Both hosts agree: rank 1's (rank 3's) failure is the root cause, its class and code, whatever the words.
    message = "Connection reset by peer (while talking to 10.0.0.7:29500)"
    jobs = {"hosts": launch(tmp_path, "hosts", 2, "--fail", "raise", "--message", message),
            "ranks": launch(tmp_path, "ranks", 2, "--fail", "raise", "--message", message, "--fail-rank", "3",
                            sim_args=("--nproc-per-node", "2")),
            "abort": launch(tmp_path, "abort", 2, "--fail", "raise", "--message", message, "--peer-lost", "abort")}
    for name, job in jobs.items():
        result = finish(job)
        rank = "rank 3 (local rank 1)" if name == "ranks" else "rank 1 (local rank 0)"
        assert result.exits == {"algo-1": 1, "algo-2": 1}, (name, job.sim.stderr[-4000:])
        assert len(result.outcomes) == 2
        for host, outcome in result.outcomes.items():
            assert outcome["class"] == codes.WORKER_EXIT and outcome["exit_code"] == 1, (name, host, outcome)
            assert outcome["root_cause_host"] == "algo-2", (name, host, outcome)
            assert f"{rank} exited with code 1" in outcome["root_cause"], (name, host, outcome)
            assert outcome["exception"] == f"RuntimeError: {message}", (name, host, outcome)
            assert outcome["restarts"] == [], (name, host)


def held(workdir: str, host: str) -> dict[str, list[int]]:
    """The processes of ``host``'s generation started ahead and held (their environment names the hold's go file):
    ``torchrun`` and its ``workers`` (those that have imported torch: its library mapped)."""
    found: dict[str, list[int]] = {"torchrun": [], "workers": []}
    code = f"{workdir}/{host}/".encode()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            with open(f"/proc/{name}/maps", "rb") as fh:
                imported = b"libtorch_cpu.so" in fh.read()
        except (OSError, ValueError):
            continue
        if any(v.startswith(f"{ahead.HOLD_VARIABLE}=".encode()) for v in environ) and any(code in a for a in argv):
            if b"torch.distributed.run" in argv:
                found["torchrun"].append(int(name))
            elif imported:
                found["workers"].append(int(name))
    return found


def until_held(job: Job, timeout: float = 240.0) -> dict[str, dict[str, list[int]]]:
    """Each host's held generation, once every host's worker has imported torch while generation 0 trains."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {f"algo-{i}": held(job.workdir, f"algo-{i}") for i in range(1, job.hosts + 1)}
        if all(len(f["torchrun"]) == 1 and len(f["workers"]) == 1 for f in found.values()):
            return found
        assert job.sim.proc.poll() is None, job.sim.stderr[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"no held generation on every host within {timeout} s")


def test_the_next_generation_is_held_while_the_job_trains_and_one_that_died_is_started_afresh(tmp_path: Any) -> None:
    # Side by side, 2 hosts of 1 rank, budget 1: rank 1 fails at step 5 of generation 0 once the test opens its gate
    # (until then the others wait in the collective). SageMaker on namespaced hosts: each generation its own port,
    # so the next generation starts ahead at the first step, while the job trains.
    # - "held": the gate opens once every host's held worker has imported torch: generation 1 is that one;
    # - "died": algo-2's held worker is SIGKILLed first (as the OOM killer would) and its torchrun ends: node 0
    #   decides that every host starts generation 1 afresh (algo-1's held one had met algo-2's), and the job finishes.
    gates = {name: str(tmp_path / f"{name}.gate") for name in ("held", "died")}
    jobs = {name: launch(tmp_path, name, 2, "--steps", "8", "--fail", "exit", "--fail-step", "5",
                         "--fail-when", gate, max_restarts="1") for name, gate in gates.items()}
    ahead_pids = {name: until_held(job) for name, job in jobs.items()}
    dead = ahead_pids["died"]["algo-2"]
    os.kill(dead["workers"][0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while is_alive(dead["torchrun"][0]):  # torchrun (no restarts of its own) ends with its worker
        assert time.monotonic() < deadline, "the held torchrun outlived its worker"
        time.sleep(0.1)
    for gate in gates.values():
        open(gate, "w").close()
    results = {name: finish(job) for name, job in jobs.items()}
    for name, result in results.items():
        assert result.code == 0 and result.exits == {"algo-1": 0, "algo-2": 0}, jobs[name].sim.stderr[-4000:]
        assert result.checkpoint == {"step": 8, "sum": 8 * 3}, name  # every step once: ranks 0 and 1 add 1 + 2
        assert sorted(result.records) == ["g0.r0", "g0.r1", "g1.r0", "g1.r1"], name
    for host, lines in results["held"].logs.items():  # started at the first step; generation 1 is that torchrun
        pid = ahead_pids["held"][host]["torchrun"][0]
        assert any(f"the next generation started ahead at this one's first step (torchrun pid {pid})" in line
                   for line in lines), lines
        assert any(f"torchrun started as pid {pid} (started ahead" in line for line in lines), lines
        assert not any("afresh" in line for line in lines), lines
    for lines in results["died"].logs.values():  # every host started afresh: none used its held generation
        assert any("a generation started ahead had ended on a host: every host starts the next one afresh" in line
                   for line in lines), lines
        started = [line for line in lines if "torchrun started as pid" in line]
        assert len(started) == 2 and not any("(started ahead" in line for line in started), lines
    for found in ahead_pids.values():  # nothing of either held generation is left
        assert_gone([pid for host in found.values() for pids in host.values() for pid in pids])
