"""Out of memory, told apart: the kernel's own count of OOM kills, read before the job and after a SIGKILL.

A worker the kernel's OOM killer ends dies of SIGKILL, as one killed by ``kill -9`` does. The kernel
counts its OOM kills where every container can read them, as ``oom_kill N`` lines:

- cgroup v1: the memory cgroup's ``memory.oom_control`` (Linux 4.13+), counted in the cgroup of the
  killed process only;
- cgroup v2: the cgroup's ``memory.events`` (Linux 4.13+), counted in the killed process's cgroup and
  every cgroup above it (``memory_localevents`` off, the default);
- no memory cgroup to read (the root cgroup, no memory controller mounted): ``/proc/vmstat``
  (Linux 4.13+), the whole machine's count.

:func:`snapshot` finds this process's counter (the workers inherit the launcher's cgroup) and reads it
before torchrun starts; :func:`evidence` reads it again after a worker died of SIGKILL. A count that
rose means the OOM killer killed a process in that cgroup meanwhile: out of memory. The limits: a
SIGKILL from elsewhere that coincides with an OOM kill of another process of the same cgroup is
taken for out of memory; with ``/proc/vmstat`` (no cgroup counter) an OOM kill anywhere on the machine
is; a worker that moved itself to another memory cgroup (v1) is not seen (its SIGKILL stays a signal).

The count says that the OOM killer killed a process, not which one: :func:`explain` names the victim
from the kernel's log where it can be read (:class:`KernelLog`: its ``oom-kill:`` lines in this
cgroup), from PyTorch's own "DataLoader worker (pid N)" message, or from the rank's own SIGKILL, with
the cgroup's memory limit (:func:`memory_limit`). A rank that fails because its DataLoader worker was
killed so is out of memory too.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple, Optional

from launcher.errors import ConfigError
from launcher.filereader import read_bounded

KEY = b"oom_kill"
MAX_DIGITS = 20  # the kernel's counters are 64-bit: 18446744073709551615 has 20 digits
FILE_LIMIT = 1 << 16  # bytes of a counter file read (memory.events and vmstat: a few KiB)
MOUNTINFO_LIMIT = 4 << 20  # bytes of /proc/self/mountinfo read (thousands of mounts)
VMSTAT = "/proc/vmstat"
MACHINE = "the whole machine"  # /proc/vmstat's scope: an OOM kill of any process counts


class Counter(NamedTuple):
    """One OOM-kill counter: the file, what it counts, and its value when read."""

    path: str
    scope: str  # "cgroup v1", "cgroup v2", or "the whole machine" (any process's OOM kill counts)
    value: int
    cgroup: str = ""  # the cgroup as /proc/PID/cgroup names it (the kernel log's task_memcg uses the same names)
    log: Optional[KernelLog] = None  # the kernel's log from then on; None when /dev/kmsg cannot be read


def parse_counter(data: bytes) -> Optional[int]:
    """The value of the first ``oom_kill N`` line of a counter file; None when there is no such line or
    its value is not a decimal of at most :data:`MAX_DIGITS` digits.

    The three files share the form (``memory.oom_control``: ``oom_kill_disable 0``, ``under_oom 0``,
    ``oom_kill 3``; ``memory.events``: ``low``, ``high``, ``max``, ``oom``, ``oom_kill``,
    ``oom_group_kill``; ``/proc/vmstat``: a hundred ``name value`` lines).
    """
    for line in data.split(b"\n"):
        fields = line.split()
        if len(fields) == 2 and fields[0] == KEY:
            value = fields[1]
            if value.isdigit() and len(value) <= MAX_DIGITS:
                return int(value)
            return None
    return None


def _unescape(field: bytes) -> bytes:
    """A mountinfo path with the kernel's octal escapes (``\\040`` for a space) undone."""
    out, i = bytearray(), 0
    while i < len(field):
        octal = field[i + 1:i + 4]
        if field[i:i + 1] == b"\\" and len(octal) == 3 and all(48 <= c <= 55 for c in octal):
            out.append(int(octal, 8) & 0xFF)
            i += 4
        else:
            out.append(field[i])
            i += 1
    return bytes(out)


