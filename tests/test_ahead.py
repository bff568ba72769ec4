"""The next generation started ahead (launcher/ahead.py): real torchrun processes, one host.

- held, its worker has imported torch and runs nothing of the script until the go;
- told to go, it is the generation a fresh torchrun starts: the same worker started with the same arguments,
  environment (but what torchrun makes anew each time: its run id, its port), ``__main__``, signal masks and exit
  code, the script's ``sys.path[0]``, torch's random state (a fresh seed per process; the same draws once seeded
  as a resume seeds them); only torch is imported already;
- cancelled (no restart after all), torchrun and its worker are gone, whether they were starting or held;
- it is never started when turned off (``DDP_LAUNCHER_AHEAD=0``) or when the launch starts the script directly;
- the launcher's holder of it (``Next``): armed, it starts at the current generation's first step, once, and is
  handed over when its generation comes; with ``DDP_LAUNCHER_AHEAD=end`` only at the generation's end; never when
  no restart can follow or it is off; for another launch it is cancelled; one that ended meanwhile (a held
  worker killed) is reported gone and the generation starts afresh.

Every process started here is ended by PID and proved gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from conftest import PYTHON, assert_gone, launcher_env

from launcher import ahead, proctree
from launcher.command import BOOTSTRAP, Launch
from launcher.supervise import FORWARD_ONLY

WORKER = textwrap.dedent("""
    import json, os, sys
    before = "torch" in sys.modules
    import torch  # as a training script's first lines do (threads of its own: glibc then catches signal 33)
    with open("/proc/self/status") as fh:
        masks = {k: v.strip() for k, _, v in (l.partition(":") for l in fh) if k in ("SigBlk", "SigIgn", "SigCgt")}
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
        parent = fh.read().split(b"\\0")
    facts = {"argv": sys.argv, "env": dict(os.environ), "masks": masks, "main": sys.modules["__main__"].__file__,
             "parent_main": parent[1:3] == [b"-m", b"torch.distributed.run"], "path0": sys.path[0],
             "torch": before, "seed": torch.initial_seed(),
             "seeded": (torch.manual_seed(1234), torch.rand(3).tolist())[1]}
    with open(os.path.join(sys.argv[1], f"{os.environ['DDP_TEST_HOW']}.json"), "w") as fh:
        json.dump(facts, fh)
    sys.exit(int(sys.argv[2]))
""")
ONCE_PER_RUN = ("TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "DDP_TEST_HOW")


def make_launch(tmp_path: Any, code: int) -> Launch:
    """A one-worker torchrun launch (``--standalone``) of the worker above through the launcher's bootstrap, which
    exits ``code``."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    argv = (PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
            "--monitor-interval", "0.1", "--", BOOTSTRAP, str(script), str(tmp_path), str(code))
    return Launch(argv, {"PYTHONUNBUFFERED": "1"}, ("DDP_TEST_GONE",), str(run_dir), str(run_dir / "error.json"),
                  str(run_dir / "logs"))


def run_fresh(launch: Launch, environ: dict[str, str]) -> int:
    """torchrun for ``launch`` as :func:`launcher.supervise.supervise` starts it (the signals it only forwards
    ignored); its exit code."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in FORWARD_ONLY}
    try:
        proc = subprocess.Popen(launch.argv, env=launch.environment(environ), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        return proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert_gone([proc.pid])


@pytest.mark.job
def test_told_to_go_it_is_torchrun_as_python_dash_m_starts_it(tmp_path: Any) -> None:
    environ = {**launcher_env(), "DDP_TEST_GONE": "1"}
    launch = make_launch(tmp_path, 7)
    assert run_fresh(launch, {**environ, "DDP_TEST_HOW": "fresh"}) == 1  # torchrun: a worker failed
    ready = ahead.start(launch, {**environ, "DDP_TEST_HOW": "ahead"})
    assert ready is not None and ready.launch == launch
    try:
        proc = ready.go()
        proc.communicate(timeout=300)
        assert proc.returncode == 1
    finally:
        ready.cancel()
        assert_gone([ready.proc.pid])
    fresh, started = (json.loads((tmp_path / f"{how}.json").read_text()) for how in ("fresh", "ahead"))
    assert started["argv"] == fresh["argv"] and started["main"] == fresh["main"] == str(tmp_path / "worker.py")
    assert started["masks"] == fresh["masks"] and started["parent_main"] and fresh["parent_main"]
    assert started["path0"] == fresh["path0"] == str(tmp_path)
    assert started["torch"] and not fresh["torch"]  # the one difference: torch was imported while it was held
    # torch's random state: a fresh one per process unseeded (not one shared with whatever imported torch before),
    # and after a seed, as a resume sets it, the same draws
    assert started["seed"] != fresh["seed"] and started["seeded"] == fresh["seeded"]
    assert set(started["env"]) == set(fresh["env"]) and "DDP_TEST_GONE" not in started["env"]
    differ = {k for k in fresh["env"] if fresh["env"][k] != started["env"][k]}
    assert differ <= set(ONCE_PER_RUN), differ
    assert started["env"]["PYTHONUNBUFFERED"] == "1" and started["env"]["LOCAL_RANK"] == "0"


def held_worker(ready: ahead.Ahead, timeout: float = 120.0) -> int:
    """The pid of the held generation's worker, once it has imported torch (its threads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in proctree.children_of(ready.proc.pid):  # torchrun's other children come and go
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    worker = BOOTSTRAP.encode() in fh.read().split(b"\0")
                if worker and len(os.listdir(f"/proc/{pid}/task")) > 1:
                    return pid
            except OSError:
                continue
        assert ready.proc.poll() is None, "torchrun ended while held"
        time.sleep(0.1)
    raise AssertionError("no held worker with torch imported in time")


