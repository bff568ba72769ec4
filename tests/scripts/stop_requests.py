"""supervise (launcher/supervise.py) running one script directly, with a stand-in job watch that asks it
to stop N times while the script lives: what a hub hears when every other host reports its stop.

Usage: stop_requests.py DIR N
The script records each SIGTERM it gets in DIR/terms (one line each), writes DIR/ready once its handler is
set, and exits 0 once DIR/sent exists (the watch has asked N times). Prints the outcome's return code
and stop signal as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Callable, NamedTuple, Optional

from launcher import proctree
from launcher.command import Launch
from launcher.supervise import supervise

SCRIPT = """
import os, signal, sys, time
where = sys.argv[1]
def term(*_):
    with open(os.path.join(where, "terms"), "a") as fh:
        fh.write("SIGTERM\\n")
signal.signal(signal.SIGTERM, term)
open(os.path.join(where, "ready"), "w").close()
while not os.path.exists(os.path.join(where, "sent")):
    time.sleep(0.01)
"""


class Watch:
    """Calls the stop hook ``times`` times once the script is ready, then says so in DIR/sent."""

    def __init__(self, where: str, times: int) -> None:
        self.where, self.times = where, times

    def attach(self, request) -> None:
        if request is not None:
            threading.Thread(target=self._ask, args=(request,), daemon=True).start()

    def _ask(self, request) -> None:
        while not os.path.exists(os.path.join(self.where, "ready")):
            time.sleep(0.01)
        for i in range(self.times):
            request(60.0, f"job watch: stop request {i + 1}")
        open(os.path.join(self.where, "sent"), "w").close()


class Run(NamedTuple):
    """The run as supervise sees it (launcher.supervise.Context): the script itself, no hang detection."""

    environ: Mapping[str, str]
    log: Callable[[str], None]
    watchdog: proctree.Watchdog
    watch: Watch
    hangs: None = None
    grace_period: float = 60.0
    direct: bool = True
    rendezvous_bound: Optional[float] = None


def main() -> int:
    where, times = sys.argv[1], int(sys.argv[2])
    launch = Launch((sys.executable, "-c", SCRIPT, where), {}, (), where, os.path.join(where, "error.json"),
                    os.path.join(where, "logs"))
    watchdog = proctree.Watchdog()
    try:
        run = Run(os.environ, lambda line: print(line, file=sys.stderr, flush=True), watchdog, Watch(where, times))
        outcome = supervise(run, launch)
    finally:
        watchdog.release()
    print(json.dumps({"returncode": outcome.returncode, "stop_signal": outcome.stop_signal, "pid": outcome.pid,
                      "watchdog": watchdog.pid}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