def parse_mounts(mountinfo: bytes) -> tuple[Optional[tuple[str, str]], Optional[tuple[str, str]]]:
    """The first cgroup v1 mount with the memory controller and the first cgroup2 mount of
    ``/proc/self/mountinfo``, each as (its root inside the hierarchy, its mount point); None when absent."""
    v1 = v2 = None
    for line in mountinfo.split(b"\n"):
        fields = line.split()
        if b"-" not in fields:
            continue
        dash = fields.index(b"-")
        if dash < 5 or len(fields) < dash + 3:
            continue
        kind, options = fields[dash + 1], fields[dash + 3].split(b",")
        place = (_unescape(fields[3]).decode("utf-8", "surrogateescape"),
                 _unescape(fields[4]).decode("utf-8", "surrogateescape"))
        if kind == b"cgroup" and b"memory" in options and v1 is None:
            v1 = place
        elif kind == b"cgroup2" and v2 is None:
            v2 = place
    return v1, v2


def parse_cgroups(data: bytes) -> tuple[Optional[str], Optional[str]]:
    """This process's memory cgroup (v1) and its cgroup v2 path from ``/proc/self/cgroup``
    (``ID:controllers:path`` lines); None when absent."""
    v1 = v2 = None
    for line in data.split(b"\n"):
        parts = line.split(b":", 2)
        if len(parts) != 3 or not parts[2].startswith(b"/"):
            continue
        path = parts[2].decode("utf-8", "surrogateescape")
        if parts[0] == b"0" and parts[1] == b"":
            v2 = v2 or path
        elif b"memory" in parts[1].split(b","):
            v1 = v1 or path
    return v1, v2


def _inside(mount: tuple[str, str], cgroup: str) -> str:
    """The directory of ``cgroup`` under a mount of its hierarchy (``mount``: its root and mount point)."""
    root, point = mount
    if root != "/" and (cgroup == root or cgroup.startswith(root + "/")):
        cgroup = cgroup[len(root):]
    return point.rstrip("/") + "/" + cgroup.strip("/") if cgroup.strip("/") else point


def _read(path: str) -> Optional[bytes]:
    try:
        return read_bounded(path, FILE_LIMIT, "", missing_ok=True)
    except ConfigError:
        return None


def candidates(cgroups: bytes, mountinfo: bytes) -> list[tuple[str, str]]:
    """The counter files to try, best first, each with what it counts: the memory cgroup's (v1), the
    cgroup's (v2), then the machine's."""
    (v1_mount, v2_mount), (v1, v2) = parse_mounts(mountinfo), parse_cgroups(cgroups)
    found = []
    if v1 is not None and v1_mount is not None:
        found.append((_inside(v1_mount, v1) + "/memory.oom_control", "cgroup v1"))
    if v2 is not None and v2_mount is not None:
        found.append((_inside(v2_mount, v2) + "/memory.events", "cgroup v2"))
    return found + [(VMSTAT, MACHINE)]


def snapshot(pid: str = "self") -> Optional[Counter]:
    """The first counter of :func:`candidates` for process ``pid`` that can be read, with its value now;
    None when none can (a kernel before 4.13, no /proc). Never raises."""
    cgroups = _read(f"/proc/{pid}/cgroup") or b""
    try:
        mountinfo = read_bounded(f"/proc/{pid}/mountinfo", MOUNTINFO_LIMIT, "", missing_ok=True) or b""
    except ConfigError:
        mountinfo = b""
    v1, v2 = parse_cgroups(cgroups)
    for path, scope in candidates(cgroups, mountinfo):
        data = _read(path)
        value = parse_counter(data) if data is not None else None
        if value is not None:
            cgroup = {"cgroup v1": v1, "cgroup v2": v2}.get(scope) or ""
            return Counter(path, scope, value, cgroup, KernelLog.mark())
    return None


def evidence(before: Optional[Counter]) -> str:
    """What says a SIGKILL was the OOM killer's: ``oom_kill 3 -> 4 in /sys/fs/cgroup/memory/job/memory.oom_control
    (cgroup v1)`` when the counter rose since ``before``; "" when it did not, or when it cannot be read.
    Never raises."""
    if before is None:
        return ""
    data = _read(before.path)
    now = parse_counter(data) if data is not None else None
    if now is None or now <= before.value:
        return ""
    return f"oom_kill {before.value} -> {now} in {before.path} ({before.scope})"


