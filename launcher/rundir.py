"""The run directory: one private directory per launch under ``$TMPDIR``, and the clean-up of dead ones.

``$TMPDIR/ddp-launcher-<pid>-<16 hex digits>`` holds what the launcher and its workers share during a run:
the workers' exit records (``exits/``), their progress-beat socket and the logs. It is new for every run
(an existing one is never reused), private (0700), and locked while the launcher runs, so that
systemd-tmpfiles' aging leaves it alone. The launcher removes it at its end; its watchdog does if the
launcher is killed; :func:`remove_dead_run_dirs` does for launchers killed together with their watchdog.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Mapping, Sequence

from launcher.errors import ConfigError, shown

PREFIX = "ddp-launcher"


def path_for(environ: Mapping[str, str], token: str) -> str:
    """Where the run directory of the run ``token`` (``<pid>-<16 hex digits>``) goes: under ``$TMPDIR``, else /tmp."""
    return os.path.join(environ.get("TMPDIR") or "/tmp", f"{PREFIX}-{token}")


def check_tmpdir(environ: Mapping[str, str]) -> None:
    """``TMPDIR`` (else /tmp), where the run directory goes, must be a directory this process can write."""
    path = environ.get("TMPDIR") or "/tmp"
    if not os.path.isdir(path):
        raise ConfigError(f"TMPDIR is not a directory: {shown(path)}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"TMPDIR is not writable: {shown(path)}")


def make_run_dir(path: str) -> int:
    """Create the run directory, private (0700) and new: an existing one is never reused; and its
    ``exits`` directory, where the workers record the code they asked for (:mod:`launcher.bootstrap`).
    A full disk (less than :data:`launcher.logspace.FREE_MIN` free) is refused: torchrun could not write there.

    Returns a descriptor of the directory that holds a shared BSD lock on it (close it once the directory is
    removed): systemd-tmpfiles' aging skips a locked directory and everything below it (tmpfiles.d(5)), so a
    job that outlives ``/tmp``'s cleanup age (10 days on Fedora and RHEL) keeps its workers' logs, their
    beat socket and exit records. The descriptor is close-on-exec: torchrun does not inherit it."""
    from launcher.logspace import disk_full_note

    full = disk_full_note(os.path.dirname(path))
    if full:
        raise ConfigError(full[:300])
    try:
        os.mkdir(path, 0o700)
        os.mkdir(os.path.join(path, "exits"), 0o700)
        held = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise ConfigError(f"cannot create the run directory {path!r} (TMPDIR): "
                          f"{exc.strerror or exc}"[:300]) from None
    with contextlib.suppress(OSError):  # a file system without locks: only the cleaner's protection is lost
        fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
    return held


def remove_dead_run_dirs(tmpdir: str, pids: Sequence[int]) -> list[str]:
    """Remove the run directories (``tmpdir/ddp-launcher-<pid>-<16 hex digits>``) that launchers ``pids``
    left when they were killed with everything of theirs, their watchdog included (a host's power loss in
    simulate); returns what was removed. A directory whose lock is held (:func:`make_run_dir`: a launcher
    running now with a reused pid) is left alone."""
    wanted = {str(pid) for pid in pids}
    name = re.compile(rf"{PREFIX}-(\d+)-[0-9a-f]{{16}}")
    try:
        entries = os.listdir(tmpdir)
    except OSError:
        return []
    removed = []
    for entry in sorted(entries):
        found = name.fullmatch(entry)
        if found is None or found.group(1) not in wanted:
            continue
        path = os.path.join(tmpdir, entry)
        try:
            held = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a running launcher holds it
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(held)
    return removed
