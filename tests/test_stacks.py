"""Taking a host's stacks (launcher/stacks.py) from real Python processes: no torch, no torchrun.

Each "worker" is a plain Python process run as torchrun runs one: ``PYTHONFAULTHANDLER=1``, ``RANK`` in
its environment, stderr a regular file that already holds output. The test freezes them (SIGSTOP), as the
hang watch does, and :func:`launcher.stacks.take` must:

- read every dump from the worker's own file (not from before its offset), at the line where it blocks:
  in a C call, a Python loop, or while its helper thread runs;
- name a worker that ignores SIGABRT and one whose Python handler takes it (no dump will come), without
  waiting for the bound;
- hold the stand-in for torchrun stopped while the workers dump, and continue it afterwards; with a
  stand-in that does what torchrun's monitor does (once one worker ended, SIGTERM to the others: a worker
  with SIGABRT still pending then dies of SIGTERM without a dump), every dump still comes in;
- do that on a host that busy loops keep at four per core (their PIDs started here, ended here): the
  dumps come in, each within the bound.

Every process started here is ended by PID and proved gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap
import time
from typing import Any

from conftest import PYTHON, assert_gone

from launcher import hang, proctree, stacks

WORKER = textwrap.dedent("""
    import os, signal, sys, threading, time
    mode = sys.argv[1]
    print('Thread 0x1 (most recent call first):\\n  File "/old.py", line 1 in old', file=sys.stderr, flush=True)
    def helper():
        while True:
            time.sleep(0.01)
    threading.Thread(target=helper, daemon=True).start()
    if mode == "ignore":
        signal.signal(signal.SIGABRT, signal.SIG_IGN)
    elif mode == "catch":
        signal.signal(signal.SIGABRT, lambda *_: None)
    def blocked():
        os.read(os.pipe()[0], 1)  # at:read
    def spin():
        count = 0
        while count >= 0: count += 1  # at:spin
    def kid():
        os.read(os.pipe()[0], 1)  # at:kid
    if mode == "child":  # a child that writes to the same stderr file (a DataLoader's worker)
        pid = os.fork()
        if pid == 0:
            kid()
        with open(sys.argv[2] + ".kid", "w") as fh:
            fh.write(str(pid))
    open(sys.argv[2], "w").close()
    spin() if mode == "spin" else blocked()
""")
LINES = {mark: next(i for i, line in enumerate(WORKER.splitlines(), 1) if line.endswith(f"# at:{mark}"))
         for mark in ("read", "spin", "kid")}
BOUND = 60.0  # stacks.take's bound here: generous, as the hang watch's (a loaded host); the test ends far sooner


def start_workers(tmp_path: Any, modes: dict[int, str]) -> dict[int, subprocess.Popen]:
    """The workers, each its stderr a file; returned once each is past its set-up (it signals by a file)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = {}
    for rank, mode in modes.items():
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "RANK": str(rank)}
        with open(tmp_path / f"stderr{rank}.log", "wb") as fh:
            procs[rank] = subprocess.Popen([PYTHON, str(script), mode, str(tmp_path / f"ready{rank}")], stderr=fh,
                                           stdout=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 120
    try:
        for rank, proc in procs.items():
            while not (tmp_path / f"ready{rank}").exists():
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"stderr{rank}.log").read_text()
                time.sleep(0.05)
    except BaseException:
        end(list(procs.values()))
        raise
    return procs


