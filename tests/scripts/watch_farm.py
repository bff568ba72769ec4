"""Clients 1..NNODES-1 of one job watch, each in a process of its own forked from this one (copy on
write: hundreds of clients fit in memory), for the scale tests and ``bench/bench_watch_scale.py``.

Usage: watch_farm.py NNODES PORT LOSS_TIMEOUT JOB

Every client prints JSON lines on stdout (one ``os.write`` each, so lines never mix), with wall-clock
times (``time.time()``): ``{"node", "pid", "joined"}`` once connected to the hub, ``{"node", "stop",
"why"}`` when its watch asked to stop its workers, ``{"node", "failing"}`` just before it reports a
failure (SIGUSR1 makes a client fail with code 7), ``{"node", "end", "code", "report"}`` after
``finish``. This process prints ``{"started": t, "clients": n}`` after the last fork, waits for its
clients, and on SIGTERM kills them (by PID) first.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time

from launcher import jobwatch


def say(**what: object) -> None:
    os.write(1, (json.dumps(what) + "\n").encode())


def client(node: int, nnodes: int, port: int, timeout: float, job: str) -> None:
    stopped, failing = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, lambda *_: failing.set())
    watch = jobwatch.start(node, f"algo-{node + 1}", nnodes, "127.0.0.1", port, timeout, 600.0,
                           lambda line: None, job=job)
    assert watch is not None

    def stop(grace: float, why: str) -> None:
        say(node=node, stop=time.time(), why=why)
        stopped.set()

    watch.attach(stop)
    while not watch.connected():
        time.sleep(0.01)
    say(node=node, pid=os.getpid(), joined=time.time())
    while not (stopped.is_set() or failing.is_set()):
        time.sleep(0.01)
    if failing.is_set() and not stopped.is_set():
        say(node=node, failing=time.time())
        code, report = watch.finish(7, f"algo-{node + 1}: rank {node} (local rank 0) exited with code 7", True)
    else:
        code, report = watch.finish(143, f"algo-{node + 1}: its workers were stopped because of that", False)
    say(node=node, end=time.time(), code=code, report=report)
    watch.close()


def main() -> int:
    nnodes, port, timeout, job = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    children: list[int] = []

    def end(*_: object) -> None:
        for pid in children:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    for node in range(1, nnodes):
        pid = os.fork()
        if pid == 0:
            try:
                client(node, nnodes, port, timeout, job)
            finally:
                os._exit(0)
        children.append(pid)
    say(started=time.time(), clients=len(children))
    for pid in children:
        while True:
            try:
                os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
