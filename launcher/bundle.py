"""The source bundle a SageMaker estimator uploads: the launcher, one training script, its helper.

``stage_bundle("train_scripts/train_resnet.py", "build/bundle")`` writes::

    build/bundle/
        launch.py          # the estimator's entry_point: runs launcher.cli.main()
        launcher/          # this package, .py files only
        train_resnet.py    # the training script
        ddp_utils.py       # the helper module, when it stands beside the script

Nothing else: no ``requirements.txt`` (AWS's toolkit would pip-install it, reinstalling torch or the
SDK in the container), no caches, no notebooks, no data.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Optional, Sequence

ENTRY_POINT = "launch.py"
HELPER_MODULE = "ddp_utils.py"
_SHIM = '''"""SageMaker entry point: start the DDP launcher (see launcher/cli.py)."""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
'''


def package_dir() -> str:
    """The directory of the ``launcher`` package being run."""
    return os.path.dirname(os.path.abspath(__file__))


def stage_bundle(script: str, dest: str, extra_files: Sequence[str] = ()) -> str:
    """Write the bundle for ``script`` into ``dest`` (created, must be empty); returns ``dest``.

    ``extra_files`` are copied beside the script (for modules of the user's own it imports).
    """
    if not os.path.isfile(script):
        raise FileNotFoundError(f"training script not found: {script!r}")
    os.makedirs(dest, exist_ok=True)
    if os.listdir(dest):
        raise FileExistsError(f"bundle directory is not empty: {dest!r}")
    with open(os.path.join(dest, ENTRY_POINT), "w", encoding="utf-8") as fh:
        fh.write(_SHIM)
    shutil.copytree(package_dir(), os.path.join(dest, "launcher"),
                    ignore=lambda _dir, names: [n for n in names
                                                if not n.endswith(".py") and n != "platforms"])
    helper = os.path.join(os.path.dirname(os.path.abspath(script)), HELPER_MODULE)
    for path in [script, *([helper] if os.path.isfile(helper) else []), *extra_files]:
        shutil.copy2(path, os.path.join(dest, os.path.basename(path)))
    return dest


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m launcher bundle SCRIPT --out DIR``: stage the bundle and list what it holds."""
    parser = argparse.ArgumentParser(prog="ddp-launcher bundle", description=__doc__.splitlines()[0])
    parser.add_argument("script", help="the training script")
    parser.add_argument("--out", required=True, help="an empty or new directory")
    parser.add_argument("--extra", action="append", default=[], help="another file to ship beside it")
    args = parser.parse_args(argv)
    try:
        dest = stage_bundle(args.script, args.out, args.extra)
    except (FileNotFoundError, FileExistsError) as exc:
        sys.stderr.write(f"ddp-launcher bundle: error: {exc}\n")
        return 2
    for root, _dirs, files in sorted(os.walk(dest)):
        for name in sorted(files):
            print(os.path.relpath(os.path.join(root, name), dest))
    print(f"entry_point={ENTRY_POINT!r}, source_dir={dest!r}", file=sys.stderr)
    return 0
