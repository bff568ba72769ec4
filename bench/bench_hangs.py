"""Benchmark: injected hangs on 2, 4 and 8 namespaced hosts; the launcher's hang detection against torchrun.

Each round runs tests/scripts/hang_worker.py on ``simulate --network netns`` hosts (one rank each,
``--launcher-hang-timeout`` 10 s): at step 3 one rank skips a collective (deadlock), loops for ever or
blocks on a read; or it blocks before ``init_process_group`` while the others wait inside it (``preinit``);
or it ignores SIGABRT and sleeps while the others wait in the all-reduce (``noabort``: it gives no stack and
is named as the likely culprit). Rounds cycle through the five, the culprit rank moves. Measured per round:

- the time from the hang (the culprit's own record) until simulate has exited (every host ended);
- the share of ranks whose stacks were collected (the reports name ranks without one; a ``noabort`` culprit
  has none to give and is not counted);
- the share of hosts whose report names the culprit: its rank, host and ``hang_worker.py:<line>``.

Plain torchrun (static rendezvous, two namespaced hosts, the same deadlock) is run once, capped: when
it ends and what its last lines say.

Usage: ``.venv/bin/python bench/bench_hangs.py [--rounds 20] [--hosts 2 4 8] [--cap 120]``. Needs network
namespaces; only the lab's private addresses are used.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchlib import clean_env  # noqa: E402  (bench/ is the script's directory)

from launcher import proctree  # noqa: E402  (after the path is set)
from launcher.simulate import netns  # noqa: E402

PYTHON = sys.executable
SCRIPT = os.path.join(REPO, "tests", "scripts", "hang_worker.py")
TIMEOUT = 10.0
MODES = {"skip": "wait_for_peer", "loop": "spin", "read": "read_input", "preinit": "read_input", "noabort": ""}
PORT = 29500




def line_of(mark: str) -> int:
    with open(SCRIPT, encoding="utf-8") as fh:
        return next(i for i, line in enumerate(fh, 1) if line.rstrip().endswith(f"# at:{mark}"))


def missing_ranks(report: str) -> set[int]:
    """The ranks a report names as having given no stack."""
    found = re.search(r"no stack from ranks? ([\d, -]+)", report)
    ranks: set[int] = set()
    for part in (found.group(1).split(", ") if found else []):
        low, _, high = part.strip().partition("-")
        if low.isdigit():
            ranks |= set(range(int(low), int(high or low) + 1))
    return ranks


def run_launcher(hosts: int, mode: str, culprit: int, cap: float) -> dict:
    """One hung job; its end, the stacks' share, the reports that name the culprit."""
    with tempfile.TemporaryDirectory(prefix="bench-hangs-") as tmp:
        workdir = os.path.join(tmp, "job")
        proc = subprocess.Popen([PYTHON, "-m", "launcher", "simulate", "--hosts", str(hosts), "--nproc-per-node", "1",
                                 "--network", "netns", "--platform-stop", "off", "--deadline", str(cap),
                                 "--workdir", workdir, "--", SCRIPT, "--mode", mode, "--rank", str(culprit),
                                 "--launcher-hang-timeout", f"{TIMEOUT:g}"],
                                cwd=tmp, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            proc.wait(timeout=cap + 60)
        except subprocess.TimeoutExpired:
            proctree.kill_tree([proc.pid])
            proc.wait()
        ended = time.time()
        records = []
        for i in range(1, hosts + 1):
            with open(os.path.join(workdir, f"algo-{i}", "output", "data", f"rank{i - 1}.json")) as fh:
                records.append(json.load(fh))
        hung = [r["hung_at"] for r in records if r["hung_at"] is not None]
        reports = []
        for i in range(1, hosts + 1):
            path = os.path.join(workdir, f"algo-{i}", "output", "failure")
            text = ""
            if os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            reports.append(text)
        missing = set().union(*(missing_ranks(r) for r in reports)) if reports else set()
        givers = hosts - (mode == "noabort")
        return {"code": proc.returncode, "took": ended - min(hung) if hung else None,
                "stacks": 1 - len(missing) / givers, "named": sum(named(mode, culprit) in r for r in reports) / hosts}


def named(mode: str, culprit: int) -> str:
    """What a report that names the culprit says (one rank per host: rank r on algo-r+1)."""
    if mode == "noabort":
        return f"rank {culprit} (algo-{culprit + 1}) gave no stack (SIGABRT ignored), likely the culprit"
    mark = "read" if mode == "preinit" else mode
    return f"rank {culprit} (algo-{culprit + 1}) at hang_worker.py:{line_of(mark)} in {MODES[mode]}"


def run_torchrun(cap: float) -> tuple[Optional[float], str]:
    """Plain torchrun on two namespaced hosts, rank 1 skips a collective: when it ended, its last words."""
    with tempfile.TemporaryDirectory(prefix="bench-hangs-") as tmp:
        lab = netns.Lab(tmp)
        procs = []
        try:
            for i in range(2):
                lab.add_host(f"algo-{i + 1}", netns.host_address(i))
            started = time.monotonic()
            for i in range(2):
                argv = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                        "--master-addr", "algo-1", "--master-port", str(PORT), "--node-rank", str(i),
                        SCRIPT, "--mode", "skip", "--rank", "1"]
                procs.append(subprocess.Popen(lab.command(f"algo-{i + 1}", argv), cwd=tmp,
                                              env=clean_env(HANG_RECORD_DIR=tmp), stdout=subprocess.DEVNULL,
                                              stderr=subprocess.PIPE, text=True))
            deadline = started + cap
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.5)
            ended = None if any(p.poll() is None for p in procs) else time.monotonic() - started
        finally:
            lab.close()
            tails = [p.communicate()[1].strip().splitlines()[-1:] for p in procs]
        return ended, " / ".join(t[0][:160] for t in tails if t)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--cap", type=float, default=120.0)
    args = parser.parse_args(argv)
    why = netns.unavailable()
    if why is not None:
        print(f"bench_hangs: skipped: network namespaces: {why}")
        return 0
    rows = []
    for hosts in args.hosts:
        results = []
        for i in range(args.rounds):
            mode = list(MODES)[i % len(MODES)]
            culprit = (i * 3 + 1) % hosts
            result = run_launcher(hosts, mode, culprit, args.cap)
            results.append(result)
            print(f"  {hosts} hosts {mode:7} rank {culprit}: exit {result['code']}, "
                  f"{result['took'] or float('nan'):.1f} s, stacks {result['stacks']:.0%}, named {result['named']:.0%}",
                  flush=True)
        took = [r["took"] for r in results if r["took"] is not None]
        rows.append([str(hosts), str(len(results)),
                     f"{statistics.median(took):.1f} s ({min(took):.1f}-{max(took):.1f})" if took else "-",
                     f"{sum(r['code'] == 124 for r in results)}/{len(results)}",
                     f"{statistics.mean(r['stacks'] for r in results):.0%}",
                     f"{statistics.mean(r['named'] for r in results):.0%}"])
    ended, said = run_torchrun(args.cap)
    print(f"\ninjected hangs, --hang-timeout {TIMEOUT:g} s, one rank per namespaced host; time from the hang "
          "until every host ended, median (min-max)")
    header = ["hosts", "hangs", "time to end", "exit 124", "ranks with stacks", "reports naming the culprit"]
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    when = f"still running at the {args.cap:g} s cap" if ended is None else f"ended after {ended:.0f} s"
    print(f"\nplain torchrun, 2 hosts, rank 1 skips a collective: {when}; last lines: {said or '(nothing)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
