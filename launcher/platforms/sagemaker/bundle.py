"""The source bundle a SageMaker estimator uploads: the launcher, one training script, its helper.

``stage_bundle("train_scripts/train_resnet.py", "build/bundle")`` writes::

    build/bundle/
        launch.py          # the estimator's entry_point: runs launcher.cli.main()
        launcher/          # this package, .py files only (sub-packages included, no caches; not
                           # simulate/, which runs on a workstation, never inside a job)
        train_resnet.py    # the training script
        ddp_utils.py       # the helper module, when it stands beside the script

The same bundle serves both SDK lines: SDK 2.x as ``PyTorch(entry_point="launch.py", source_dir=...)``
(uploaded as ``sourcedir.tar.gz``, unpacked into ``/opt/ml/code``), SDK 3.x as ``ModelTrainer(source_code=
SourceCode(source_dir=..., entry_script="launch.py"))`` (uploaded as loose files into the ``code``
channel, ``/opt/ml/input/data/code``, where the SDK's driver runs ``python launch.py``).

Nothing else: no ``requirements.txt`` (AWS's toolkit would pip-install it, reinstalling torch or the
SDK in the container), no ``setup.py`` (the toolkit would ``pip install`` the whole bundle as a
package), no caches, no notebooks, no data. Such names are refused, as are two files with the same
name and names that would hide ``launch.py`` or the ``launcher`` package. Everything is checked
before anything is written. Staging again into the same directory (a notebook cell run twice) replaces
the earlier bundle: ``launch.py`` names the files it was staged with, and a directory holding anything
else is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Optional

from launcher import streams

ENTRY_POINT = "launch.py"
PACKAGE = "launcher"
NOT_SHIPPED = frozenset({"simulate"})  # sub-packages that never run inside a job
HELPER_MODULE = "ddp_utils.py"
# Files AWS's toolkit acts on when they are in the code directory: requirements.txt is
# pip-installed; a setup.py makes the code directory a package that is pip-installed.
INSTALL_FILES = frozenset({"requirements.txt", "setup.py", "setup.cfg", "pyproject.toml"})
RESERVED = frozenset({ENTRY_POINT, PACKAGE, PACKAGE + ".py"})
STAGED = "# staged by ddp-launcher bundle beside launch.py and launcher/: "  # + the JSON list of the other files
_SHIM = '''"""SageMaker entry point: start the DDP launcher (see launcher/cli.py)."""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
'''


class BundleError(ValueError):
    """The bundle cannot be staged as asked (bad names, missing files); nothing was written."""


def package_dir() -> str:
    """The directory of the ``launcher`` package being run (this file is launcher/platforms/sagemaker/)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def package_files(root: Optional[str] = None, skip: frozenset[str] = NOT_SHIPPED) -> list[str]:
    """The package's ``.py`` files relative to ``root`` (default: :func:`package_dir`), sorted.

    Only directories that are packages (hold ``__init__.py``) are entered; caches, hidden
    directories and the ``skip`` sub-packages (default :data:`NOT_SHIPPED`) are skipped.
    """
    root = root or package_dir()
    found: list[str] = []
    for current, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__"))
                         and not (current == root and d in skip)
                         and os.path.isfile(os.path.join(current, d, "__init__.py")))
        found.extend(os.path.relpath(os.path.join(current, name), root)
                     for name in files if name.endswith(".py"))
    return sorted(found)


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def _plan_copies(script: str, extra_files: Sequence[str]) -> list[tuple[str, str]]:
    """``(source, name in the bundle)`` for the script, its helper and the extras; checks them."""
    if not os.path.isfile(script):
        raise FileNotFoundError(f"training script not found: {script!r}")
    helper = os.path.join(os.path.dirname(os.path.abspath(script)), HELPER_MODULE)
    sources = [script]
    if os.path.isfile(helper) and os.path.basename(script) != HELPER_MODULE:
        sources.append(helper)
    for path in extra_files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"extra file not found (or not a file): {path!r}")
        sources.append(path)
    copies: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    for path in sources:
        name = os.path.basename(path)
        if not os.access(path, os.R_OK):
            raise BundleError(f"cannot read {path!r}")
        if name in RESERVED:
            raise BundleError(f"{path!r} would replace the bundle's own {name!r}; rename it")
        if name in INSTALL_FILES:
            raise BundleError(f"{path!r}: a {name} in the bundle makes AWS's toolkit pip-install "
                              "it in the container (reinstalling torch or the SDK); the container "
                              "image must already hold the dependencies")
        if name in seen:
            raise BundleError(f"two files named {name!r} in the bundle: {seen[name]!r} and {path!r}")
        seen[name] = path
        copies.append((path, name))
    return copies


