"""Writing a small file so that readers see the old one or the whole new one: never empty, never partial.

The failure report and the outcome file are read by platforms, schedulers and retry policies while
(or right after) the launcher writes them. :func:`replace_file` writes a temporary file in the same
directory, fsyncs it and renames it over the path. A path that cannot be replaced but exists (a
bind-mounted file: rename fails with EBUSY) is overwritten in place, never truncated first.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional


def _write_in_place(path: str, data: bytes) -> None:
    """Overwrite an existing file that cannot be replaced (a bind-mounted file): never truncated first."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {path}")
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def replace_file(path: str, data: bytes, prefix: str) -> Optional[str]:
    """Write ``data`` to ``path`` atomically (temporary files are named ``prefix``...); never raises.

    Returns None when written, else why not (one line).
    """
    import tempfile  # only at the end of a run: costs milliseconds at start-up

    try:
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=directory)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, ValueError) as exc:
        if not os.path.isfile(path):
            return f"{type(exc).__name__}: {exc}"[:300]
        try:
            _write_in_place(path, data)
        except OSError as again:
            return f"{type(exc).__name__}: {exc}; in place: {type(again).__name__}: {again}"[:300]
    return None
