"""simulate's transient faults, their deeds on their own (:mod:`launcher.simulate.faults`): stopped and
continued processes, a CPU quota of 0.1 % of a CPU in a cgroup made for the fault and removed after it,
busy loops pinned to CPUs and killed by PID; and a simulate killed in the middle of a starvation
leaves neither a process nor the cgroup behind. What a job does under these faults:
tests/test_jobwatch_faults.py.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import PYTHON, assert_gone, is_alive, launcher_env
from test_simulate import Simulate, processes_inside

from launcher import proctree
from launcher.simulate import faults, netns

NO_CGROUP = faults.starve_unavailable()
FORKING = "import os, time\nif os.fork() == 0:\n    time.sleep(300)\nelse:\n    time.sleep(300)\n"
BUSY = "import time\nwhile True:\n    pass\n"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        stat = fh.read()
    return stat[stat.rfind(b")") + 2:].split()[0].decode()


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


def test_stop_all_stops_a_whole_tree_and_continue_all_resumes_it() -> None:
    parent = subprocess.Popen([PYTHON, "-c", FORKING], start_new_session=True)
    try:
        wait_until(lambda: len(proctree.descendants([parent.pid])) == 1)
        tree = [parent.pid, *proctree.descendants([parent.pid])]
        stopped = faults.stop_all(lambda: [parent.pid, *proctree.descendants([parent.pid])])
        assert sorted(stopped) == sorted(tree)
        wait_until(lambda: all(state(p) == "T" for p in tree))
        assert faults.continue_all(stopped) == 2
        wait_until(lambda: all(state(p) == "S" for p in tree))
    finally:
        tree = [parent.pid, *proctree.descendants([parent.pid])]
        for pid in tree:
            os.kill(pid, signal.SIGKILL)  # our own processes, by PID
        parent.wait()
    assert_gone(tree)


def test_the_cpu_controller_is_found_in_cgroup_v1_and_v2_mounts(tmp_path: Any) -> None:
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    v1 = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct\n"
    v2 = f"41 31 0:38 /kubepods {unified} rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
    other = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n" \
            "33 31 0:30 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
    for lines, expected in ((other + v1, (1, "/sys/fs/cgroup/cpu,cpuacct", "/")),
                            (other + v2, (2, str(unified), "/kubepods")),
                            (v2 + v1, (1, "/sys/fs/cgroup/cpu,cpuacct", "/"))):  # v1 holds cpu: v2 has none
        (tmp_path / "mountinfo").write_text(lines)
        assert faults._cpu_mount(str(tmp_path / "mountinfo")) == expected
    (unified / "cgroup.controllers").write_text("memory pids\n")
    (tmp_path / "mountinfo").write_text(other + v2)
    with pytest.raises(faults.FaultError, match="no cgroup hierarchy with the cpu controller"):
        faults._cpu_mount(str(tmp_path / "mountinfo"))


@pytest.mark.skipif(NO_CGROUP is not None, reason=f"no CPU quota here: {NO_CGROUP}")
def test_cpu_quota_holds_a_busy_process_to_a_trickle_and_is_removed() -> None:
    busy = subprocess.Popen([PYTHON, "-c", BUSY], start_new_session=True)
    quota = faults.CpuQuota("test")
    try:
        assert os.path.isdir(quota.path) and os.path.dirname(quota.path) == quota.parent
        assert quota.add(lambda: [busy.pid]) == [busy.pid] and quota.members() == [busy.pid]
        time.sleep(0.5)  # the first period may still hold what was left of its quota
        before = cpu_seconds(busy.pid)
        time.sleep(3)
        starved = cpu_seconds(busy.pid) - before
        assert starved <= 0.1, starved  # 0.1 % of a CPU for 3 s is 3 ms; 0.1 s is a clock tick's margin
        assert quota.remove() == 1
        assert not os.path.exists(quota.path)
        with open(os.path.join(quota.parent, "cgroup.procs"), encoding="utf-8") as fh:
            assert str(busy.pid) in fh.read().split()
        before = cpu_seconds(busy.pid)
        time.sleep(1)
        freed = cpu_seconds(busy.pid) - before
        assert freed >= 0.02, freed  # any share of a loaded 2-core machine is far more than 1 ms
        print(f"\nbusy loop: {starved * 1000:.0f} ms of CPU in 3 s under the quota, {freed * 1000:.0f} ms in 1 s after")
    finally:
        if os.path.exists(quota.path):
            quota.remove()
        busy.kill()
        busy.wait()
    assert_gone([busy.pid])


def test_busy_loops_are_pinned_each_to_its_cpu_and_killed_by_pid() -> None:
    cpus = faults.host_cpus(os.getpid())
    loops = faults.start_busy_loops(cpus, launcher_env())
    try:
        assert len(loops) == len(cpus) * faults.BUSY_LOOPS_PER_CPU
        assert sorted(cpu for p in loops for cpu in os.sched_getaffinity(p.pid)) == sorted(cpus)
        assert all(is_alive(p.pid) for p in loops)
    finally:
        pids = faults.stop_busy_loops(loops)
    assert pids == [p.pid for p in loops]
    assert_gone(pids)


@pytest.mark.job
@pytest.mark.skipif(NO_CGROUP is not None or netns.unavailable() is not None,
                    reason=f"no CPU quota or namespaces here: {NO_CGROUP or netns.unavailable()}")
def test_simulate_killed_during_a_starvation_leaves_no_process_and_no_cgroup(tmp_path: Any) -> None:
    workdir = str(tmp_path / "job")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "ddp_allreduce.py")
    sim = Simulate(["--hosts", "2", "--nproc-per-node", "1", "--workdir", workdir, "--deadline", "120",
                    "--fault", "algo-2:starve:step=3:60", "--", script, "--steps", "0", "--step-sleep", "0.1"],
                   str(tmp_path), launcher_env(LAUNCHER_LOSS_TIMEOUT="120"))
    try:
        deadline = time.monotonic() + 90
        while not any("fault: starve of algo-2" in line for line in list(sim.err)):
            assert time.monotonic() < deadline and sim.proc.poll() is None, sim.stderr[-3000:]
            time.sleep(0.01)
        line = next(line for line in sim.err if "fault: starve of algo-2" in line)
        path = line.split("in the cgroup ")[1].split(",")[0]
        assert os.path.isdir(path)
        inside = processes_inside(workdir)
        keeper = [p for p in proctree.children_of(sim.proc.pid) if "\x00keep\x00" in _cmdline(p)]
        assert inside and len(keeper) == 1, (inside, keeper)
        os.kill(sim.proc.pid, signal.SIGKILL)  # simulate, our own child, dies without a word
        sim.proc.wait()
    finally:
        if sim.proc.poll() is None:
            sim.abort()
    assert_gone(inside + keeper, within=20)  # its watchdog killed every host's process, the keeper ended
    assert not os.path.exists(path)  # the keeper lifted the quota and removed the cgroup
    assert processes_inside(workdir) == []
    assert glob.glob(os.path.join(os.path.dirname(path), f"ddp-simulate-{sim.proc.pid}-*")) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
