"""Finding and ending the processes the launcher started, by ancestry, by PID or by the job's marker.

torchrun starts every worker in a session of its own, so a process group does not hold the job
together; the parent links in the process table do. :func:`kill_tree` stops a tree (so nothing in it
can fork any more), then kills it. A daemon that a worker double-forked leaves the tree when its
parent dies: the launcher is a child subreaper, so the daemon becomes the launcher's child, and the
launcher tells the watchdog each such child (:func:`reap_orphans`, every tick) with its start time.
Whatever the daemon changes (its session, its process group, its whole environment), it stays that
process. A daemon also carries the job's marker variable (``NAME=<pid>-<random hex>``, inherited
through every fork and exec) unless it cleared its environment; :func:`kill_tree` also looks for it
in ``/proc/PID/environ``, as Jenkins' process-tree killer does with ``BUILD_ID``. :class:`Watchdog`
is a forked helper in a session of its own that does all this if the launcher itself dies, even by
SIGKILL of its whole process group. Should the watchdog be killed too, the parent-death signals
(:func:`parent_death_signal`) are the last line: the kernel SIGKILLs torchrun when the launcher dies,
and each worker gets SIGTERM when torchrun dies (the bootstrap asks for it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
TRACKED_PRUNE = 4096  # processes tracked before those that ended are forgotten (a long job's DataLoader workers)
WATCHDOG_NAME = b"ddp-watchdog"  # its /proc/PID/comm: a watchdog is never killed, it ends with its launcher


def _read(path: str) -> bytes:
    """The whole of a ``/proc`` file, in four system calls where ``open()`` makes seven (the tick reads
    a few dozen of them twice a second); OSError if it cannot be read (its process is gone)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = chunk = os.read(fd, 4096)
        while chunk:
            chunk = os.read(fd, 65536)
            data += chunk
        return data
    finally:
        os.close(fd)


def _stat(pid: int) -> Optional[list[bytes]]:
    """``/proc/PID/stat`` from field 3 (state) on; None if the process is gone."""
    try:
        stat = _read(f"/proc/{pid}/stat")
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    return stat[stat.rfind(b")") + 2:].split()


def _process_table() -> dict[int, tuple[int, bytes]]:
    """PID -> (parent PID, state letter) for every process this user can see (``/proc``, else ``ps``)."""
    table: dict[int, tuple[int, bytes]] = {}
    if os.path.isdir("/proc/self"):
        for name in os.listdir("/proc"):
            fields = _stat(int(name)) if name.isdigit() else None
            if fields:
                table[int(name)] = (int(fields[1]), fields[0][:1])
        return table
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,stat="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, ppid, state = line.split()[:3]
        table[int(pid)] = (int(ppid), state[:1].encode())
    return table


def parent_map() -> dict[int, int]:
    """PID -> parent PID for every living (not zombie) process this user can see."""
    return {pid: ppid for pid, (ppid, state) in _process_table().items() if state != b"Z"}


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


def children_of(pid: int, zombies: bool = False) -> list[int]:
    """The direct children of ``pid``: the living ones, and the exited unreaped ones if asked.

    Read from ``pid``'s own ``/proc/PID/task/*/children`` files (one per thread, Linux 3.5+): a few
    reads where the whole process table is hundreds (the hang watch asks every second, on every host).
    """
    listed = _listed_children(pid)
    if listed is None:
        return [child for child, (parent, state) in _process_table().items()
                if parent == pid and (zombies or state != b"Z")]
    found = []
    for child in listed:
        fields = _stat(child)
        if fields and int(fields[1]) == pid and (zombies or fields[0][:1] != b"Z"):
            found.append(child)
    return found


def _tree_table(root: int) -> dict[int, tuple[int, bytes]]:
    """PID -> (parent PID, state letter) for ``root`` and every descendant (zombies too), walked down the
    ``children`` files: a few dozen reads for a job, where the whole process table is every process of
    the machine (the launcher looks twice a second). The whole table where the kernel has no such files."""
    if not _has_children_files():
        return _process_table()
    table: dict[int, tuple[int, bytes]] = {}
    queue = [root]
    while queue:
        parent = queue.pop()
        for child in _listed_children(parent) or []:
            fields = _stat(child)
            if fields and int(fields[1]) == parent and child not in table:
                table[child] = (parent, fields[0][:1])
                queue.append(child)
    return table


