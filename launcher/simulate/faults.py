"""The deeds of simulate's transient faults, each undone by itself after its duration: stop and
continue processes (a paused launcher, a paused VM), a CPU quota of 0.1 % of one CPU on a host's
processes (a cgroup made for the fault and removed after it), busy loops pinned to a host's CPUs.

A host's link blip is :meth:`launcher.simulate.netns.Lab.partition` then :meth:`~launcher.simulate.netns.Lab.heal`.
Standard library only; the cgroup needs root (or a delegated, writable cgroup of the ``cpu`` controller).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Callable, Optional

# 0.1 % of one CPU: the kernel's smallest quota (1 ms) per its longest period (1 s)
QUOTA_US, PERIOD_US = 1000, 1_000_000
BUSY_LOOPS_PER_CPU = 1  # saturation: every CPU of the host 100 % busy with another process
BUSY_LOOP = "while True:\n    pass\n"
ROUNDS = 100  # look-ups of a host's processes until no new one appears (a fork in between)


class FaultError(RuntimeError):
    """A fault cannot be made here (no writable ``cpu`` cgroup, ...)."""


def send(pid: int, signum: int) -> bool:
    """Send ``signum`` to ``pid``; False if it is gone (or not ours)."""
    try:
        os.kill(pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_all(pids_of: Callable[[], Iterable[int]]) -> list[int]:
    """SIGSTOP every process ``pids_of()`` names, looking again until no new one appears (a process
    forked meanwhile). Returns the PIDs stopped."""
    stopped: list[int] = []
    for _ in range(ROUNDS):
        new = [p for p in pids_of() if p not in stopped and p != os.getpid()]
        if not new:
            break
        stopped += [p for p in new if send(p, signal.SIGSTOP)]
    return stopped


def continue_all(pids: Iterable[int]) -> int:
    """SIGCONT each process; returns how many still existed."""
    return sum(send(p, signal.SIGCONT) for p in pids)


# -- CPU starvation: a cgroup of the cpu controller with the smallest quota ---------------------------
def _cpu_mount(mountinfo: str = "/proc/self/mountinfo") -> tuple[int, str, str]:
    """The ``cpu`` controller's hierarchy: (cgroup version, mount point, the hierarchy path mounted there)."""
    found: Optional[tuple[int, str, str]] = None
    with open(mountinfo, encoding="utf-8") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, (fstype, _source, options) = left.split(), right.split()[:3]
            root, point = fields[3], fields[4]
            if fstype == "cgroup" and "cpu" in options.split(","):
                return 1, point, root
            if fstype == "cgroup2" and found is None:
                with contextlib.suppress(OSError), open(os.path.join(point, "cgroup.controllers")) as ctl:
                    if "cpu" in ctl.read().split():
                        found = (2, point, root)
    if found is None:
        raise FaultError("no cgroup hierarchy with the cpu controller is mounted")
    return found


def _own_cgroup(version: int, pid: int) -> str:
    """The path of ``pid``'s cgroup in the cpu controller's hierarchy (``/proc/PID/cgroup``)."""
    with open(f"/proc/{pid}/cgroup", encoding="utf-8") as fh:
        for line in fh:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            if (version == 2 and _id == "0") or (version == 1 and "cpu" in controllers.split(",")):
                return path
    raise FaultError(f"process {pid} is in no cgroup of the cpu controller")


def cgroup_parent(pid: Optional[int] = None) -> tuple[int, str]:
    """(version, directory) of the cgroup a starved host's processes come from: this process's own."""
    version, point, root = _cpu_mount()
    path = _own_cgroup(version, os.getpid() if pid is None else pid)
    relative = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
    return version, os.path.normpath(os.path.join(point, relative))


def starve_unavailable() -> Optional[str]:
    """Why a CPU quota cannot be put on a host here, or None when it can."""
    try:
        version, parent = cgroup_parent()
    except (OSError, FaultError) as exc:
        return str(exc)
    if not os.access(parent, os.W_OK):
        return f"the cgroup {parent} is not writable"
    if version == 2:
        with open(os.path.join(parent, "cgroup.subtree_control"), encoding="utf-8") as fh:
            if "cpu" not in fh.read().split():
                return f"the cpu controller is not enabled for the children of {parent} (cgroup.subtree_control)"
    return None


def _write(directory: str, name: str, value: str) -> None:
    with open(os.path.join(directory, name), "w", encoding="utf-8") as fh:
        fh.write(value)


def members(path: str) -> list[int]:
    """The PIDs in a cgroup now (none once it is gone)."""
    with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs"), encoding="utf-8") as fh:
        return [int(line) for line in fh if line.strip()]
    return []


