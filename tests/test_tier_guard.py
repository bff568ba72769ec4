"""The tier guard (conftest.py) blames a test only for processes it started: its own tree, or its tag.

Real processes: a stand-in for the pytest process (``me``) with a tree below it, and processes beside it,
as another lab on the machine or an earlier test's leftovers would be. The guard's rule is applied to each.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from conftest import PYTHON, REPO, _started_by, assert_gone, left_running

TREE = os.path.join(REPO, "tests", "scripts", "process_tree.py")
SESSION = f"{os.getpid()}-{os.urandom(6).hex()}"  # a session of its own: the real guard's is not involved
TAG = f"{SESSION}:tests/test_x.py::test_now".encode()


def start(directory: Any, spec: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "DDP_LAUNCHER_TEST_TAG"}
    if spec.get("tag") is not None:
        env["DDP_LAUNCHER_TEST_TAG"] = spec["tag"]
    return subprocess.Popen([PYTHON, TREE, str(directory), json.dumps(spec)], env=env)


def names(spec: dict) -> list[str]:
    return [spec["name"]] + [n for child in spec.get("children", []) for n in names(child)]


@contextlib.contextmanager
def trees(directory: Any, specs: list[dict]) -> Iterator[dict[str, int]]:
    """Start a process tree per spec; yield every process's PID by name; then SIGKILL them all and prove them gone."""
    procs = [start(directory, spec) for spec in specs]
    everyone = {n for spec in specs for n in names(spec)}
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 120
        while not all((directory / name).exists() for name in everyone):
            assert time.monotonic() < deadline, sorted(everyone - set(os.listdir(directory)))
            time.sleep(0.05)
        pids = {name: int((directory / name).read_text()) for name in everyone}
        yield pids
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):  # a child whose parent died first is reaped by init
                os.kill(pid, signal.SIGKILL)
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
    assert_gone(pids.values())


def test_the_guard_attributes_a_process_to_the_test_that_started_it(tmp_path):
    earlier = f"{SESSION}:tests/test_x.py::test_before"  # an earlier test of this pytest process
    other_pytest = f"{os.getpid() + 1}-{os.urandom(6).hex()}:tests/test_x.py::test_now"  # same pid and test elsewhere
    me = {"name": "me", "tag": None, "children": [
        {"name": "no_tag", "tag": None, "children": [{"name": "no_tag_child", "tag": None}]},  # cleared env
        {"name": "left_by_earlier", "tag": earlier, "children": [{"name": "left_by_earlier_child", "tag": None}]},
        {"name": "nested_pytest", "tag": other_pytest, "children": [{"name": "nested_child", "tag": None}]},
        {"name": "detached_with_tag", "tag": TAG.decode(), "detach": True},
        {"name": "detached_no_tag", "tag": None, "detach": True}]}
    beside = [{"name": "other_lab", "tag": None, "children": [{"name": "other_lab_holder", "tag": None}]},
              {"name": "other_session", "tag": other_pytest},
              {"name": "beside_with_tag", "tag": TAG.decode()}]
    expected = {"me": True, "no_tag": True, "no_tag_child": True, "left_by_earlier": False,
                "left_by_earlier_child": False, "nested_pytest": True, "nested_child": True,
                "detached_with_tag": True, "detached_no_tag": False, "other_lab": False,
                "other_lab_holder": False, "other_session": False, "beside_with_tag": True}
    assert set(expected) == {n for spec in [me, *beside] for n in names(spec)}
    with trees(tmp_path, [me, *beside]) as pids:
        found = {name: _started_by(pid, TAG, me=pids["me"], session=SESSION) for name, pid in pids.items()}
        assert found == expected


def test_what_outlives_the_tests_is_every_process_of_the_run_and_nothing_else(tmp_path):
    # The session's last check (nothing_outlives_the_tests): below "me" or carrying any tag of its session.
    earlier = f"{SESSION}:tests/test_x.py::test_before"
    other_pytest = f"{os.getpid() + 1}-{os.urandom(6).hex()}:tests/test_x.py::test_now"
    me = {"name": "me", "tag": None, "children": [
        {"name": "no_tag", "tag": None, "children": [{"name": "no_tag_child", "tag": None}]},
        {"name": "nested_pytest", "tag": other_pytest, "children": [{"name": "nested_child", "tag": None}]},
        {"name": "detached_with_tag", "tag": earlier, "detach": True},
        {"name": "detached_no_tag", "tag": None, "detach": True}]}
    beside = [{"name": "other_lab", "tag": None, "children": [{"name": "other_lab_holder", "tag": None}]},
              {"name": "other_session", "tag": other_pytest},
              {"name": "beside_with_tag", "tag": TAG.decode()}]
    ours = {"no_tag", "no_tag_child", "nested_pytest", "nested_child", "detached_with_tag", "beside_with_tag"}
    with trees(tmp_path, [me, *beside]) as pids:
        left = set(left_running(me=pids["me"], session=SESSION))
        assert {n for n, pid in pids.items() if pid in left} == ours
        os.kill(pids["no_tag_child"], signal.SIGSTOP)  # stopped is still running; a zombie is not
        os.kill(pids["nested_child"], signal.SIGKILL)  # its parent does not reap it: a zombie
        deadline = time.monotonic() + 30
        while pids["nested_child"] in left_running(me=pids["me"], session=SESSION):
            assert time.monotonic() < deadline, "a zombie counted as running"
            time.sleep(0.05)
        assert pids["no_tag_child"] in left_running(me=pids["me"], session=SESSION)