@pytest.mark.job
def test_held_it_runs_nothing_of_the_script_until_the_go(tmp_path: Any) -> None:
    ready = ahead.start(make_launch(tmp_path, 0), {**launcher_env(), "DDP_TEST_HOW": "held"})
    assert ready is not None
    try:
        worker = held_worker(ready)
        time.sleep(1.0)
        assert not (tmp_path / "held.json").exists() and ready.proc.poll() is None
        assert worker in proctree.children_of(ready.proc.pid)
        proc = ready.go()
        proc.communicate(timeout=300)
        assert proc.returncode == 0 and json.loads((tmp_path / "held.json").read_text())["torch"]
    finally:
        ready.cancel()
    assert_gone([ready.proc.pid, worker])


@pytest.mark.job
@pytest.mark.parametrize("wait", [0.0, 1.0])
def test_cancelled_it_is_gone_while_starting_or_held(tmp_path: Any, wait: float) -> None:
    ready = ahead.start(make_launch(tmp_path, 0), launcher_env())
    assert ready is not None
    pid, workers = ready.proc.pid, []
    try:
        if wait:
            workers = [held_worker(ready)]
            time.sleep(wait)
        assert ready.proc.poll() is None
    finally:
        ready.cancel()
    assert ready.proc.returncode is not None and ready.proc.stdout is not None and ready.proc.stdout.closed
    assert_gone([pid, *workers])
    assert not (tmp_path / "fresh.json").exists() and not (tmp_path / "ahead.json").exists()


def test_never_started_when_turned_off_or_without_torchrun(tmp_path: Any) -> None:
    launch = make_launch(tmp_path, 0)
    assert ahead.start(launch, {**launcher_env(), ahead.VARIABLE: "0"}) is None
    direct = launch._replace(argv=(sys.executable, str(tmp_path / "worker.py")))
    assert ahead.start(direct, launcher_env()) is None


def reap(ready: ahead.Ahead) -> None:
    """End what a test started ahead, whatever state it is in, and prove it gone with its workers."""
    pids = [ready.proc.pid, *proctree.descendants([ready.proc.pid])]
    ready.cancel()
    assert_gone(pids)


@pytest.mark.job
def test_armed_it_starts_at_the_first_step_once_and_is_handed_over(tmp_path: Any) -> None:
    launch, lines, stepped = make_launch(tmp_path, 0), [], []
    following = ahead.Next({**launcher_env(), "DDP_TEST_HOW": "next"}, lines.append)
    following.arm(launch, lambda: bool(stepped))
    following.look()
    assert following.pids() == () and following.ahead is None  # no step yet: nothing started
    stepped.append(True)
    following.look()
    ready = following.ahead
    assert ready is not None and following.pids() == (ready.proc.pid,)
    try:
        assert lines == [f"the next generation started ahead at this one's first step (torchrun pid {ready.proc.pid}):"
                         " held before its script until a restart"]
        following.look()
        following.now()  # the generation's end: it runs already
        assert following.ahead is ready and len(lines) == 1
        worker = held_worker(ready)
        assert not following.gone()
        proc = following.take(launch)
        assert proc is ready.proc and following.pids() == () and following.ahead is None
        proc.communicate(timeout=300)
        assert proc.returncode == 0 and json.loads((tmp_path / "next.json").read_text())["torch"]
    finally:
        reap(ready)
    assert_gone([worker])


