"""A watchdog whose guarded process ended, and whose PID another process was then given (tests/test_reused_pids.py).

Run as PID 1 of a PID namespace of its own (``unshare --pid --fork --mount-proc``), where the next PID
can be chosen (``/proc/sys/kernel/ns_last_pid``) and no other process takes it first. A watchdog
guards ``old`` and ``live``; ``old`` ends; ``new`` is given ``old``'s PID; the launcher's end of the
watchdog's pipe closes as at its death. Prints one JSON line: ``reused`` (``new`` got the PID),
``new_alive`` and ``live_alive`` after the watchdog did its work.
"""

import json
import os
import subprocess
import time

from launcher import proctree


def main() -> None:
    watchdog = proctree.Watchdog()
    old = subprocess.Popen(["sleep", "600"])
    live = subprocess.Popen(["sleep", "600"])
    watchdog.guard(old.pid)
    watchdog.guard(live.pid)
    started = proctree.start_time(old.pid)
    old.kill()
    old.wait()
    # a start time is in clock ticks (1/100 s): the new process starts at a later tick, as after any real reuse
    ticks = os.sysconf("SC_CLK_TCK")
    while True:
        with open("/proc/uptime") as fh:
            if float(fh.read().split()[0]) * ticks > started + 1:
                break
        time.sleep(0.01)
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:  # the namespace's next PID is old's again
        fh.write(str(old.pid - 1))
    new = subprocess.Popen(["sleep", "600"])
    os.close(watchdog._write_fd)  # the launcher's end of the pipe, closed as when the kernel kills it
    os.waitpid(watchdog.pid, 0)  # the watchdog did its work and exited
    facts = {"reused": new.pid == old.pid, "new_alive": new.poll() is None, "live_alive": live.poll() is None}
    for proc in (new, live):
        proc.kill()
        proc.wait()
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