def _living_parents(roots: Iterable[int]) -> dict[int, int]:
    """PID -> parent PID for the living ``roots`` and their living descendants: :func:`parent_map` cut
    down to these trees, walked down the ``children`` files (a few reads at the end of a job, where the
    whole process table is every process of the machine)."""
    if not _has_children_files():
        return parent_map()
    parents: dict[int, int] = {}
    for root in roots:
        fields = _stat(root)
        if fields and fields[0][:1] != b"Z":
            parents[root] = int(fields[1])
        parents.update((pid, parent) for pid, (parent, letter) in _tree_table(root).items() if letter != b"Z")
    return parents


def _listed_children(pid: int) -> Optional[list[int]]:
    """The PIDs in ``pid``'s threads' ``children`` files; None where the kernel has no such files."""
    if not _has_children_files():
        return None
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # it has exited
    listed: list[int] = []
    for thread in threads:
        # a thread that ended meanwhile has no file
        with contextlib.suppress(OSError, ValueError):
            listed.extend(int(child) for child in _read(f"/proc/{pid}/task/{thread}/children").split())
    return listed


@functools.cache
def _has_children_files() -> bool:
    """Whether the kernel lists each thread's children (``/proc/PID/task/TID/children``, Linux 3.5+)."""
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def state(pid: int) -> Optional[str]:
    """The process's state letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie...); None if it is gone."""
    fields = _stat(pid)
    return fields[0][:1].decode() if fields else None


def wait_exit(proc: subprocess.Popen, timeout: float, wake: Optional[int] = None) -> Optional[int]:
    """``proc``'s return code once it exits within ``timeout`` seconds, else None; sooner (None) when the
    file descriptor ``wake`` becomes readable (the caller drains it).

    Woken by the exit itself (a pidfd, Linux 5.3+), not by polling: ``Popen.wait(timeout)`` polls
    with sleeps of up to 50 ms, so the end of every job was noticed up to 50 ms late.
    """
    if proc.returncode is None and hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:  # an older kernel, or already reaped
            fd = -1
        if fd >= 0:
            import select  # the pidfd path only

            try:
                select.select([fd] if wake is None else [fd, wake], [], [], timeout)
            finally:
                os.close(fd)
            return proc.poll()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def stat_fields(pid: int) -> Optional[list[bytes]]:
    """``/proc/PID/stat`` from field 3 (state) on (``proc(5)``'s field N is item N - 3); None if it is gone."""
    return _stat(pid)


def parent_of(pid: int) -> Optional[int]:
    """The process's parent PID; None if it is gone."""
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def start_time(pid: int) -> Optional[int]:
    """The process's start time (clock ticks after boot, ``/proc/PID/stat`` field 22): with the PID, it
    names one process for good (a PID is reused, the pair never). None if it is gone."""
    fields = _stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def _is_watchdog(pid: int) -> bool:
    try:
        return _read(f"/proc/{pid}/comm").strip() == WATCHDOG_NAME
    except OSError:
        return False


def marked(marker: str) -> list[int]:
    """This user's processes whose environment holds exactly ``marker`` (``NAME=VALUE``), watchdogs aside."""
    entry, uid, found = marker.encode(), os.getuid(), []
    for name in os.listdir("/proc") if os.path.isdir("/proc/self") else []:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            environ = _read(f"/proc/{name}/environ").split(b"\0")
        except OSError:
            continue
        if entry in environ and not _is_watchdog(int(name)):
            found.append(int(name))
    return found


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_tree(roots: Iterable[int], include_roots: bool = True, exclude: Iterable[int] = (),
              marker: Optional[str] = None) -> int:
    """SIGKILL all descendants of ``roots`` (and the roots, unless told not to) but ``exclude`` and their own
    descendants; returns how many.

    With ``marker`` (``NAME=VALUE``), every process of this user whose environment holds it goes too,
    with its descendants. The set is frozen with SIGSTOP first and looked up again, so a process
    cannot escape by forking between the look-up and the kill. Rounds repeat until nothing is left.
    Watchdogs are spared: each ends by itself when its launcher is gone.
    """
    roots, skip = list(roots), set(exclude)

    def victims(parents: dict[int, int]) -> list[int]:
        tops = [p for p in roots if include_roots and p in parents] + (marked(marker) if marker else [])
        found = dict.fromkeys(tops + descendants(roots + tops, parents))
        spared = skip.union(descendants(skip, parents)) if skip else skip
        return [p for p in found if p not in spared and p in parents and not _is_watchdog(p)]

    def look() -> dict[int, int]:
        return parent_map() if marker else _living_parents(roots)

    signalled: set[int] = set()
    for _ in range(50):
        tree = victims(look())
        if not tree:
            break
        _signal_all(tree, signal.SIGSTOP)
        tree += [p for p in victims(look()) if p not in tree]
        _signal_all(tree, signal.SIGKILL)
        signalled.update(tree)
        time.sleep(0.02)
    return len(signalled)


