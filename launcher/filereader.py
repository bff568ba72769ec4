"""Reading the files the launcher and ``simulate`` are given: regular files only, bounded, never blocking.

Every file a platform names (``resourceconfig.json``, ``PBS_NODEFILE``, OCI's node metadata file, ...)
is read through :func:`read_bounded`: it is opened with ``O_NONBLOCK`` (opening a FIFO with no writer
then returns at once instead of waiting for ever), checked with ``fstat`` to be a regular file (a
FIFO, a device such as ``/dev/zero`` or ``/dev/urandom``, a socket or a directory is refused), its
size is checked before a byte is read (a 1 GB file, sparse or not, is refused at once), and at most
``limit + 1`` bytes are read (a file that grows while it is read is refused too).
"""

from __future__ import annotations

import os
import stat
from typing import Optional

from launcher.errors import ConfigError, shown

MAX_CONFIG_BYTES = 16 << 20  # a configuration file larger than this is not one (10,000 hosts take 200 kB)
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words (``a FIFO``, ``a character device``...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_bounded(path: str, limit: int, what: str, missing_ok: bool = False) -> Optional[bytes]:
    """The bytes of the regular file ``path``, at most ``limit`` of them; never blocks.

    ``what`` names the file in the one-line :class:`ConfigError` raised for anything else: a file
    that is not regular, larger than ``limit``, or unreadable. With ``missing_ok``, a file that does
    not exist gives None.
    """
    name = f"{what} {shown(path)}" if what else shown(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise ConfigError(f"cannot read {name}: it does not exist") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        try:
            mode = os.stat(path).st_mode
        except (OSError, ValueError):
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):  # a socket cannot even be opened (ENXIO)
            raise ConfigError(f"{name} is {kind_of(mode)}, not a regular file") from None
        raise ConfigError(f"cannot read {name}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{name} is {kind_of(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise ConfigError(f"{name} is larger than {_size(limit)} ({info.st_size} bytes): not an input file")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise ConfigError(f"cannot read {name}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise ConfigError(f"{name} is larger than {_size(limit)} (it grew while read): not an input file")
    return b"".join(chunks)


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 and not limit % (1 << 20) else f"{limit} bytes"
