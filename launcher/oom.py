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
"""

from __future__ import annotations

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
    for path, scope in candidates(cgroups, mountinfo):
        data = _read(path)
        value = parse_counter(data) if data is not None else None
        if value is not None:
            return Counter(path, scope, value)
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
