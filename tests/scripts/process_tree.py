"""Start a tree of idle processes, each with the test tag it is given, and record each one's PID.

``python process_tree.py DIR SPEC``: SPEC (JSON) is ``{"name": ..., "tag": value or null, "children": [...],
"detach": bool}``. The process writes its PID to ``DIR/name``, starts its children with their own tags in
their environments (none: no tag at all), and sleeps until it is killed. A ``detach`` child is started
through an intermediate process that exits at once, so it leaves this tree (re-parented).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

TAG = "DDP_LAUNCHER_TEST_TAG"


def start(directory: str, spec: dict) -> None:
    """Start the process that ``spec`` describes, as a child of this one (or detached from it)."""
    env = {k: v for k, v in os.environ.items() if k != TAG}
    if spec.get("tag") is not None:
        env[TAG] = spec["tag"]
    argv = [sys.executable, os.path.abspath(__file__), directory, json.dumps(spec)]
    if spec.get("detach"):
        argv = [sys.executable, "-c", "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True)",
                *argv]
        subprocess.run(argv, env=env, check=True)
    else:
        subprocess.Popen(argv, env=env)


def main() -> None:
    directory, spec = sys.argv[1], json.loads(sys.argv[2])
    for child in spec.get("children", []):
        start(directory, child)
    with open(os.path.join(directory, spec["name"] + ".tmp"), "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(os.path.join(directory, spec["name"] + ".tmp"), os.path.join(directory, spec["name"]))
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
