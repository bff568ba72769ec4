"""A simulated DataLoader-hang job whose host launchers were given PIDs another launcher's watchdog still
guards (tests/test_reused_pids.py). Run as PID 1 of a PID namespace of its own (``unshare --pid --fork
--mount-proc``), with the work directory as its argument.

A watchdog (another launcher's, here this process's) guards ``--count`` processes, which then end; the
namespace's next PID is set to the first of theirs, so simulate and its hosts are given those PIDs.
simulate runs ``loader_hang.py`` on 2 hosts; once rank 1's DataLoader worker hangs, the watchdog's
pipe closes as at its launcher's death, and the watchdog does its work. Then simulate is stopped
(SIGTERM). Prints one JSON line: ``hung``, ``reused`` (algo-2's launcher has a guarded PID), ``survived``
(it still ran after the watchdog's work), simulate's exit code and summary.json, and this PID namespace.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from launcher import proctree

HERE = os.path.dirname(os.path.abspath(__file__))
STARTED = re.compile(r"started 2 host\(s\): algo-1 pid (\d+), algo-2 pid (\d+)")


def wait_for(what, bound: float) -> bool:
    """Poll ``what()`` every 0.1 s until true or ``bound`` seconds have passed."""
    until = time.monotonic() + bound
    while time.monotonic() < until:
        if what():
            return True
        time.sleep(0.1)
    return False


def main() -> None:
    workdir, count = sys.argv[1], int(sys.argv[2])
    records = os.path.join(workdir, "records")
    os.makedirs(records)
    watchdog = proctree.Watchdog()
    read_fd, write_fd = os.pipe()
    guarded = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            os.close(write_fd)
            os.read(read_fd, 1)
            os._exit(0)
        watchdog.guard(pid)
        guarded.append(pid)
    os.close(write_fd)
    for pid in guarded:
        os.waitpid(pid, 0)
    time.sleep(0.05)  # what starts now starts at a later clock tick (1/100 s) than the guarded ones did
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write(str(min(guarded) - 1))
    sim = subprocess.Popen([sys.executable, "-m", "launcher", "simulate", "--hosts", "2", "--network", "loopback",
                            "--workdir", os.path.join(workdir, "job"), "--job-name", "stale", "--platform-stop",
                            "off", "--deadline", "400", "--", os.path.join(HERE, "loader_hang.py")],
                           env={**os.environ, "WORKER_RECORD_DIR": records}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(sim.stderr), daemon=True)
    reader.start()
    names = ("rank0.json", "rank1.json", "loader.json")
    hung = wait_for(lambda: all(os.path.exists(os.path.join(records, n)) for n in names), 300)
    found = [m for m in map(STARTED.search, list(lines)) if m]
    launcher = int(found[0].group(2)) if found else 0
    os.close(watchdog._write_fd)  # its launcher's end of the pipe, closed as when the kernel kills it
    os.waitpid(watchdog.pid, 0)  # the watchdog did its work and exited
    state = proctree.state(launcher) if launcher else None
    sim.send_signal(signal.SIGTERM)
    sim.wait(timeout=300)
    reader.join(timeout=10)
    summary = None  # simulate itself may have been given a guarded PID: killed, it writes none
    with contextlib.suppress(OSError), open(os.path.join(workdir, "job", "summary.json")) as fh:
        summary = json.load(fh)
    print(json.dumps({"hung": hung, "reused": launcher in guarded, "survived": state not in (None, "Z", "X"),
                      "simulate": sim.returncode, "summary": summary, "namespace": os.readlink("/proc/self/ns/pid"),
                      "stderr": "".join(lines[-30:])}))


if __name__ == "__main__":
    main()
