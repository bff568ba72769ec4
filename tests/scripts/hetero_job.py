"""A heterogeneous job's script: the training groups run ``ddp_allreduce.py``; the other hosts serve.

On a host outside the training world (no ``RANK``: the launcher runs the script once, without
torchrun) it appends its facts to ``$SM_OUTPUT_DATA_DIR/outside.jsonl`` (one line per run of the
script: pid, ancestors, the variables it got), prints ``step=N`` every ``--serve-sleep`` seconds,
and on SIGTERM appends ``{"sigterm": true}`` and exits ``--serve-exit`` (default 0). ``--serve-steps N``
(default 0: until stopped) ends on its own after N rounds with ``--serve-exit``. ``--serve-wait-master``:
first wait (at most 300 s) until the training world's master answers on ``MASTER_ADDR:MASTER_PORT``
(torchrun's store on the first training host is up, so every launcher of the job has long started).
The bundle holds only this file: ``ddp_allreduce.py`` is found in ``$HETERO_SCRIPTS`` (the tests' scripts directory).
"""

import argparse
import json
import os
import runpy
import signal
import socket
import sys
import time

SCRIPTS = os.environ.get("HETERO_SCRIPTS") or os.path.dirname(os.path.abspath(__file__))
NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "TRAINING_JOB_NAME")


def ancestors(pid):
    """``[parent, grandparent, ...]`` up to pid 1, from /proc (as ddp_allreduce.py; no torch here)."""
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            break
        pid = int(stat[stat.rfind(b")") + 2:].split()[1])
        chain.append(pid)
    return chain


def append(path, facts):
    with open(path, "a") as fh:
        fh.write(json.dumps(facts) + "\n")


def serve():
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve-sleep", type=float, default=0.1)
    parser.add_argument("--serve-steps", type=int, default=0)
    parser.add_argument("--serve-exit", type=int, default=0)
    parser.add_argument("--serve-wait-master", action="store_true")
    args, _unknown = parser.parse_known_args()
    out = os.path.join(os.environ.get("SM_OUTPUT_DATA_DIR", "."), "outside.jsonl")
    env = {k: v for k, v in os.environ.items() if k.startswith("SM_") or k in NAMES}
    append(out, {"pid": os.getpid(), "ancestors": ancestors(os.getpid()), "env": env, "argv": sys.argv[1:]})

    def stopped(_signum, _frame):
        append(out, {"sigterm": True, "at": time.time()})
        sys.exit(args.serve_exit)

    signal.signal(signal.SIGTERM, stopped)
    deadline = time.monotonic() + 300
    while args.serve_wait_master and time.monotonic() < deadline:
        try:
            socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    rounds = 0
    while args.serve_steps == 0 or rounds < args.serve_steps:
        rounds += 1
        print(f"step={rounds}", flush=True)
        time.sleep(args.serve_sleep)
    sys.exit(args.serve_exit)


if __name__ == "__main__":
    if "RANK" in os.environ:
        runpy.run_path(os.path.join(SCRIPTS, "ddp_allreduce.py"), run_name="__main__")
    else:
        serve()
