"""A worker without torch whose daemons try every way out of the job, for the process-guarantee tests.

Each rank starts one daemon per way in :data:`WAYS` and writes ``escape/<way>-<R>.json`` (the daemon's
pid) in ``$WORKER_RECORD_DIR`` once that daemon runs, then ``rank<R>.json`` (pid, ppid) and sleeps
until killed. A way is a ``+``-joined list of steps:

- ``double``: fork twice, the middle process exits (the daemon is re-parented, out of the worker's tree);
- ``setsid``: a new session; ``setpgid``: a new process group in the same session;
- ``clearenv``: exec a new Python with an EMPTY environment (no job marker left).

A daemon ignores SIGTERM, SIGHUP and SIGINT and sleeps for ever.
"""

import json
import os
import signal
import sys
import time

WAYS = ("double+setsid", "double+setpgid", "double+clearenv", "double+setsid+clearenv",
        "double+setpgid+clearenv", "setsid+clearenv", "clearenv")
SLEEPER = """import json, os, signal, sys, time
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
path = sys.argv[1]
with open(path + ".tmp", "w") as fh:
    json.dump({"pid": os.getpid(), "environ": len(open("/proc/self/environ", "rb").read())}, fh)
os.replace(path + ".tmp", path)
while True:
    time.sleep(0.1)
"""


def daemon(way, path):
    """In a forked child: take the steps of ``way`` and become the sleeper; never returns."""
    steps = way.split("+")
    try:
        if "double" in steps and os.fork() != 0:
            os._exit(0)  # the middle process: its child is re-parented
        if "setsid" in steps:
            os.setsid()
        if "setpgid" in steps:
            os.setpgid(0, 0)
        if "clearenv" in steps:
            os.execve(sys.executable, [sys.executable, "-I", "-S", "-c", SLEEPER, path], {})
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        exec(compile(SLEEPER, "sleeper", "exec"), {"__name__": "sleeper"})  # same program, same environment
    finally:
        os._exit(0)


def main():
    out = os.environ["WORKER_RECORD_DIR"]
    rank = int(os.environ["RANK"])
    escape = os.path.join(out, "escape")
    os.makedirs(escape, exist_ok=True)
    for way in WAYS:
        path = os.path.join(escape, f"{way}-{rank}.json")
        child = os.fork()
        if child == 0:
            sys.argv = ["sleeper", path]
            daemon(way, path)
        if "double" in way:
            os.waitpid(child, 0)  # the middle process exits at once
    with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as fh:
        json.dump({"rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "steps_done": 1}, fh)
    os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
