"""A private lab of hosts on one machine: each host its own network namespace, address, hostname and
``/etc/hosts``, on a bridge that no other run can see. Standard library only; it runs ``ip``
(iproute2), ``unshare``, ``nsenter`` and ``mount``.

A :class:`Lab` starts one holder process inside a new network and mount namespace (and a user namespace
when not root); the holder mounts a tmpfs on ``/run`` there, so ``ip netns`` names, the bridge, the
veths and the subnet are the run's own, and runs the lab's ``ip`` commands. Each host is a named
network namespace with ``eth0`` on the bridge; :meth:`Lab.command` wraps a command so that it starts
in the host with its own hostname (UTS namespace) and the lab's hosts file bound over ``/etc/hosts``
(a private mount namespace: the machine's file is never edited). Processes keep the machine's PID
namespace: a host's PIDs are the machine's PIDs.

Nothing outlives the lab: the holder reads its standard input; at :meth:`Lab.close`, or at end of
file (the process that made the lab died, even by SIGKILL: the holder is in a session of its own), it
SIGKILLs every process in the hosts' namespaces and exits, which frees the namespaces, the veths and
the bridge. After an owner's death it first gives the hosts' processes :data:`LINGER` seconds to end
by themselves (their own watchdogs clean up their run directories as they go)::

    with Lab(directory) as lab:
        lab.add_host("algo-1", host_address(0))
        lab.add_host("algo-2", host_address(1))
        subprocess.run(lab.command("algo-1", ["hostname"]))   # algo-1
        lab.partition("algo-2")       # its link goes down: packets vanish, nobody gets a reset
        lab.heal("algo-2")
        lab.poweroff("algo-2")        # link down, then every process of the host SIGKILLed at once

Run as a script, this file is the holder itself (``python netns.py hold``). A host's command enters
the host's network namespace, then new UTS and mount namespaces, where :mod:`launcher.simulate.become`
takes the host's name and hosts file and becomes the command.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

SUBNET = "10.88.0."
PREFIX_LENGTH = 24
MAX_HOSTS = 254
BRIDGE = "br0"
LINGER = 3.0  # seconds the hosts' processes get to end by themselves when the lab's owner died
TOOLS = ("ip", "unshare", "nsenter", "mount")


def host_address(index: int) -> str:
    """The address of host ``index`` (0-based) on the lab's bridge."""
    if not 0 <= index < MAX_HOSTS:
        raise ValueError(f"a lab has at most {MAX_HOSTS} hosts: index {index}")
    return f"{SUBNET}{index + 1}"


def _namespace_flags() -> list[str]:
    """``unshare``'s flags for the lab: a user namespace too when not root."""
    flags = ["--net", "--mount"]
    return flags if os.geteuid() == 0 else ["--user", "--map-root-user", *flags]