class CpuQuota:
    """A cgroup of its own for one fault, limited to 0.1 % of one CPU, made next to the cgroup this
    process is in; :meth:`remove` lifts the limit, moves every process in it back and removes it.

    A keeper process owns the cgroup (``python faults.py keep ...``, in a session of its own): it makes
    it, then waits on its standard input; at a line or at end of file (simulate died, even by SIGKILL)
    it undoes everything and exits. So a starved host is never left starved, nor the cgroup behind:
    a host's processes killed while starved could otherwise take minutes to exit at 0.1 % of a CPU.
    """

    def __init__(self, name: str) -> None:
        self.version, self.parent = cgroup_parent()
        self.path = os.path.join(self.parent, f"ddp-simulate-{os.getpid()}-{name}")
        self._keeper = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), "keep", str(self.version), self.path,
             self.parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True, text=True)
        reply = self._keeper.stdout.readline().strip() if self._keeper.stdout else ""
        if reply != "ready":
            self._keeper.wait()
            raise FaultError(reply or f"the cgroup's keeper exited with code {self._keeper.returncode}")

    def members(self) -> list[int]:
        """The PIDs in the cgroup now."""
        return members(self.path)

    def add(self, pids_of: Callable[[], Iterable[int]]) -> list[int]:
        """Move every process ``pids_of()`` names into the cgroup, again until no new one appears."""
        moved: list[int] = []
        for _ in range(ROUNDS):
            new = [p for p in pids_of() if p not in moved and p != os.getpid()]
            if not new:
                break
            for pid in new:
                with contextlib.suppress(OSError):  # it exited meanwhile
                    _write(self.path, "cgroup.procs", str(pid))
                    moved.append(pid)
        return moved

    def remove(self) -> int:
        """Lift the quota, move every process back to the parent cgroup, remove the cgroup (the keeper does
        it and exits). Returns how many processes were moved back."""
        stdin, stdout = self._keeper.stdin, self._keeper.stdout
        with contextlib.suppress(BrokenPipeError, AttributeError):
            stdin.write("end\n")  # type: ignore[union-attr]
            stdin.close()  # type: ignore[union-attr]
        reply = stdout.readline().split() if stdout else []
        if stdout:
            stdout.close()
        self._keeper.wait()
        if reply[:1] != ["removed"]:
            raise FaultError(" ".join(reply) or f"the cgroup's keeper exited with code {self._keeper.returncode}")
        return int(reply[1])


def _keep(version: int, path: str, parent: str) -> int:
    """The keeper of a :class:`CpuQuota`: make the cgroup, wait for a line or end of input, undo, exit."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # only its input ends it, and it always undoes
    try:
        os.mkdir(path)
        if version == 1:
            _write(path, "cpu.cfs_period_us", str(PERIOD_US))
            _write(path, "cpu.cfs_quota_us", str(QUOTA_US))
        else:
            _write(path, "cpu.max", f"{QUOTA_US} {PERIOD_US}")
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        print(f"cannot make the cgroup {path}: {exc}", flush=True)
        return 1
    print("ready", flush=True)
    sys.stdin.readline()
    with contextlib.suppress(OSError):
        _write(path, *(("cpu.cfs_quota_us", "-1") if version == 1 else ("cpu.max", "max")))
    back, deadline = 0, time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in members(path):
            with contextlib.suppress(OSError):  # an exiting process cannot move: it leaves by itself
                _write(parent, "cgroup.procs", str(pid))
                back += 1
        try:
            os.rmdir(path)
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.01)
    with contextlib.suppress(OSError):
        print(f"removed {back}" if not os.path.exists(path) else f"cannot remove {path}: {members(path)}",
              flush=True)
    return 0


# -- CPU saturation: busy loops pinned to the host's CPUs ---------------------------------------------
def start_busy_loops(cpus: Iterable[int], env: Mapping[str, str]) -> list[subprocess.Popen]:
    """:data:`BUSY_LOOPS_PER_CPU` busy loops on each CPU of ``cpus``, each pinned to its CPU."""
    loops = []
    for cpu in sorted(cpus):
        for _ in range(BUSY_LOOPS_PER_CPU):
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", BUSY_LOOP], env=dict(env),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            loops.append(proc)
            with contextlib.suppress(OSError):
                os.sched_setaffinity(proc.pid, {cpu})
    return loops


def stop_busy_loops(loops: Iterable[subprocess.Popen]) -> list[int]:
    """SIGKILL each loop by its PID and wait for it; returns the PIDs."""
    pids = []
    for proc in loops:
        proc.kill()
        proc.wait()
        pids.append(proc.pid)
    return pids


def host_cpus(pid: int) -> set[int]:
    """The CPUs a host's process may run on (its affinity)."""
    try:
        return os.sched_getaffinity(pid)
    except OSError:
        return os.sched_getaffinity(0)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "keep":
        sys.exit(_keep(int(sys.argv[2]), sys.argv[3], sys.argv[4]))
    sys.exit(f"usage: {sys.argv[0]} keep VERSION CGROUP PARENT")
