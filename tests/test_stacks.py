"""Taking a host's stacks (launcher/stacks.py) from real Python processes: no torch, no torchrun.

Each "worker" is a plain Python process run as torchrun runs one: ``PYTHONFAULTHANDLER=1``, ``RANK`` in
its environment, stderr a regular file that already holds output. The test freezes them (SIGSTOP), as the
hang watch does, and :func:`launcher.stacks.take` must:

- read every dump from the worker's own file (not from before its offset), at the line where it blocks:
  in a C call, a Python loop, or while its helper thread runs;
- name a worker that ignores SIGABRT and one whose Python handler takes it (no dump will come), without
  waiting for the bound;
- hold the stand-in for torchrun stopped while the workers dump, and continue it afterwards;
- do all that on a host that busy loops keep at several times its cores (their PIDs started here, ended
  here): the dumps come in, each within the bound.

Every process started here is ended by PID and proved gone.
"""

from __future__ import annotations

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
    open(sys.argv[2], "w").close()
    spin() if mode == "spin" else blocked()
""")
LINES = {mark: next(i for i, line in enumerate(WORKER.splitlines(), 1) if line.endswith(f"# at:{mark}"))
         for mark in ("read", "spin")}
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


def test_stacks_come_in_under_heavy_cpu_load(tmp_path: Any) -> None:
    busy = 4 * (os.cpu_count() or 1)  # four busy loops per core, started once the workers are ready
    taken, _procs, _ = take_from(tmp_path, {0: "read", 1: "spin", 2: "read", 3: "spin"}, busy)
    assert sorted(taken.dumps) == [0, 1, 2, 3] and taken.why == {}
    assert {r: hang.position(t).line for r, t in taken.dumps.items()} == {  # type: ignore[union-attr]
        0: LINES["read"], 1: LINES["spin"], 2: LINES["read"], 3: LINES["spin"]}


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