# -- which process, and the limit ------------------------------------------------------------------------
KMSG = "/dev/kmsg"
KMSG_RECORDS = 200_000  # records read from the kernel log at most (a 16 MiB ring holds about that many)
PAIRED = 100  # records at most from a kill's "oom-kill:" line to its "Killed process" line (the kernel: the next)
UNLIMITED = 1 << 62  # a v1 limit at or above this is the kernel's "no limit" (9223372036854771712)
LIMIT_FILES = {"memory.oom_control": "memory.limit_in_bytes", "memory.events": "memory.max"}
_KILLED = re.compile(rb"Killed process (\d+) \((.*)\) total-vm")
_OOM_KILL = re.compile(rb"oom-kill:.*?task_memcg=([^,]*),task=(.*),pid=(\d+),uid=\d+")
_LOADER_PIDS = re.compile(r"DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly")
_LOADER_PID = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal")
_SIGNALLED_PID = re.compile(r"Signal 9 \(SIGKILL\) received by PID (\d+)")
_KILL_SIGN = re.compile(r"SIGKILL|killed by signal: Killed|status -9\b|code -9\b")


class Kill(NamedTuple):
    """One OOM kill the kernel logged: its record's sequence number, the process, and its memory cgroup."""

    seq: int
    pid: int
    name: str
    memcg: Optional[str]  # task_memcg of the ``oom-kill:`` line; None when the kernel logged none (before 4.19)


def parse_kmsg(data: bytes) -> list[Kill]:
    """The OOM kills in kernel log records as ``/dev/kmsg`` gives them (``PRI,SEQ,USEC,FLAGS;message``, one
    a line; continuation lines begin with a space), oldest first. The kernel logs each kill twice: an
    ``oom-kill:...,task_memcg=/x,task=NAME,pid=N,uid=U`` line, then ``... Killed process N (NAME) total-vm...``."""
    kills: dict[int, Kill] = {}
    for line in data.split(b"\n"):
        head, sep, message = line.partition(b";")
        fields = head.split(b",")
        if not sep or len(fields) < 4 or not fields[1].isdigit() or len(fields[1]) > MAX_DIGITS:
            continue
        seq = int(fields[1])
        found = _OOM_KILL.search(message)
        if found and len(found.group(3)) <= 10:
            pid = int(found.group(3))
            kills[pid] = Kill(seq, pid, found.group(2).decode("utf-8", "replace"),
                              found.group(1).decode("utf-8", "surrogateescape"))
            continue
        found = _KILLED.search(message)
        if found and len(found.group(1)) <= 10:
            pid = int(found.group(1))
            old = kills.get(pid)
            memcg = old.memcg if old is not None and seq - old.seq <= PAIRED else None
            kills[pid] = Kill(seq, pid, found.group(2).decode("utf-8", "replace"), memcg)
    return sorted(kills.values())


class KernelLog:
    """The kernel's log from a mark on: ``/dev/kmsg`` opened and moved to its end when a generation starts
    (no record is read then: the ring may hold thousands), read only after a failure, for the OOM kills
    logged since. One is open at a time (:meth:`mark` closes the one before)."""

    current: Optional[KernelLog] = None

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.kills: list[Kill] = []

    @classmethod
    def mark(cls, path: str = KMSG) -> Optional[KernelLog]:
        """A new mark at the log's end now; None when it cannot be read (no root and
        ``kernel.dmesg_restrict`` 1, a container without it). Never raises."""
        if cls.current is not None:
            cls.current.close()
            cls.current = None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, ValueError):
            return None
        try:
            os.lseek(fd, 0, os.SEEK_END)
        except OSError:
            os.close(fd)
            return None
        cls.current = cls(fd)
        return cls.current

    def since(self) -> list[Kill]:
        """Every OOM kill logged after the mark (read now, kept for the next call). Never blocks or raises."""
        if self.fd < 0:
            return self.kills
        records: list[bytes] = []
        for _ in range(KMSG_RECORDS):
            try:
                record = os.read(self.fd, 8192)  # one record a read; a regular file (the tests') gives all
            except BrokenPipeError:  # the ring overwrote the record being read: go on with the next
                continue
            except OSError:  # EAGAIN: no more records
                break
            if not record:
                break
            records.append(record)
        self.kills += parse_kmsg(b"".join(records))
        return self.kills

    def close(self) -> None:
        """Close the log (its kills stay)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def readable(path: str = KMSG) -> bool:
    """Whether the kernel's log can be read here."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except (OSError, ValueError):
        return False
    return True


