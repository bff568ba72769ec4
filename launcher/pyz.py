"""The launcher as one file: ``ddp-launcher zipapp --out ddp-launcher.pyz`` (and ``make dist``).

The zipapp holds the whole ``launcher`` package (``simulate`` included) and a ``__main__.py`` that parses
on every Python from 2.7 on. Started as ``python ddp-launcher.pyz [options] train.py [args...]``, it:

1. refuses a Python older than 3.9 in one line that names it (exit code 2, see :mod:`launcher.entry`);
2. unpacks the package once into a cache directory named by the build's hash,
   ``$XDG_CACHE_HOME/ddp-launcher/<hash>`` (default ``~/.cache``), else ``$TMPDIR/ddp-launcher-<uid>/<hash>``,
   so that torchrun's workers and simulated hosts run its files as plain files; every later run of the
   same build (on any host that shares the directory) uses that copy, and a new build gets a new one;
3. runs the launcher from there; a Python without torch gets one line that names it (exit code 2).

The archive is reproducible: the same package gives the same bytes (fixed dates, sorted names).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from typing import Optional

from launcher import streams
from launcher.platforms.sagemaker.bundle import PACKAGE, package_dir, package_files

DEFAULT_OUT = "ddp-launcher.pyz"
SHEBANG = b"#!/usr/bin/env python3\n"
STAMP = (1980, 1, 1, 0, 0, 0)  # the zip format's earliest date: the same bytes on every build
MARKER = ".unpacked"  # written last into an unpacked copy: the copy is whole
_MAIN = '''"""ddp-launcher as one file: python ddp-launcher.pyz [options] train.py [args...] (see --help).

Written by ``ddp-launcher zipapp`` (launcher/pyz.py). Parses on Python 2.7 and later: an old Python is
told so in one line. The package is unpacked once per build into a cache directory (see launcher/pyz.py).
"""

import os
import sys

BUILD = "%(build)s"
MARKER = "%(marker)s"


def fail(message):
    sys.stderr.write("ddp-launcher: error: " + message + "\\n")
    sys.exit(2)


def cache_roots():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    yield os.path.join(base, "ddp-launcher")
    import tempfile
    yield os.path.join(tempfile.gettempdir(), "ddp-launcher-" + str(os.getuid()))


def unpack(archive, root):
    import shutil
    import tempfile
    import zipfile
    target = os.path.join(root, BUILD)
    if os.path.isfile(os.path.join(target, MARKER)):
        return target
    os.makedirs(root, 0o700, exist_ok=True)  # another host may make it at the same moment
    if os.stat(root).st_uid != os.getuid():
        raise OSError("owned by another user")
    staging = tempfile.mkdtemp(prefix=".unpacking-", dir=root)
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(staging, [n for n in zf.namelist() if n.startswith("launcher/")])
        open(os.path.join(staging, MARKER), "w").close()
        os.rename(staging, target)
    except OSError:
        if not os.path.isfile(os.path.join(target, MARKER)):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when renamed; another copy was first
    return target


def main():
    archive = os.path.dirname(os.path.abspath(__file__))
    from launcher.entry import too_old  # from the archive: this file parses on every Python
    error = too_old()
    if error:
        sys.stderr.write(error + "\\n")
        sys.exit(2)
    problems = []
    for root in cache_roots():
        try:
            target = unpack(archive, root)
            break
        except OSError as exc:
            problems.append(root + ": " + str(exc.strerror or exc))
    else:
        fail("cannot unpack the launcher into a cache directory (" + "; ".join(problems) + ")")
    sys.path[:] = [target] + [p for p in sys.path if os.path.abspath(p) != archive]
    for name in [m for m in sys.modules if m == "launcher" or m.startswith("launcher.")]:
        del sys.modules[name]  # imported again from the unpacked files
    from launcher.entry import main as launch
    sys.exit(launch())


if __name__ == "__main__":
    main()
'''


def build_id(files: dict[str, bytes]) -> str:
    """The build's hash: the package's file names and contents (the cache directory's name)."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()[:16]


def package_contents() -> dict[str, bytes]:
    """``launcher/<path>`` -> bytes for every ``.py`` file of the package being run, ``simulate`` included."""
    root = package_dir()
    contents = {}
    for rel in package_files(root, skip=frozenset()):
        with open(os.path.join(root, rel), "rb") as fh:
            contents[f"{PACKAGE}/{rel.replace(os.sep, '/')}"] = fh.read()
    return contents


def write_pyz(out: str) -> str:
    """Write the zipapp to ``out`` (replaced whole, never half written; executable); returns its build id.
    Raises ``OSError`` when ``out`` is a directory or its directory does not exist."""
    if os.path.isdir(out):
        raise IsADirectoryError(21, "is a directory", out)
    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory):
        raise FileNotFoundError(2, "no such directory", directory)
    files = package_contents()
    build = build_id(files)
    files["__main__.py"] = (_MAIN % {"build": build, "marker": MARKER}).encode()
    fd, staging = tempfile.mkstemp(prefix=".ddp-launcher-", suffix=".pyz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(SHEBANG)
            with zipfile.ZipFile(fh, "w", zipfile.ZIP_DEFLATED) as zf:
                for name in sorted(files):
                    info = zipfile.ZipInfo(name, STAMP)
                    info.external_attr = 0o644 << 16
                    info.compress_type = zipfile.ZIP_DEFLATED
                    zf.writestr(info, files[name])
        os.chmod(staging, 0o755)
        os.replace(staging, out)
    except BaseException:
        os.unlink(staging)
        raise
    return build


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2, as for every other bad input
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ddp-launcher zipapp [--out FILE]``: write the zipapp and say how to run it."""
    parser = _Parser(prog="ddp-launcher zipapp", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"the file to write (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    try:
        build = write_pyz(args.out)
    except OSError as exc:
        streams.write(sys.stderr, f"{parser.prog}: error: --out {args.out!r}: {exc.strerror or exc}\n")
        return 2
    size = os.path.getsize(args.out)
    streams.write(sys.stdout, f"{args.out}\n")
    streams.write(sys.stderr, f"wrote {args.out} ({size // 1024} KiB, build {build}): run it as "
                              f"python {args.out} [options] train.py [args...] with a Python 3.9+ that has torch\n")
    return 0
