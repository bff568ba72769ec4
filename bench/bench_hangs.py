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

``--learned``: the default instead (no ``--hang-timeout``; the floor lowered to :data:`LEARNED_FLOOR` s by
the test-only ``DDP_LAUNCHER_TEST_HANG_FLOOR``, so that a round takes a minute, not five): regular steps,
then at step :data:`LEARNED_AT` (after the warm-up) one rank skips a collective. Per round: the learned
timeout the log states, and the time from the hang until every host ended, against it. Then
``--healthy N`` runs of tests/scripts/progress_worker.py with irregular phases (a slow start, a silent
computation, a checkpoint written in pieces, an evaluation, each of a random length up to 3 x the
learned floor's worth) under the same learned default: every false alarm is counted.

``--shapes``: the hang shapes of tests/scripts/hang_shapes.py instead (an early deadlock, a deadlock behind a
``threading.Timer`` logger, a DataLoader worker blocked on one item, a livelock, a stuck rank whose thread
chatters), each ``--rounds`` times on 2 hosts with ``--launcher-hang-timeout`` 10 s and no start bound given:
per shape, how many ended with 124 within the timeout + 15 s of the hang, with the culprit named on every
host, and the median time from the hang to the end.

Usage: ``.venv/bin/python bench/bench_hangs.py [--rounds 20] [--hosts 2 4 8] [--cap 120]
[--learned] [--healthy 5] [--shapes]``. Needs network namespaces; only the lab's private addresses are used.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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

from benchlib import clean_env, markdown_table  # noqa: E402  (bench/ is the script's directory)

from launcher import proctree  # noqa: E402  (after the path is set)
from launcher.simulate import netns  # noqa: E402

PYTHON = sys.executable
SCRIPT = os.path.join(REPO, "tests", "scripts", "hang_worker.py")
TIMEOUT = 10.0
MODES = {"skip": "wait_for_peer", "loop": "spin", "read": "read_input", "preinit": "read_input", "noabort": ""}
PORT = 29500
HEALTHY_SCRIPT = os.path.join(REPO, "tests", "scripts", "progress_worker.py")
LEARNED_FLOOR = 4.0  # seconds: the learned rounds' floor (the real one is 300 s)
LEARNED_AT = 300  # the step at which a learned round hangs: 30 s of steps at least, past the warm-up
LEARNED_START = 120.0  # the start's bound in the learned rounds
LEARNED_LINE = re.compile(r"hang timeout: ([\d.]+) s[^,]*, learned")




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


def simulate(tmp: str, hosts: int, cap: float, script: str, args: Sequence[str],
             env: dict[str, str]) -> tuple[int, float, str]:
    """One simulated job on namespaced hosts: its exit code, when it ended (wall clock), its log."""
    with open(os.path.join(tmp, "log"), "w+", encoding="utf-8") as log:
        proc = subprocess.Popen([PYTHON, "-m", "launcher", "simulate", "--hosts", str(hosts), "--nproc-per-node", "1",
                                 "--network", "netns", "--platform-stop", "off", "--deadline", str(cap),
                                 "--workdir", os.path.join(tmp, "job"), "--", script, *args],
                                cwd=tmp, env=clean_env(**env), stdout=subprocess.DEVNULL, stderr=log,
                                start_new_session=True)
        try:
            proc.wait(timeout=cap + 60)
        except subprocess.TimeoutExpired:
            proctree.kill_tree([proc.pid])
            proc.wait()
        ended = time.time()
        log.seek(0)
        return proc.returncode, ended, log.read()


def run_launcher(hosts: int, mode: str, culprit: int, cap: float, learned: bool = False) -> dict:
    """One hung job; its end, the stacks' share, the reports that name the culprit (``learned``: with the
    learned default, and the learned timeout)."""
    with tempfile.TemporaryDirectory(prefix="bench-hangs-") as tmp:
        workdir = os.path.join(tmp, "job")
        args = ["--mode", mode, "--rank", str(culprit)]
        if learned:
            args += ["--at-step", str(LEARNED_AT), "--step-sleep", "0.1",
                     "--launcher-hang-start-timeout", f"{LEARNED_START:g}"]
        else:
            args += ["--launcher-hang-timeout", f"{TIMEOUT:g}"]
        env = {"DDP_LAUNCHER_TEST_HANG_FLOOR": f"{LEARNED_FLOOR:g}"} if learned else {}
        code, ended, log = simulate(tmp, hosts, cap, SCRIPT, args, env)
        timeouts = [float(t) for t in LEARNED_LINE.findall(log)]
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
        return {"code": code, "took": ended - min(hung) if hung else None,
                "timeout": timeouts[-1] if timeouts else None,
                "stacks": 1 - len(missing) / givers, "named": sum(named(mode, culprit) in r for r in reports) / hosts}


def named(mode: str, culprit: int) -> str:
    """What a report that names the culprit says (one rank per host: rank r on algo-r+1)."""
    if mode == "noabort":
        return f"rank {culprit} (algo-{culprit + 1}) gave no stack (SIGABRT ignored), likely the culprit"
    mark = "read" if mode == "preinit" else mode
    return f"rank {culprit} (algo-{culprit + 1}) at hang_worker.py:{line_of(mark)} in {MODES[mode]}"


def run_healthy(hosts: int, cap: float, rnd: random.Random) -> dict:
    """A healthy job with irregular silent phases under the learned default: its code, any hang line."""
    with tempfile.TemporaryDirectory(prefix="bench-hangs-") as tmp:
        phase = rnd.uniform(1, 3) * 3 * LEARNED_FLOOR
        args = ["--mode", "healthy", "--steps", str(rnd.randint(40, 120)), "--slow-start",
                f"{rnd.uniform(1, 3) * LEARNED_FLOOR:.1f}", "--quiet-phase", f"{phase:.1f}",
                "--launcher-hang-start-timeout", f"{LEARNED_START:g}"]
        code, _ended, log = simulate(tmp, hosts, cap, HEALTHY_SCRIPT, args,
                                     {"DDP_LAUNCHER_TEST_HANG_FLOOR": f"{LEARNED_FLOOR:g}"})
        with open(os.path.join(tmp, "job", "summary.json"), encoding="utf-8") as fh:
            capped = json.load(fh)["deadline_reached"]
        return {"code": code, "alarm": "hang: no rank progressed" in log, "phase": phase, "capped": capped,
                "timeouts": [float(t) for t in LEARNED_LINE.findall(log)]}


def learned_main(args: argparse.Namespace) -> int:
    """The learned default: hangs against the learned timeout, then healthy runs (false alarms)."""
    rows = []
    for hosts in args.hosts:
        results = []
        for i in range(args.rounds):
            culprit = (i * 3 + 1) % hosts
            result = run_launcher(hosts, "skip", culprit, args.cap, learned=True)
            results.append(result)
            print(f"  {hosts} hosts rank {culprit}: exit {result['code']}, learned {result['timeout']} s, "
                  f"ended {result['took'] or float('nan'):.1f} s after the hang, named {result['named']:.0%}",
                  flush=True)
        took = [r["took"] for r in results if r["took"] is not None]
        over = [r["took"] - r["timeout"] for r in results if r["took"] is not None and r["timeout"] is not None]
        learned = [r["timeout"] for r in results if r["timeout"] is not None]
        rows.append([str(hosts), str(len(results)),
                     f"{statistics.median(learned):.1f} s ({min(learned):.1f}-{max(learned):.1f})" if learned else "-",
                     f"{statistics.median(took):.1f} s ({min(took):.1f}-{max(took):.1f})" if took else "-",
                     f"{statistics.median(over):.1f} s ({min(over):.1f}-{max(over):.1f})" if over else "-",
                     f"{sum(r['code'] == 124 for r in results)}/{len(results)}",
                     f"{statistics.mean(r['named'] for r in results):.0%}"])
    print(f"\nlearned default (floor lowered to {LEARNED_FLOOR:g} s), hang at step {LEARNED_AT}, one rank per host")
    print(markdown_table(["hosts", "hangs", "learned timeout", "hang to every host ended", "past the timeout",
                          "exit 124", "reports naming the culprit"], rows))
    rnd = random.Random(26)
    healthy = [run_healthy(args.hosts[0], max(args.cap, 400.0), rnd) for _ in range(args.healthy)]  # long runs
    for run in healthy:
        print(f"  healthy: exit {run['code']}{' (the --cap reached)' if run['capped'] else ''}, phases "
              f"{run['phase']:.1f} s, learned {run['timeouts'][-1:]}, alarm {run['alarm']}", flush=True)
    print(f"\nhealthy runs with irregular silent phases ({args.hosts[0]} hosts): {len(healthy)}, "
          f"exit 0: {sum(r['code'] == 0 for r in healthy)}, false alarms: {sum(r['alarm'] for r in healthy)}")
    return 0


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


SHAPES_SCRIPT = os.path.join(REPO, "tests", "scripts", "hang_shapes.py")
BOUND = 15.0  # the bound past the timeout


def shape_named(shape: str) -> re.Pattern[str]:
    """What a report that names the shape's culprit (rank 1, algo-2) says, as a pattern."""
    def at(mark: str) -> str:
        with open(SHAPES_SCRIPT, encoding="utf-8") as fh:
            return str(next(i for i, line in enumerate(fh, 1) if line.rstrip().endswith(f"# at:{mark}")))

    where = {"early": f"{at('early')} in wait_for_peer", "timer": f"{at('timer')} in log_status",
             "loader": f"{at('loader')} in loader_steps", "livelock": r"\d+ in (retry_for_ever|call_the_service)",
             "chatty": f"{at('chatty')} in read_input"}[shape]
    tail = rf".*; rank 1's child pid \d+ at hang_shapes\.py:{at('item')} in __getitem__" if shape == "loader" else ""
    return re.compile(rf"hang: no progress for \d+ s; rank 1 \(algo-2\) at hang_shapes\.py:{where}{tail}")


def run_shape(shape: str, cap: float) -> dict:
    """One job of the shape on 2 hosts: its exit code, the time from the hang to its end, culprit named."""
    with tempfile.TemporaryDirectory(prefix="bench-hangs-") as tmp:
        code, ended, _log = simulate(tmp, 2, cap, SHAPES_SCRIPT,
                                     ["--mode", shape, "--launcher-hang-timeout", f"{TIMEOUT:g}"], {})
        hung, reports = [], []
        for i in (1, 2):
            with open(os.path.join(tmp, "job", f"algo-{i}", "output", "data", f"rank{i - 1}.json")) as fh:
                hung += [json.load(fh)["hung_at"]]
            path = os.path.join(tmp, "job", f"algo-{i}", "output", "failure")
            with open(path, encoding="utf-8") if os.path.exists(path) else open(os.devnull) as fh:
                reports.append(fh.read())
        hung = [h for h in hung if h is not None]
        firsts = [r.splitlines()[0] if r else "" for r in reports]
        named = all(shape_named(shape).match(first) for first in firsts)
        return {"code": code, "took": ended - min(hung) if hung else None, "named": named,
                "said": "" if named else " / ".join(firsts)}


def shapes_main(args: argparse.Namespace) -> int:
    """Each hang shape ``--rounds`` times: ended within the timeout + 15 s, named, the median end."""
    rows = []
    for shape in args.only or ("early", "timer", "loader", "livelock", "chatty"):
        results = []
        for _ in range(args.rounds):
            result = run_shape(shape, args.cap)
            results.append(result)
            print(f"  {shape:8}: exit {result['code']}, {result['took'] or float('nan'):.1f} s after the hang, "
                  f"named {result['named']}{' ' + result['said'] if result['said'] else ''}", flush=True)
        good = [r for r in results if r["code"] == 124 and r["named"] and r["took"] is not None
                and r["took"] <= TIMEOUT + BOUND]
        took = [r["took"] for r in results if r["took"] is not None and r["code"] == 124]
        rows.append([shape, f"{len(good)}/{len(results)}",
                     f"{statistics.median(took):.1f} s ({min(took):.1f}-{max(took):.1f})" if took else "-"])
    print(f"\nhang shapes, --hang-timeout {TIMEOUT:g} s, 2 namespaced hosts of one rank; ended with 124 within "
          f"{TIMEOUT + BOUND:g} s of the hang, the culprit named on both hosts; time from the hang to the end, "
          "median (min-max)")
    print(markdown_table(["shape", f"ended within {TIMEOUT + BOUND:g} s, named", "hang to the end"], rows))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--cap", type=float, default=120.0)
    parser.add_argument("--learned", action="store_true", help="the learned default instead (see above)")
    parser.add_argument("--healthy", type=int, default=5, help="with --learned: healthy runs")
    parser.add_argument("--shapes", action="store_true", help="the hang shapes of hang_shapes.py (see above)")
    parser.add_argument("--only", nargs="+", choices=["early", "timer", "loader", "livelock", "chatty"],
                        help="with --shapes: only these shapes")
    args = parser.parse_args(argv)
    why = netns.unavailable()
    if why is not None:
        print(f"bench_hangs: skipped: network namespaces: {why}")
        return 0
    if args.shapes:
        return shapes_main(args)
    if args.learned:
        return learned_main(args)
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
    print(markdown_table(["hosts", "hangs", "time to end", "exit 124", "ranks with stacks",
                          "reports naming the culprit"], rows))
    when = f"still running at the {args.cap:g} s cap" if ended is None else f"ended after {ended:.0f} s"
    print(f"\nplain torchrun, 2 hosts, rank 1 skips a collective: {when}; last lines: {said or '(nothing)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
