"""The end of a job waits on events, not on polls: torchrun's exit (a pidfd) and the hang watch's close.

Each is proven by an event, never by a time: the hang watch's thread ends on close although its
select would wait an hour; ``proctree.wait_exit`` gives the code of a process that exited, None for one
that runs, and the same without pidfds. What these save per job is measured in ``bench/bench_start.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import assert_gone

from launcher import hangwatch, proctree
from launcher.progress import BeatSocket, Progress


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "no-pidfd"])
def test_wait_exit_gives_the_code_of_an_exit_and_none_while_it_runs(monkeypatch, pidfd):
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    elif not hasattr(os, "pidfd_open"):
        pytest.skip("no os.pidfd_open here (Python < 3.9 or not Linux)")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(7)"], stdin=subprocess.PIPE)
    try:
        assert proctree.wait_exit(proc, 0.05) is None  # it waits for its stdin: still running
        proc.stdin.close()  # type: ignore[union-attr]
        code = None
        while code is None:  # each call bounded; the exit ends the wait
            code = proctree.wait_exit(proc, 60)
        assert code == 7 and proctree.wait_exit(proc, 60) == 7  # reaped once, then known
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_gone([proc.pid])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    os.kill(killed.pid, signal.SIGKILL)
    while (code := proctree.wait_exit(killed, 60)) is None:
        pass
    assert code == -signal.SIGKILL


def test_the_hang_watch_ends_on_close_not_at_its_next_turn(tmp_path, monkeypatch):
    monkeypatch.setattr(hangwatch, "TURN", 3600.0)  # its select would wait an hour for a beat
    beats = BeatSocket(str(tmp_path))
    watch = hangwatch.HangWatch(1800, Progress(), beats, {0: "algo-1"}, lambda _line: None)
    watch.attach(lambda _grace, _why: None, os.getpid())
    assert watch.thread.is_alive()
    monkeypatch.setattr(hangwatch, "FREEZE_WAIT", 0.0)  # close's join: at most 2 * STACK_WAIT + 5 s
    watch.close()
    assert not watch.thread.is_alive(), "close returned with the thread still waiting in select"
    assert not os.path.exists(beats.path)
    watch.close()  # twice (the launcher closes it again in its finally): nothing to wake, no error


def test_without_a_beat_socket_the_thread_ends_on_close_too(monkeypatch):
    monkeypatch.setattr(hangwatch, "TURN", 3600.0)
    monkeypatch.setattr(hangwatch, "FREEZE_WAIT", 0.0)
    watch = hangwatch.HangWatch(1800, Progress(), None, {0: "algo-1"}, lambda _line: None)
    watch.attach(lambda _grace, _why: None, os.getpid())
    watch.close()
    assert not watch.thread.is_alive()