def size_text(value: int) -> str:
    """``536870912`` -> ``512 MiB``; ``1610612736`` -> ``1.5 GiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift:
            return f"{value / (1 << shift):.4g} {unit}"
    return f"{value} B"


def memory_limit(counter: Counter) -> str:
    """The smallest memory limit of the counter's cgroup and those above it (v1 ``memory.limit_in_bytes``,
    v2 ``memory.max``), as ``512 MiB of /sys/fs/cgroup/job``; "none" when no cgroup has one; "" for the
    machine's counter or when it cannot be read."""
    limit_name = LIMIT_FILES.get(os.path.basename(counter.path))
    if limit_name is None:
        return ""
    directory, best = os.path.dirname(counter.path), None
    for _ in range(64):
        data = _read(os.path.join(directory, limit_name))
        if data is None:
            break
        value = data.strip()
        if value.isdigit() and len(value) <= MAX_DIGITS and int(value) < min(UNLIMITED, best[0] if best else UNLIMITED):
            best = (int(value), directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    if best is None:  # "none" when the cgroup had the file, all "max"; "" when it had none (not a memory cgroup)
        return "none" if directory != os.path.dirname(counter.path) else ""
    return f"{size_text(best[0])} of {best[1]}"


def pids_in(text: str) -> tuple[list[int], list[int]]:
    """The processes a rank's own words name as SIGKILLed: (DataLoader workers, others)."""
    loaders = [int(pid) for found in _LOADER_PIDS.finditer(text) for pid in re.findall(r"\d+", found.group(1))]
    loaders += [int(found.group(1)) for found in _LOADER_PID.finditer(text)]
    others = [int(found.group(1)) for found in _SIGNALLED_PID.finditer(text)]
    return [pid for pid in loaders if pid < 1 << 31], [pid for pid in others if pid < 1 << 31]


def _ours(kill: Kill, counter: Counter, named: list[int]) -> bool:
    """Whether a logged kill is of this job: in the counter's cgroup or below it, or a process it names."""
    if kill.pid in named:
        return True
    cgroup = counter.cgroup.rstrip("/")
    if counter.scope == MACHINE or not cgroup or kill.memcg is None:
        return False
    return kill.memcg == cgroup or kill.memcg.startswith(cgroup + "/")


def explain(before: Optional[Counter], text: str, killed: bool) -> Optional[tuple[str, str]]:
    """(the evidence, what the OOM killer killed) when the kernel's OOM-kill count rose since ``before``
    and the failure is its doing; else None. Never raises.

    ``text``: the root cause's exception and traceback; ``killed``: the rank (or torchrun) itself died of
    SIGKILL. The victim is, by what is known: the process the kernel's log names (read only when
    ``/dev/kmsg`` can be, and only a kill in this cgroup or of a process the text names), the
    DataLoader worker whose PID PyTorch's message gives, the rank itself, or a process whose SIGKILL
    the text tells of (only with a cgroup's count: the machine's counts others' kills too).
    """
    found = evidence(before)
    if not found or before is None:
        return None
    loaders, others = pids_in(text)
    logged = before.log.since() if before.log is not None else []
    kills = [kill for kill in logged if _ours(kill, before, loaders + others)]
    limit = memory_limit(before)
    tail = f"; cgroup limit {limit}" if limit else ""
    alone = f" (cgroup limit {limit})" if limit else ""
    loader = next((k for k in kills if k.pid in loaders), None)
    if loader is not None or (loaders and not killed):
        pid, name = (loader.pid, loader.name) if loader is not None else (loaders[0], "")
        named = f"pid {pid}, {name}" if name else f"pid {pid}"
        return found, f"the kernel's OOM killer killed its DataLoader worker ({named}{tail})"
    if killed:
        victim = next((k for k in kills if k.pid in others), kills[0] if len(kills) == 1 else None)
        named = f" (pid {victim.pid}, {victim.name}{tail})" if victim is not None else alone
        return found, "was killed by SIGKILL from the kernel's OOM killer" + named
    if kills:
        return found, f"the kernel's OOM killer killed process {kills[0].pid} ({kills[0].name}) of the job{alone}"
    if before.scope != MACHINE and _KILL_SIGN.search(text):
        return found, f"the kernel's OOM killer killed a process of it{alone}"
    return None