def end(procs: list[subprocess.Popen]) -> None:
    """Kill what is left by PID; prove every one gone."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert_gone([p.pid for p in procs])


def take_from(tmp_path: Any, modes: dict[int, str], busy: int = 0) -> tuple[stacks.Taken, dict[int, subprocess.Popen],
                                                                             str]:
    """Start the workers and a stand-in for torchrun (and ``busy`` busy loops once they are ready), freeze
    the workers, take their stacks."""
    procs: dict[int, subprocess.Popen] = {}
    loops: list[subprocess.Popen] = []
    parent = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(600)"])
    try:
        procs = start_workers(tmp_path, modes)
        loops = [subprocess.Popen([PYTHON, "-c", "while True: pass"]) for _ in range(busy)]
        pids = [p.pid for p in procs.values()]
        stacks.signal_workers(pids, signal.SIGSTOP)
        taken = stacks.take(pids, parent.pid, BOUND)
        after = proctree.state(parent.pid)
    finally:
        end([*loops, *procs.values(), parent])
    return taken, procs, str(after)


def test_each_dump_is_read_from_its_own_file_and_silent_workers_are_named(tmp_path: Any) -> None:
    started = time.monotonic()
    taken, procs, parent_state = take_from(tmp_path, {0: "read", 1: "spin", 2: "ignore", 3: "catch", 5: "read"})
    took = time.monotonic() - started
    assert parent_state in ("S", "R"), parent_state  # torchrun's stand-in was continued
    assert sorted(taken.dumps) == [0, 1, 5] and taken.unread == []
    for rank, mode in ((0, "read"), (1, "spin"), (5, "read")):
        assert len(taken.dumps[rank]) == 2  # the main thread and the helper
        pos = hang.position(taken.dumps[rank])
        assert pos is not None and pos.line == LINES[mode], (rank, taken.dumps[rank])
    assert taken.why == {2: stacks.IGNORED, 3: stacks.CAUGHT}
    assert procs[0].returncode == -signal.SIGABRT and procs[2].returncode == -signal.SIGKILL  # 2 lived on
    assert took < BOUND  # the silent ones were recognised, not waited out


def test_a_workers_child_dumps_into_the_same_file_first_and_both_are_read(tmp_path: Any) -> None:
    kid = 0
    try:
        taken, procs, _ = take_from(tmp_path, {0: "read", 1: "child"})
        kid = int((tmp_path / "ready1.kid").read_text())
        assert sorted(taken.dumps) == [0, 1] and taken.why == {}
        for rank in (0, 1):
            pos = hang.position(taken.dumps[rank])
            assert pos is not None and pos.line == LINES["read"], (rank, taken.dumps[rank])
        assert list(taken.children) == [1] and [pid for pid, _ in taken.children[1]] == [kid]
        pos = hang.position(taken.children[1][0][1])
        assert pos is not None and pos.line == LINES["kid"] and pos.func == "kid", taken.children
    finally:
        if kid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
            assert_gone([kid])


def test_a_worker_whose_stderr_is_no_file_is_left_to_the_output_pipe(tmp_path: Any) -> None:
    proc = subprocess.Popen([PYTHON, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "RANK": "4"})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"  # past exec: its own environment
        worker = stacks.describe(proc.pid)
        assert worker.rank == 4 and worker.path is None
        taken = stacks.take([proc.pid], None, 5.0)
        assert taken.unread == [proc.pid] and taken.dumps == {}
    finally:
        end([proc])


MONITOR = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    worker, tmp, modes = sys.argv[1], sys.argv[2], sys.argv[3:]
    procs = []
    for rank, mode in enumerate(modes):
        with open(os.path.join(tmp, f"stderr{rank}.log"), "wb") as fh:
            env = {**os.environ, "PYTHONFAULTHANDLER": "1", "RANK": str(rank)}
            procs.append(subprocess.Popen([sys.executable, worker, mode, os.path.join(tmp, f"ready{rank}")],
                                          stderr=fh, env=env))
    while all(p.poll() is None for p in procs):  # torchrun's monitor: every 0.1 s there, 5 ms here
        time.sleep(0.005)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait()
""")


def test_under_heavy_cpu_load_a_monitor_that_stops_the_other_workers_cannot_cost_a_stack(tmp_path: Any) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "monitor.py").write_text(MONITOR)
    modes = ["read", "spin", "read", "spin"]
    monitor = subprocess.Popen([PYTHON, str(tmp_path / "monitor.py"), str(tmp_path / "worker.py"), str(tmp_path),
                                *modes])
    workers: list[int] = []
    loops: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(len(modes))):
            assert monitor.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        workers = proctree.children_of(monitor.pid)
        assert len(workers) == len(modes)
        # four busy loops per core from now on, as the hang watch would meet them
        loops = [subprocess.Popen([PYTHON, "-c", "while True: pass"]) for _ in range(4 * (os.cpu_count() or 1))]
        stacks.signal_workers(workers, signal.SIGSTOP)
        taken = stacks.take(workers, monitor.pid, BOUND)
        assert monitor.wait(timeout=60) == 0  # it went on once the stacks were taken, and ended
    finally:
        end(loops)
        if monitor.poll() is None:
            proctree.kill_tree([monitor.pid])
        monitor.wait()
    assert_gone([monitor.pid, *workers])
    assert taken.why == {} and sorted(taken.dumps) == list(range(len(modes)))
    assert {r: hang.position(t).line for r, t in taken.dumps.items()} == {  # type: ignore[union-attr]
        r: LINES[mode] for r, mode in enumerate(modes)}
