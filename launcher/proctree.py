"""Finding and ending the processes the launcher started, by PID, and nothing else.

torchrun starts every worker in a session of its own, so a process group does not hold the job
together; the parent links in the process table do. :func:`kill_tree` stops a tree (so nothing in it
can fork any more), then kills it. :class:`Watchdog` is a forked helper that does that if the
launcher itself dies, even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Optional

PR_SET_CHILD_SUBREAPER = 36


def parent_map() -> dict[int, int]:
    """PID -> parent PID for every process this user can see (``/proc``, else ``ps``)."""
    parents: dict[int, int] = {}
    if os.path.isdir("/proc/self"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    stat = fh.read()
            except OSError:
                continue
            # The command name is in parentheses and may contain spaces: split after the last ')'.
            fields = stat[stat.rfind(b")") + 2:].split()
            if fields and fields[0] != b"Z":
                parents[int(name)] = int(fields[1])
        return parents
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,stat="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, ppid, state = line.split()[:3]
        if not state.startswith("Z"):
            parents[int(pid)] = int(ppid)
    return parents


def descendants(roots: Iterable[int], parents: Optional[dict[int, int]] = None) -> list[int]:
    """Every living descendant of ``roots`` (the roots excluded), parents before children."""
    parents = parent_map() if parents is None else parents
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    queue = list(roots)
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def children_of(pid: int) -> list[int]:
    """The living direct children of ``pid``."""
    return [child for child, parent in parent_map().items() if parent == pid]


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_tree(roots: Iterable[int], include_roots: bool = True, exclude: Iterable[int] = ()) -> int:
    """SIGKILL all descendants of ``roots`` (and the roots, unless told not to); returns how many.

    The tree is frozen with SIGSTOP first and looked up again, so a process cannot escape by
    forking between the look-up and the kill. Rounds repeat until nothing of the tree is alive.
    """
    roots, skip = list(roots), set(exclude)
    signalled: set[int] = set()
    for _ in range(50):
        parents = parent_map()
        tree = [p for p in descendants(roots, parents) if p not in skip]
        if include_roots:
            tree += [p for p in roots if p in parents and p not in skip]
        if not tree:
            break
        _signal_all(tree, signal.SIGSTOP)
        tree += [p for p in descendants(roots) if p not in skip and p not in tree]
        _signal_all(tree, signal.SIGKILL)
        signalled.update(tree)
        time.sleep(0.02)
    return len(signalled)


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux), so none escapes the tree."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # only here: costs a few milliseconds

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_children() -> None:
    """Collect every exited child of this process (no zombies left behind)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class Watchdog:
    """A forked helper that kills the job's process tree when the launcher dies without saying so.

    The launcher keeps the write end of a pipe; the helper blocks reading it. The launcher sends
    the PIDs to guard, and ``done`` when it has cleaned up itself. End of file without ``done``
    means the launcher was killed: the helper then SIGKILLs the guarded trees and exits.
    """

    def __init__(self) -> None:
        read_fd, self._write_fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the helper
            os.close(self._write_fd)
            self._serve(read_fd)
        os.close(read_fd)

    @staticmethod
    def _serve(read_fd: int) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        guarded: list[int] = []
        buffer = b""
        while True:
            chunk = os.read(read_fd, 4096)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line == b"done":
                    os._exit(0)
                guarded.append(int(line))
        kill_tree(guarded)
        os._exit(0)

    def guard(self, pid: int) -> None:
        """Kill this PID's tree if the launcher dies."""
        os.write(self._write_fd, b"%d\n" % pid)

    def release(self) -> None:
        """The launcher cleaned up: let the helper exit without killing anything."""
        try:
            os.write(self._write_fd, b"done\n")
        finally:
            os.close(self._write_fd)
            os.waitpid(self.pid, 0)
