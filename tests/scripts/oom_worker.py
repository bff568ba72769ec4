"""A worker that runs out of memory, or dies of SIGKILL after an OOM kill elsewhere (tests/test_oom.py).

No torch: it needs no process group. Each rank writes ``$WORKER_RECORD_DIR/rank<R>.json`` (its rank,
pid and parent pid) first, then:

- ``--allocate``: makes itself the OOM killer's first choice (``oom_score_adj`` 1000) and touches
  memory in 16 MiB blocks until the kernel kills it (exit 3 if it reaches ``--cap-mib`` first);
- ``--elsewhere DIR``: starts a child that moves itself into the memory cgroup ``DIR`` and allocates
  there until the OOM killer kills it, waits for that, then kills itself with SIGKILL.
"""

import argparse
import json
import os
import signal
import subprocess
import sys

BLOCK = 16 << 20
PAGE = 4096


def allocate(cap_mib):
    """Touch memory until killed; exit 3 at ``cap_mib`` MiB."""
    with open("/proc/self/oom_score_adj", "w") as fh:
        fh.write("1000")
    blocks = []
    while len(blocks) * (BLOCK >> 20) < cap_mib:
        block = bytearray(BLOCK)
        for i in range(0, BLOCK, PAGE):
            block[i] = 1
        blocks.append(block)
    sys.exit(3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--allocate", action="store_true")
    parser.add_argument("--elsewhere", default=None)
    parser.add_argument("--join", default=None, help="(the --elsewhere child) move into this cgroup first")
    parser.add_argument("--cap-mib", type=int, default=16 << 10)
    args = parser.parse_args()
    if args.join:
        with open(os.path.join(args.join, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
        allocate(args.cap_mib)
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "pid": os.getpid(), "ppid": os.getppid()}
    if args.elsewhere:
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--join", args.elsewhere,
                                  "--cap-mib", str(args.cap_mib)])
        record.update(child=child.pid, child_code=child.wait())
    with open(os.path.join(os.environ["WORKER_RECORD_DIR"], f"rank{rank}.json"), "w") as fh:
        json.dump(record, fh)
    if args.allocate:
        allocate(args.cap_mib)
    if args.elsewhere:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