def _prctl(option: int, arg: object) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # only here: costs a few milliseconds

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux), so none escapes the tree."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def reap_children() -> None:
    """Collect every exited child of this process (no zombies left behind)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def reap_orphans(keep: Iterable[int], watchdog: Optional[Watchdog] = None) -> int:
    """Collect the exited children of this process except ``keep``; returns how many.

    A subreaper inherits every orphan of its tree; their zombies would pile up while the job runs.
    Each is waited for by PID: ``waitpid(-1)`` could take the status of a child that a
    :class:`subprocess.Popen` waits for. The living ones (daemons a worker detached) are handed to
    ``watchdog`` to kill should the launcher die, and a watchdog that died is noticed.
    """
    reaped, spared, me = 0, set(keep), os.getpid()
    table = _tree_table(me)
    for pid, (parent, letter) in table.items():
        if parent == me and pid not in spared and letter == b"Z":
            with contextlib.suppress(ChildProcessError):
                reaped += os.waitpid(pid, os.WNOHANG)[0] == pid
    if watchdog is not None:
        living = {pid: parent for pid, (parent, letter) in table.items() if letter != b"Z"}
        watchdog.track({pid: living[pid] == me and pid not in spared
                        for pid in descendants([me], living) if pid != watchdog.pid}, set(living))
        if table.get(watchdog.pid, (0, b"Z"))[1] == b"Z":
            watchdog.lost("it has exited")
    return reaped


def _libc_prctl() -> Optional[Callable[..., int]]:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # only here: costs a few milliseconds

    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def parent_death_signal(sig: int) -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that makes the child get ``sig`` when this process (the thread starting it) dies.

    The kernel delivers it even when this process is SIGKILLed; it survives the child's exec. The
    library call is looked up here, before the fork, so the child only makes one system call. None
    where Linux's ``prctl`` is not available.
    """
    prctl, parent = _libc_prctl(), os.getpid()
    if prctl is None:
        return None

    def set_in_child() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # this process died before the call: the signal would never come
            os.kill(os.getpid(), sig)
    return set_in_child


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have this process get ``sig`` when its parent dies (Linux ``PR_SET_PDEATHSIG``).

    For a worker's start-up code: a worker then ends when torchrun does, whatever killed torchrun.
    A parent already gone gets the signal sent at once. Returns False where it is not available.
    """
    parent = os.getppid()
    if not _prctl(PR_SET_PDEATHSIG, sig):
        return False
    if parent == 1 or os.getppid() != parent:  # the parent died before the call
        os.kill(os.getpid(), sig)
    return True


class Watchdog:
    """A forked helper that kills the job's processes when the launcher dies without saying so.

    The launcher keeps the write end of a pipe; the helper blocks reading it. The launcher sends
    the processes to guard (each a PID and its start time), the job's marker and the directories to
    remove, then ``done`` when it has cleaned up itself. End of file without ``done`` means the launcher
    was killed: the helper then SIGKILLs the guarded trees whose PID still has its start time (a guarded
    process that ended long before left its PID to whatever started since: another host's launcher on
    a busy machine) and every process with the marker, removes the directories and exits.
    The helper is in a session of its own (a kill of the launcher's process group misses it), needs
    no standard stream (they point at ``/dev/null``) and ignores the stop signals and SIGPIPE.
    Fork it before creating pipes for children: it closes every descriptor but its own.

    Losing the helper (someone SIGKILLs it) costs one warning through ``log``, never the job.
    """

    def __init__(self, log: Callable[[str], None] = lambda _message: None) -> None:
        self._log = log
        self._tracked: set[int] = set()
        self._told: set[int] = set()  # the re-parented ones said in a log line
        self._lost = False
        read_fd, self._write_fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the helper: never returns into the launcher's code
            try:
                self._serve(read_fd)
            finally:
                os._exit(0)
        os.close(read_fd)

    @staticmethod
    def _serve(read_fd: int) -> None:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_IGN)
        os.chdir("/")
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, read_fd)
        os.closerange(read_fd + 1, 65536)
        _prctl(PR_SET_NAME, WATCHDOG_NAME)
        guarded: dict[int, int] = {}  # PID -> start time, as tracked ones: the guarded process may have ended
        tracked: dict[int, int] = {}  # PID -> start time: a PID reused by another process is not it
        markers: list[str] = []
        dirs: list[str] = []
        buffer = b""
        while True:
            chunk = os.read(read_fd, 4096)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                kind, _, value = line.partition(b" ")
                if kind == b"done":
                    return
                if kind == b"pid":
                    pid, started = (int(word) for word in value.split())
                    guarded[pid] = started
                elif kind == b"track":
                    pid, started = (int(word) for word in value.split())
                    tracked[pid] = started
                elif kind == b"living":  # the others have ended: forget them
                    alive = {int(word) for word in value.split()}
                    tracked = {pid: started for pid, started in tracked.items() if pid in alive}
                elif kind == b"marker":
                    markers.append(bytes.fromhex(value.decode()).decode())
                elif kind == b"dir":
                    dirs.append(os.fsdecode(bytes.fromhex(value.decode())))
        # Only the processes it was told of: a PID whose process ended long ago (a restart's earlier torchrun,
        # a simulated host that exited) may since name another process (another host's launcher).
        kill_tree([pid for pid, started in {**guarded, **tracked}.items() if start_time(pid) == started])
        for marker in markers:
            kill_tree([], marker=marker)
        import shutil

        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)

    def _send(self, kind: str, value: bytes = b"") -> None:
        if self._lost:
            return
        try:
            os.write(self._write_fd, kind.encode() + b" " + value + b"\n")
        except OSError as exc:  # EPIPE: the helper is gone
            self.lost(exc.strerror or str(exc))

    def lost(self, why: str) -> None:
        """The helper is gone (``why``): warn once; the job goes on without it."""
        if not self._lost:
            self._lost = True
            self._log(f"the watchdog (pid {self.pid}) is gone ({why}): the job goes on; should the launcher "
                       "be killed now, the parent-death signals end torchrun and its workers")

    def guard(self, pid: int) -> None:
        """Kill this process's tree if the launcher dies, and it still runs: known by PID and start time
        (:func:`start_time`), never another process that was given its PID after it ended."""
        started = start_time(pid)
        if started is not None:  # gone already: nothing to guard
            self._send("pid", b"%d %d" % (pid, started))

    def track(self, pids: dict[int, bool], living: set[int]) -> None:
        """Kill these processes and their trees if the launcher dies, even once they left its tree;
        each is known by PID and start time, told once. ``pids`` maps each to whether it is a daemon
        re-parented to the launcher (said in a log line); ``living`` (every living PID of the tree) lets the
        record of processes that ended be dropped."""
        for pid, reparented in pids.items():
            if pid not in self._tracked:
                started = start_time(pid)
                if started is None:
                    continue
                self._tracked.add(pid)
                self._send("track", b"%d %d" % (pid, started))
            # said once, also when it was first seen still under its parent (a daemon's middle process
            # that had not yet exited: a loaded machine's race)
            if reparented and pid not in self._told:
                self._told.add(pid)
                self._log(f"process {pid} left torchrun's tree (re-parented to the launcher): it is ended "
                          "with the job")
        if len(self._tracked) > TRACKED_PRUNE:
            self._told &= living
            self._tracked &= living
            self._send("living", b" ".join(b"%d" % pid for pid in sorted(self._tracked)))

    def kill_marked(self, marker: str) -> None:
        """Kill every process whose environment holds ``marker`` (``NAME=VALUE``) if the launcher dies."""
        self._send("marker", marker.encode().hex().encode())

    def remove_dir(self, path: str) -> None:
        """Remove this directory (after the kill) if the launcher dies."""
        self._send("dir", os.fsencode(path).hex().encode())

    def release(self) -> None:
        """The launcher cleaned up: let the helper exit without killing anything."""
        try:
            self._send("done")
        finally:
            os.close(self._write_fd)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)


def new_marker(name: str) -> str:
    """``NAME=<pid>-<16 random hex digits>``: a value no other job, earlier or later, can have."""
    return f"{name}={os.getpid()}-{os.urandom(8).hex()}"
