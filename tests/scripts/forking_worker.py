"""A worker without torch that double-forks, for the launcher's process-guarantee tests.

``forking_worker.py daemon``: each rank double-forks a daemon (a new session, SIGTERM/SIGHUP ignored,
a sleep loop) that writes ``forks/daemon<R>.json`` (its pid) in ``$WORKER_RECORD_DIR``, then sleeps.
``forking_worker.py burst N``: each rank double-forks N processes that wait until their parent is
gone, record their new parent in ``forks/orphan<R>-<i>.json`` and exit (orphans re-parented to the
subreaper, i.e. the launcher), then sleeps. Every rank writes ``rank<R>.json`` (pid, ppid) first.
``--seconds S`` ends the sleep after S seconds with exit 0 (default: sleep until killed).
"""

import json
import os
import signal
import sys
import time


def write(path, data):
    with open(path + ".tmp", "w") as fh:
        json.dump(data, fh)
    os.replace(path + ".tmp", path)


def double_fork(body):
    """Run ``body`` in a grandchild whose parent exits at once (the grandchild becomes an orphan)."""
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            try:
                body()
            finally:
                os._exit(0)
        os._exit(0)
    os.waitpid(child, 0)


def main():
    mode, out = sys.argv[1], os.environ["WORKER_RECORD_DIR"]
    rank = int(os.environ["RANK"])
    forks = os.path.join(out, "forks")
    os.makedirs(forks, exist_ok=True)
    seconds = float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else None
    write(os.path.join(out, f"rank{rank}.json"), {"rank": rank, "pid": os.getpid(), "ppid": os.getppid(),
                                                  "steps_done": 1})

    def daemon():
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        write(os.path.join(forks, f"daemon{rank}.json"), {"pid": os.getpid()})
        while True:
            time.sleep(0.1)

    def orphan(i, parent):
        def body():
            while os.getppid() == parent:
                time.sleep(0.01)
            write(os.path.join(forks, f"orphan{rank}-{i}.json"), {"pid": os.getpid(), "ppid": os.getppid()})
        return body

    if mode == "daemon":
        double_fork(daemon)
    else:
        for i in range(int(sys.argv[2])):
            child = os.fork()  # the orphan's parent, that exits once it has forked
            if child == 0:
                me = os.getpid()
                if os.fork() == 0:
                    orphan(i, me)()
                    os._exit(0)
                os._exit(0)
            os.waitpid(child, 0)
    deadline = time.monotonic() + (seconds if seconds is not None else 1e9)
    while time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
