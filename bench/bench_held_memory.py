"""Benchmark: what the next generation started ahead (launcher/ahead.py) holds while the job trains.

With ``--max-restarts``, each host keeps the next generation's torchrun and one interpreter per local rank that has
imported torch, idle, for the whole run. This starts one such generation on this machine (torchrun ``--standalone``
with ``--nproc`` workers through the launcher's bootstrap, held before a script that would only exit), waits until
every worker has imported torch, and prints each process's memory from ``/proc/PID/smaps_rollup``: RSS, PSS
(shared pages divided among the processes that map them) and USS (its private pages: what ending it would free).
Then it cancels the generation, as the launcher does when no restart comes.

Usage: ``.venv/bin/python bench/bench_held_memory.py [--nproc 2]``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchlib import clean_env  # noqa: E402  (bench/ is the script's directory)

from launcher import ahead, proctree  # noqa: E402  (after the path is set)
from launcher.command import BOOTSTRAP, Launch  # noqa: E402


def memory(pid: int) -> Optional[dict[str, int]]:
    """RSS, PSS and USS of ``pid`` in MiB; None when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
            fields = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", fh.read(), re.M)}
    except OSError:
        return None
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return {"rss": fields["Rss"] // 1024, "pss": fields["Pss"] // 1024, "uss": uss // 1024}


def imported_torch(pid: int) -> bool:
    """True when ``pid`` has torch's library mapped (its ``import torch`` has loaded it)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as fh:
            return b"libtorch_cpu.so" in fh.read()
    except OSError:
        return False


def held_workers(torchrun: int, count: int, timeout: float = 300.0) -> list[int]:
    """torchrun's ``count`` workers once each has imported torch, and 2 s more to settle."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = [pid for pid in proctree.children_of(torchrun) if imported_torch(pid)]
        if len(workers) == count:
            time.sleep(2.0)
            return workers
        time.sleep(0.2)
    raise SystemExit(f"no {count} held workers within {timeout:g} s")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-held-") as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w", encoding="ascii") as fh:
            fh.write("import torch\n")
        argv_ = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
                 "--max-restarts", "0", "--", BOOTSTRAP, script)
        launch = Launch(argv_, {}, (), tmp, os.path.join(tmp, "error.json"), os.path.join(tmp, "logs"))
        ready = ahead.start(launch, clean_env())
        if ready is None:
            print("not started", file=sys.stderr)
            return 1
        try:
            workers = held_workers(ready.proc.pid, args.nproc)
            rows = [("torchrun", memory(ready.proc.pid))] + [(f"worker {i}", memory(p)) for i, p in enumerate(workers)]
        finally:
            ready.cancel()
    print("| process (held) | RSS | PSS | USS (private) |")
    print("|---|---|---|---|")
    for name, mem in rows:
        if mem is not None:
            print(f"| {name} | {mem['rss']} MiB | {mem['pss']} MiB | {mem['uss']} MiB |")
    total = [m for _, m in rows if m is not None]
    print(f"| all {len(total)} | {sum(m['rss'] for m in total)} MiB | {sum(m['pss'] for m in total)} MiB | "
          f"{sum(m['uss'] for m in total)} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
