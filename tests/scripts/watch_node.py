"""One host's job watch alone, in a process of its own (no torch): the protocol tests' and the scale
bench's node. It prints one JSON object a line on stdout, with wall-clock times (``time.time()``):
``{"joined": t}`` when it joined (clients) or listens (the hub), ``{"stop": t, "why": ...}`` when the
watch asked to stop this host's workers, ``{"log": line}`` for each line the watch logs, and
``{"end": t, "code": c, "report": r}`` after ``finish``.

Usage: watch_node.py NODE NNODES PORT LOSS_TIMEOUT JOB [--fail-after SECONDS] [--succeed-after SECONDS]
The shared secret, if any, comes from LAUNCHER_JOB_SECRET. Without --fail-after/--succeed-after it
runs until killed, or until the watch stops it (then it finishes as a stopped host, like a launcher).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from launcher import jobwatch


def say(**what: object) -> None:
    sys.stdout.write(json.dumps(what) + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    for name, kind in (("node", int), ("nnodes", int), ("port", int), ("timeout", float), ("job", str)):
        parser.add_argument(name, type=kind)
    parser.add_argument("--fail-after", type=float)
    parser.add_argument("--succeed-after", type=float)
    args = parser.parse_args()
    secret = os.environ.get("LAUNCHER_JOB_SECRET", "").encode() or None
    stopped = threading.Event()
    watch = jobwatch.start(args.node, f"algo-{args.node + 1}", args.nnodes, "127.0.0.1", args.port, args.timeout,
                           600.0, lambda line: say(log=line, at=time.time()), job=args.job, secret=secret)
    if watch is None:
        return 3

    def stop(grace: float, why: str) -> None:
        say(stop=time.time(), why=why)
        stopped.set()

    watch.attach(stop)
    if args.node == 0:
        say(joined=time.time())
    else:
        while not watch.connected():
            time.sleep(0.01)
        say(joined=time.time())
    if args.fail_after is not None:
        time.sleep(args.fail_after)
        code, report = watch.finish(7, f"algo-{args.node + 1}: rank {args.node} (local rank 0) exited with code 7",
                                    True)
    elif args.succeed_after is not None:
        time.sleep(args.succeed_after)
        code, report = watch.finish(0, "", True)
    else:
        stopped.wait()
        code, report = watch.finish(143, f"algo-{args.node + 1}: its workers were stopped because of that", False)
    say(end=time.time(), code=code, report=report)
    watch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