def staged_before(dest: str) -> list[str]:
    """The names an earlier :func:`stage_bundle` wrote at the top of ``dest`` (``launch.py``, ``launcher``
    and the files it named in ``launch.py``). Raises ``FileExistsError`` when ``dest`` holds anything else:
    a directory that is not such a bundle, or one with files added by hand, is never emptied."""
    entry = os.path.join(dest, ENTRY_POINT)
    names: Optional[list[str]] = None
    if os.path.isfile(entry) and not os.path.islink(entry):
        with open(entry, encoding="utf-8", errors="replace") as fh:
            last = fh.read(65536).rstrip("\n").rsplit("\n", 1)[-1]
        if last.startswith(STAGED):
            try:
                names = json.loads(last[len(STAGED):])
            except ValueError:
                names = None
    if not isinstance(names, list) or not all(isinstance(n, str) and os.path.basename(n) == n for n in names):
        raise FileExistsError(f"bundle directory is not empty and holds no bundle staged by ddp-launcher: {dest!r}")
    ours = {ENTRY_POINT, PACKAGE, *names}
    others = sorted(set(os.listdir(dest)) - ours)
    if others or not os.path.isdir(os.path.join(dest, PACKAGE)) or os.path.islink(os.path.join(dest, PACKAGE)) \
            or any(os.path.isdir(os.path.join(dest, n)) for n in names):
        raise FileExistsError(f"bundle directory {dest!r} holds files that ddp-launcher bundle did not stage "
                              f"there ({', '.join(map(repr, others[:5])) or 'launcher/ replaced'}); not replaced")
    return [n for n in sorted(ours) if os.path.lexists(os.path.join(dest, n))]


def stage_bundle(script: str, dest: str, extra_files: Sequence[str] = ()) -> str:
    """Write the bundle for ``script`` into ``dest`` (new, empty, or a bundle staged before); returns ``dest``.

    ``extra_files`` are copied beside the script (for modules of the user's own it imports). A bundle
    that this function staged in ``dest`` before (a notebook cell run again) is replaced whole; a
    directory holding anything else is refused. Raises ``FileNotFoundError`` (a missing script or
    extra), ``FileExistsError`` (``dest`` a file, or holding what was not staged) or :class:`BundleError`
    (names refused) before writing or removing anything.
    """
    copies = _plan_copies(script, extra_files)
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise FileExistsError(f"bundle directory is a file: {dest!r}")
    if _inside(dest, package_dir()):
        raise BundleError(f"bundle directory {dest!r} is inside the launcher package it copies")
    previous = staged_before(dest) if os.path.isdir(dest) and os.listdir(dest) else []
    modules = package_files()
    for name in previous:  # the earlier bundle, replaced whole
        path = os.path.join(dest, name)
        if name == PACKAGE:
            shutil.rmtree(path)
        else:
            os.unlink(path)
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, ENTRY_POINT), "w", encoding="utf-8") as fh:
        fh.write(_SHIM + STAGED + json.dumps([name for _path, name in copies]) + "\n")
    for rel in modules:
        target = os.path.join(dest, PACKAGE, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(package_dir(), rel), target)
    for path, name in copies:
        shutil.copyfile(path, os.path.join(dest, name))
    return dest


def list_bundle(dest: str) -> list[str]:
    """Every file under ``dest``, as sorted relative paths with ``/`` separators."""
    return sorted(os.path.relpath(os.path.join(root, name), dest).replace(os.sep, "/")
                  for root, _dirs, files in os.walk(dest) for name in files)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2, as for every other bad input
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m launcher bundle SCRIPT --out DIR``: stage the bundle and list what it holds."""
    parser = _Parser(prog="ddp-launcher bundle", description=__doc__.splitlines()[0])
    parser.add_argument("script", help="the training script")
    parser.add_argument("--out", required=True, help="a new or empty directory, or an earlier bundle (replaced)")
    parser.add_argument("--extra", action="append", default=[], help="another file to ship beside it")
    args = parser.parse_args(argv)
    try:
        dest = stage_bundle(args.script, args.out, args.extra)
    except (BundleError, OSError) as exc:
        text = str(exc) if isinstance(exc, BundleError) or exc.filename is None else \
            f"{exc.strerror}: {exc.filename!r}"
        streams.write(sys.stderr, f"{parser.prog}: error: {' '.join(text.split())}\n")
        return 2
    streams.write(sys.stdout, "".join(f"{name}\n" for name in list_bundle(dest)))
    streams.write(sys.stderr, f"entry_point={ENTRY_POINT!r}, source_dir={dest!r}\n")
    return 0