@pytest.mark.job
def test_when_it_ended_meanwhile_the_generation_starts_afresh(tmp_path: Any) -> None:
    # a held process killed meanwhile (the kernel's OOM killer, someone's kill): node 0 hears of it (gone) and the
    # generation is started afresh, never with what is left of the one started ahead
    launch, lines = make_launch(tmp_path, 0), []
    following = ahead.Next(launcher_env(), lines.append)
    following.arm(launch, None)
    following.now()
    ready = following.ahead
    assert ready is not None
    try:
        worker = held_worker(ready)
        os.kill(worker, signal.SIGKILL)
        ready.proc.wait(timeout=120)  # torchrun (no restarts of its own) ends with its worker
        assert following.gone()
        assert following.take(launch) is None and following.ahead is None and not following.gone()
        assert lines == [f"the generation started ahead here had ended (its torchrun exited with code "
                         f"{ready.proc.returncode}): it starts afresh"] and ready.proc.returncode != 0
        assert ready.proc.stdout is not None and ready.proc.stdout.closed
    finally:
        reap(ready)


@pytest.mark.job
def test_at_the_end_only_and_for_another_launch_it_is_cancelled(tmp_path: Any) -> None:
    launch = make_launch(tmp_path, 0)
    following = ahead.Next({**launcher_env(), ahead.VARIABLE: "end"})
    following.arm(launch, lambda: True)
    following.look()  # due, but started only at the generation's end
    assert following.ahead is None
    following.now()
    ready = following.ahead
    assert ready is not None
    try:
        other = launch._replace(env_changes={**launch.env_changes, "DDP_TEST_OTHER": "1"})
        assert following.take(other) is None and following.ahead is None  # not the generation that comes
        assert ready.proc.returncode is not None
    finally:
        reap(ready)


def test_nothing_is_started_when_no_restart_can_follow_or_it_is_off(tmp_path: Any) -> None:
    launch = make_launch(tmp_path, 0)
    following = ahead.Next(launcher_env())
    following.arm(None, lambda: True)  # the budget is used up
    following.look()
    following.now()
    assert following.ahead is None and following.pids() == () and following.take(launch) is None
    off = ahead.Next({**launcher_env(), ahead.VARIABLE: "0"})
    off.arm(launch, lambda: True)
    off.look()
    off.now()
    assert off.ahead is None and off.take(launch) is None


CHILD = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); " \
        "time.sleep(300)"
TWO_TREES = ("import subprocess, sys, time\n"  # two children, each with a child of its own
             f"kids = [subprocess.Popen([sys.executable, '-c', {CHILD!r}]) for _ in range(2)]\n"
             "print(*(kid.pid for kid in kids), flush=True)\n"
             "time.sleep(300)\n")


def test_ending_a_generation_spares_what_runs_beside_it_with_its_descendants() -> None:
    # supervise ends whatever a generation left (kill_tree of the launcher's tree) but what it is told to spare:
    # the next generation started ahead, whose workers are that torchrun's descendants
    parent = subprocess.Popen([PYTHON, "-c", TWO_TREES], stdout=subprocess.PIPE, start_new_session=True)
    everything: list[int] = [parent.pid]
    try:
        assert parent.stdout is not None
        first, second = (int(word) for word in parent.stdout.readline().split())
        deadline = time.monotonic() + 60
        while not (proctree.children_of(first) and proctree.children_of(second)):
            assert time.monotonic() < deadline, "the grandchildren did not start"
            time.sleep(0.05)
        (first_child,), (second_child,) = proctree.children_of(first), proctree.children_of(second)
        everything += [first, second, first_child, second_child]
        assert proctree.kill_tree([parent.pid], include_roots=False, exclude=[second]) == 2
        assert_gone([first, first_child])
        assert proctree.state(second) not in (None, "Z") and proctree.state(second_child) not in (None, "Z")
        assert parent.poll() is None
    finally:
        proctree.kill_tree([parent.pid])
        parent.wait()
        assert parent.stdout is not None
        parent.stdout.close()
    assert_gone(everything)