def unavailable() -> Optional[str]:
    """Why a lab cannot be made on this machine, or None when it can (a probe of a few milliseconds)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found on PATH"
    try:
        probe = subprocess.run(["unshare", *_namespace_flags(), "true"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        return f"network namespaces not permitted ({reason})"
    return None


def namespace_pids(inodes: Iterable[int]) -> list[int]:
    """PIDs (the machine's) of every process whose network namespace is one of ``inodes``."""
    wanted = {f"net:[{inode}]" for inode in inodes}
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/net") in wanted:
                    found.append(int(name))
            except OSError:
                continue
    return found


def kill_namespaces(inodes: Sequence[int]) -> list[int]:
    """End every process in these network namespaces at once, as a power loss does: all are stopped
    (SIGSTOP) until no new one appears, then all are SIGKILLed. Killed one by one, a process that
    outlived its parent by a moment could react (torchrun's parent-death SIGTERM reaching its workers).
    Returns the PIDs killed."""
    stopped: list[int] = []
    for _ in range(100):  # a process forked meanwhile is in the namespace too
        fresh = [pid for pid in namespace_pids(inodes) if pid != os.getpid() and pid not in stopped]
        if not fresh:
            break
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
    killed: list[int] = []
    for _ in range(100):
        pids = [pid for pid in namespace_pids(inodes) if pid != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.01)
    return killed


@dataclass(frozen=True)
class Host:
    """One host of the lab: its name (and other names), address, namespace and bridge port."""

    name: str
    address: str
    aliases: tuple[str, ...]
    netns: str  # the namespace's name inside the lab
    veth: str  # the host's port on the bridge (the lab side of its eth0)
    inode: int  # the network namespace's inode, as /proc/PID/ns/net shows it


class LabError(RuntimeError):
    """The lab could not be made or a command in it failed."""


class Lab:
    """A private network of hosts; see the module's docstring. ``directory`` receives the hosts file."""

    def __init__(self, directory: str) -> None:
        self.hosts: dict[str, Host] = {}
        self.hosts_file = os.path.join(directory, "hosts")
        self._lock = threading.Lock()
        self._userns = os.geteuid() != 0
        self._holder = subprocess.Popen(
            ["unshare", *_namespace_flags(), "--", sys.executable, "-I", "-S", os.path.abspath(__file__),
             "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)  # not in our process group: it must outlive a kill of the group
        self.pid = self._holder.pid
        self._reply()  # "ready", or the error that stopped the holder

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _reply(self) -> dict:
        line = self._holder.stdout.readline() if self._holder.stdout else b""
        if not line:
            self._holder.wait()
            raise LabError(f"the lab's holder exited with code {self._holder.returncode}")
        reply = json.loads(line)
        if reply.get("error"):
            raise LabError(reply["error"])
        return reply

    def ip(self, *args: str) -> None:
        """Run ``ip ARGS`` in the lab (the bridge's namespace); raise :class:`LabError` if it fails."""
        with self._lock:
            if self._holder.stdin is None or self._holder.stdin.closed:
                raise LabError("the lab is closed")
            self._holder.stdin.write(json.dumps(["ip", *args]).encode() + b"\n")
            self._holder.stdin.flush()
            self._reply()

    def _path(self, netns: str) -> str:
        """The namespace's file, seen from outside the lab through the holder's mount namespace."""
        return f"/proc/{self.pid}/root/run/netns/{netns}"

    def add_host(self, name: str, address: str, aliases: Sequence[str] = ()) -> Host:
        """A new host on the bridge, ``lo`` and ``eth0`` up; the hosts file maps its names to ``address``."""
        if name in self.hosts:
            raise LabError(f"host {name!r} exists already")
        index = len(self.hosts)
        netns, veth = f"h{index}", f"v{index}"
        self.ip("netns", "add", netns)
        self.ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        self.ip("link", "set", veth, "master", BRIDGE, "up")
        self.ip("-n", netns, "addr", "add", f"{address}/{PREFIX_LENGTH}", "dev", "eth0")
        self.ip("-n", netns, "link", "set", "eth0", "up")
        self.ip("-n", netns, "link", "set", "lo", "up")
        host = Host(name, address, tuple(aliases), netns, veth, os.stat(self._path(netns)).st_ino)
        self.hosts[name] = host
        self._write_hosts_file()
        return host

    def _write_hosts_file(self) -> None:
        """Rewritten in place (same inode): hosts already running see hosts added later."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{h.address}\t{' '.join((h.name, *h.aliases))}" for h in self.hosts.values()]
        with open(self.hosts_file, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run in host ``name``: its network, its hostname, its ``/etc/hosts``.

        No process is added in between: the command's PID is the started process's PID.
        """
        from launcher.simulate import become  # not at the top: the holder runs this file with -I -S

        host = self.hosts[name]
        user = [f"--user=/proc/{self.pid}/ns/user", "--preserve-credentials"] if self._userns else []
        return list(become.command(argv, hostname=host.name, binds=[(self.hosts_file, "/etc/hosts")],
                                   prefix=["nsenter", *user, f"--net={self._path(host.netns)}", "--",
                                           "unshare", "--uts", "--mount", "--"]))

    def pids(self, name: str) -> list[int]:
        """The machine's PIDs of every process running in host ``name``."""
        return namespace_pids([self.hosts[name].inode])

    def partition(self, name: str) -> None:
        """Take the host's link down: its packets vanish both ways, no reset reaches anyone."""
        self.ip("link", "set", self.hosts[name].veth, "down")

    def heal(self, name: str) -> None:
        """Bring the host's link back up."""
        self.ip("link", "set", self.hosts[name].veth, "up")

    def poweroff(self, name: str) -> list[int]:
        """A power loss: the link goes down (peers hear nothing), then every process of the host is
        SIGKILLed at once. Returns the PIDs killed."""
        self.partition(name)
        return kill_namespaces([self.hosts[name].inode])

    def close(self) -> None:
        """Kill every process of every host and remove the lab (the holder does it and exits)."""
        with self._lock:
            if self._holder.stdin is not None and not self._holder.stdin.closed:
                try:
                    self._holder.stdin.write(b'["close"]\n')  # at once: no LINGER
                    self._holder.stdin.close()
                except BrokenPipeError:
                    pass
        try:
            self._holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._holder.kill()
            self._holder.wait()
        if self._holder.stdout is not None:
            self._holder.stdout.close()


# -- the holder: runs inside the lab's namespaces ------------------------------------------------------
def _answer(reply: dict) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def _run(argv: Sequence[str]) -> Optional[str]:
    """Run a command; None if it succeeded, else a one-line error."""
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return f"{' '.join(argv)}: {(done.stderr.strip() or f'exit code {done.returncode}').splitlines()[-1]}"


def _hold() -> int:
    """The holder: set the lab up, run the ``ip`` commands it is sent; at ``close`` or end of input
    kill every process of every host and exit (which removes the namespaces, veths and bridge)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only end of input ends the lab
    for argv in (["mount", "-n", "-t", "tmpfs", "-o", "mode=755", "lab", "/run"],
                 ["ip", "link", "set", "lo", "up"], ["ip", "link", "add", BRIDGE, "type", "bridge"],
                 ["ip", "link", "set", BRIDGE, "up"]):
        error = _run(argv)
        if error:
            _answer({"error": f"cannot make the lab: {error}"})
            return 1
    _answer({"ready": True})
    closed = False
    for line in sys.stdin:
        argv = json.loads(line)
        if argv == ["close"]:
            closed = True
            break
        _answer({"error": _run(argv) if argv[:1] == ["ip"] else f"not an ip command: {argv!r}"})
    netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    inodes = [os.stat(os.path.join("/run/netns", n)).st_ino for n in netns]
    until = time.monotonic() + (0.0 if closed else LINGER)
    while time.monotonic() < until and namespace_pids(inodes):
        time.sleep(0.05)
    kill_namespaces(inodes)
    for name in netns:
        _run(["ip", "netns", "delete", name])
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["hold"]:
        sys.exit(_hold())
    sys.exit(f"usage: {sys.argv[0]} hold")
