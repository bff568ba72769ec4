"""The launcher's own waits and looks cost little: the end of a job waits on events, not on polls, and
a process's children are read from its own /proc files, not from the whole process table.

Each is proven by an event, never by a time: the hang watch's thread ends on close although its
select would wait an hour; ``proctree.wait_exit`` gives the code of a process that exited, None for one
that runs, and the same without pidfds; ``children_of`` agrees with the process table (children
started by any thread, zombies). What these save per job is measured in ``bench/bench_start.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

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


def from_the_table(pid, zombies):
    return sorted(c for c, (parent, state) in proctree._process_table().items()
                  if parent == pid and (zombies or state != b"Z"))


def test_children_are_read_from_the_parents_own_files_and_agree_with_the_table(monkeypatch):
    sleeper = [sys.executable, "-c", "import time; time.sleep(3600)"]
    children = [subprocess.Popen(sleeper)]
    started = threading.Thread(target=lambda: children.append(subprocess.Popen(sleeper)))  # another thread's child
    started.start()
    started.join()
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while proctree.state(exited.pid) != "Z":  # exited, not reaped: a zombie
            proctree.wait_exit(children[0], 0.01)
        me = os.getpid()
        assert sorted(proctree.children_of(me)) == from_the_table(me, False)
        assert {p.pid for p in children} <= set(proctree.children_of(me)) and exited.pid not in proctree.children_of(me)
        assert sorted(proctree.children_of(me, zombies=True)) == from_the_table(me, True)
        assert exited.pid in proctree.children_of(me, zombies=True)
        monkeypatch.setattr(proctree, "_listed_children", lambda _pid: None)  # a kernel without the files
        assert sorted(proctree.children_of(me, zombies=True)) == from_the_table(me, True)
        monkeypatch.undo()
        assert proctree.children_of(exited.pid) == []  # a zombie has no threads and no children
    finally:
        for proc in children:
            proc.kill()
        for proc in (*children, exited):
            proc.wait()
    assert_gone([p.pid for p in children])
    assert proctree.children_of(children[0].pid) == []  # gone


def test_the_tree_walked_down_the_children_files_is_the_tree_of_the_table(monkeypatch):
    # a child with a grandchild, a zombie child: the walk finds what the whole table says, with states
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
                               "print('ready', flush=True); time.sleep(3600)"], stdout=subprocess.PIPE)
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert parent.stdout.readline() == b"ready\n"  # type: ignore[union-attr]
        while proctree.state(exited.pid) != "Z":
            proctree.wait_exit(parent, 0.01)
        me, table = os.getpid(), proctree._process_table()
        below = {pid: table[pid] for pid in proctree.descendants([me], {p: v[0] for p, v in table.items()})}
        below.update({pid: entry for pid, entry in table.items() if entry[0] == me})  # zombies too
        walked = proctree._tree_table(me)
        # the same processes with the same parents; a living process's state letter may change between the two
        # reads (the child can be between two sleeps), a zombie's cannot
        assert {pid: up for pid, (up, _) in walked.items()} == {pid: up for pid, (up, _) in below.items()}
        assert walked[exited.pid] == below[exited.pid] == (me, b"Z") and len(walked) >= 3
        grandchildren = [pid for pid, (up, _state) in walked.items() if up == parent.pid]
        assert len(grandchildren) == 1
        # what kill_tree looks at: these trees' living processes and their parents, as the whole table has them
        living = {pid: up for pid, (up, state) in below.items() if state != b"Z"}
        assert proctree._living_parents([me]) == {me: os.getppid(), **living}
        assert proctree._living_parents([parent.pid]) == {parent.pid: me, grandchildren[0]: parent.pid}
        assert proctree._living_parents([exited.pid]) == {}  # a zombie is not living
        monkeypatch.setattr(proctree, "_has_children_files", lambda: False)  # a kernel without the files
        assert proctree.descendants([parent.pid], proctree._living_parents([parent.pid])) == grandchildren
        monkeypatch.undo()
        assert proctree.reap_orphans([parent.pid]) == 1 and proctree.state(exited.pid) is None  # the zombie reaped
    finally:
        pids = proctree.descendants([parent.pid])
        proctree.kill_tree([parent.pid])
        parent.wait()
        exited.poll()
    assert_gone([parent.pid, *pids])
