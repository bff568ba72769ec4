"""How a simulated host's first process becomes the host: the one place that knows it.

A real node has its own host name, its own ``/etc/hosts`` and, on SageMaker, its own ``/opt/ml``.
A simulated host gets them in namespaces of its own (``unshare --uts --mount``, or a lab host that
:mod:`launcher.simulate.netns` entered): this file, run as a script there, sets the host name, binds
files or directories over the machine's (only inside that mount namespace: the machine's files are
never touched) and then ``exec``\\ s the host's program, so the host's PID is the program's PID and
no shell sits in between (a shell would drop variables whose names are not identifiers, like
SageMaker's ``SM_HP_STEP-SLEEP``)::

    python -I -S become.py [--hostname NAME] [--bind SRC DST]... [--opt TREE STAGE] -- PROGRAM ARGS...

``--opt TREE STAGE``: ``STAGE`` becomes the new ``/opt``, every entry of the machine's ``/opt`` bound
in again and ``TREE`` as ``ml`` (SageMaker's drivers hard-code ``/opt/ml``).

Used by the lab (:meth:`launcher.simulate.netns.Lab.command`), the PBS builder (a host name per host)
and the SageMaker SDK v3 builder (its ``/opt/ml``). Standard library only.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from typing import Callable, Optional

ADDRESS = "127.0.0.1"
MS_BIND, MS_REC = 4096, 16384


def command(program: Sequence[str], hostname: Optional[str] = None, binds: Sequence[tuple[str, str]] = (),
            opt: Optional[tuple[str, str]] = None, prefix: Sequence[str] = ()) -> tuple[str, ...]:
    """``program`` started as a host: ``prefix`` (the namespaces, e.g. ``unshare --uts --mount``), then
    this script with the host's name, its bind mounts and its ``/opt`` (see the module's docstring)."""
    argv = [*prefix, sys.executable, "-I", "-S", os.path.abspath(__file__)]
    if hostname is not None:
        argv += ["--hostname", hostname]
    for source, target in binds:
        argv += ["--bind", source, target]
    if opt is not None:
        argv += ["--opt", *opt]
    return (*argv, "--", *program)


def unshare_forms(*flags: str) -> tuple[tuple[str, ...], ...]:
    """The ``unshare`` commands that give a process the namespaces ``flags`` name: root's first, then
    the same in a user namespace (unprivileged user namespaces)."""
    return (("unshare", *flags), ("unshare", "--user", "--map-root-user", *flags))


def permitted_commands(commands: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """``unshare`` forms to try, the first (root's) only as root: the later ones use a user namespace."""
    return [c for i, c in enumerate(commands) if i > 0 or os.geteuid() == 0]


def probe_succeeds(argv: Sequence[str]) -> bool:
    """True if ``argv`` runs and exits 0 within 30 s (a namespace form permitted here)."""
    import subprocess  # only when a builder probes

    try:
        return subprocess.run(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def first_permitted(forms: Sequence[tuple[str, ...]], works: Callable[[tuple[str, ...]], bool]) -> \
        Optional[tuple[str, ...]]:
    """The first of ``forms`` permitted here for which ``works(form)`` holds (a probe), else None."""
    return next((form for form in permitted_commands(forms) if works(form)), None)


def hosts_file_text(machine: str, hosts: Sequence[str]) -> str:
    """A host's ``/etc/hosts``: every host of the job at 127.0.0.1, then ``machine`` (this machine's
    ``/etc/hosts`` text; the first line naming a host wins)."""
    return "".join(f"{ADDRESS} {host}\n" for host in hosts) + machine


def machine_hosts() -> str:
    """This machine's ``/etc/hosts`` text ("" if unreadable or not a regular file; at most 16 MiB,
    never blocking: this module runs standalone, so it does what ``launcher.filereader`` does)."""
    try:
        fd = os.open("/etc/hosts", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, 16 << 20).decode("utf-8", "replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


# -- run as a script: inside the host's namespaces ------------------------------------------------------
def _check_own(kind: str, flag: str) -> None:
    """Refuse to change the machine: ``flag`` needs a ``kind`` namespace of its own, other than its
    parent's (the one that ran ``unshare``) and PID 1's. A namespace link this process may not read
    belongs to another user namespace, where the change could not reach the machine anyway."""
    def same(pid: int) -> bool:
        try:
            return os.readlink(f"/proc/self/ns/{kind}") == os.readlink(f"/proc/{pid}/ns/{kind}")
        except OSError:
            return False
    if same(os.getppid()) or same(1):
        raise ValueError(f"{flag} outside a {kind} namespace of its own would change the machine's; start "
                         f"this under 'unshare --{'mount' if kind == 'mnt' else kind}'")


def _bind(source: str, target: str) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
        raise OSError(ctypes.get_errno(), f"cannot bind {source} on {target}: {os.strerror(ctypes.get_errno())}")


def _stage_opt(tree: str, stage: str) -> None:
    """``stage`` becomes ``/opt``: the machine's entries bound in again, ``tree`` as ``ml``."""
    os.makedirs(stage, exist_ok=True)
    for name in sorted(os.listdir("/opt")):
        source, target = os.path.join("/opt", name), os.path.join(stage, name)
        if name == "ml" or os.path.lexists(target):
            continue
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
            continue
        if os.path.isdir(source):
            os.mkdir(target)
        else:
            open(target, "w").close()
        _bind(source, target)
    os.makedirs(os.path.join(stage, "ml"), exist_ok=True)
    _bind(tree, os.path.join(stage, "ml"))
    _bind(stage, "/opt")


def main(argv: Sequence[str]) -> int:
    """Become the host ``argv`` describes, then ``exec`` its program (returns only on failure)."""
    args = list(argv)
    split = args.index("--") if "--" in args else len(args)
    options, program = args[:split], args[split + 1:]
    name = "?"
    try:
        if not program:
            raise ValueError("no program after --")
        while options:
            flag = options.pop(0)
            if flag == "--hostname":
                import socket

                name = options.pop(0)
                _check_own("uts", flag)
                socket.sethostname(name)
            elif flag == "--bind":
                _check_own("mnt", flag)
                _bind(options.pop(0), options.pop(0))
            elif flag == "--opt":
                _check_own("mnt", flag)
                _stage_opt(options.pop(0), options.pop(0))
            else:
                raise ValueError(f"unknown option {flag!r}")
    except (OSError, ValueError, IndexError) as exc:
        sys.stderr.write(f"simulated host {name}: {exc or 'an option lacks its value'}\n")
        return 1
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        sys.stderr.write(f"simulated host {name}: cannot start {program[0]!r}: {exc}\n")
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
