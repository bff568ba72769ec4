"""Notebooks are committed without outputs, so that a diff shows only what people wrote.

    python tools/check_notebooks.py          # check every notebook git would commit; exit 1 naming problems
    python tools/check_notebooks.py --fix    # strip outputs, execution counts and run metadata in place
    python tools/check_notebooks.py a.ipynb  # only these files

Checked: no cell outputs, no execution counts, no per-run metadata (``execution`` timings that
nbclient/papermill add, ``widgets`` state), a valid nbformat 4 document, and the text exactly as
``nbformat`` writes it (indent 1, sorted keys), which is also how Jupyter saves it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Optional

import nbformat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_CELL_METADATA = ("execution", "papermill", "ExecuteTime")
RUN_NOTEBOOK_METADATA = ("widgets", "papermill")


def committed_notebooks(repo: str = REPO) -> list[str]:
    """Notebooks git tracks or would add (untracked and not ignored), as absolute paths."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--",
                          "*.ipynb"], cwd=repo, capture_output=True, text=True, check=True).stdout
    paths = (os.path.join(repo, p) for p in out.split("\0") if p)
    return sorted({p for p in paths if os.path.isfile(p)})


def _serialize(nb: nbformat.NotebookNode) -> str:
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def problems(path: str) -> list[str]:
    """What keeps ``path`` from being a clean notebook, one message per problem (empty: clean)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
        nbformat.validate(nb)
    except Exception as exc:  # noqa: BLE001 - any parse or schema error is the problem to report
        return [f"{path}: not a valid notebook: {' '.join(str(exc).split())[:300]}"]
    found = []
    for i, cell in enumerate(nb.cells):
        where = f"{path}: cell {i} ({cell.get('id', '?')})"
        if cell.get("outputs"):
            found.append(f"{where} has {len(cell.outputs)} output(s)")
        if cell.get("execution_count") is not None:
            found.append(f"{where} has execution count {cell.execution_count}")
        for key in RUN_CELL_METADATA:
            if key in cell.metadata:
                found.append(f"{where} has run metadata {key!r}")
    for key in RUN_NOTEBOOK_METADATA:
        if key in nb.metadata:
            found.append(f"{path}: notebook metadata {key!r}")
    if not found and text != _serialize(nb):
        found.append(f"{path}: not in nbformat's canonical layout (re-save it, or run with --fix)")
    return found


def strip(path: str) -> None:
    """Remove outputs, execution counts and run metadata; write the canonical layout."""
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in RUN_CELL_METADATA:
            cell.metadata.pop(key, None)
    for key in RUN_NOTEBOOK_METADATA:
        nb.metadata.pop(key, None)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(_serialize(nb))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="notebooks (default: every notebook git would commit)")
    parser.add_argument("--fix", action="store_true", help="strip them in place instead of failing")
    args = parser.parse_args(argv)
    paths = args.paths or committed_notebooks()
    if args.fix:
        for path in paths:
            strip(path)
    found = [message for path in paths for message in problems(path)]
    for message in found:
        print(message, file=sys.stderr)
    print(f"{len(paths)} notebook(s) checked, {len(found)} problem(s)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
