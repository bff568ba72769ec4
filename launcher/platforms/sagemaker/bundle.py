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
before anything is written.
"""

from __future__ import annotations

import argparse
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


def stage_bundle(script: str, dest: str, extra_files: Sequence[str] = ()) -> str:
    """Write the bundle for ``script`` into ``dest`` (created, must be empty); returns ``dest``.

    ``extra_files`` are copied beside the script (for modules of the user's own it imports).
    Raises ``FileNotFoundError`` (a missing script or extra), ``FileExistsError`` (``dest`` not
    empty) or :class:`BundleError` (names refused) before writing anything.
    """
    copies = _plan_copies(script, extra_files)
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise FileExistsError(f"bundle directory is a file: {dest!r}")
    if os.path.isdir(dest) and os.listdir(dest):
        raise FileExistsError(f"bundle directory is not empty: {dest!r}")
    if _inside(dest, package_dir()):
        raise BundleError(f"bundle directory {dest!r} is inside the launcher package it copies")
    modules = package_files()
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, ENTRY_POINT), "w", encoding="utf-8") as fh:
        fh.write(_SHIM)
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
    parser.add_argument("--out", required=True, help="an empty or new directory")
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
