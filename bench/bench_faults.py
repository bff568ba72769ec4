"""Benchmark: one host's faults, side by side, the launcher (its job watch) against plain torchrun.

Two hosts, each its own network namespace on a private bridge (:class:`launcher.simulate.netns.Lab`),
one rank each, tests/scripts/ddp_allreduce.py all-reducing every 0.25 s. Every fault is on algo-2.

- Transient faults: does the job survive? A job meets the lengths of one kind one after the other (a
  blip of 2 s, then 5 s, then 10 s), each once its worker reached a step (so after 4 s of training
  since the one before). A length is survived when the job trained on after it: the next one fired,
  or, for the last, every host exited 0 after its last step. ``blip``: the link down, then up;
  ``pause``: the launcher (torchrun: its agent) SIGSTOPped, then SIGCONT; ``vmpause``: every process
  of the host stopped, then continued; ``starve``: every process of the host in a cgroup held to 0.1 %
  of a CPU (when cgroups are writable here).
- Real losses: the time from the fault until every process of both hosts (the machine's PIDs, taken
  from the namespaces before the fault) exited, capped (``> CAP s``: it still runs). ``partition``
  (the link down for good), ``poweroff`` (link down, every process SIGKILLed at once), a worker's exit
  7, a worker's SIGKILL.

- launcher: ``simulate --hosts 2 --nproc-per-node 1 --platform-stop off`` (simulate stops no host: the
  launchers end the job by themselves), at the launcher's defaults; the faults are simulate's ``--fault``.
- torchrun static / c10d: ``python -m torch.distributed.run`` started by this script in the same kind of
  lab (static rendezvous: ``--master-addr algo-1``; c10d: ``--rdzv-backend c10d``), faults fired here
  with the same deeds (:mod:`launcher.simulate.faults`).

Usage: ``.venv/bin/python bench/bench_faults.py [--rounds 3] [--cap 60] [--only launcher|static|c10d ...]
[--faults blip,pause,... ] [--results FILE]``. With ``--results`` every measurement is appended to FILE
(JSON lines) and the table is printed from everything in FILE, so contenders may be run apart. Needs
network namespaces (root or unprivileged user namespaces); only the lab's private addresses are used.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchlib import clean_env, is_alive, markdown_table  # noqa: E402  (bench/ is the script's directory)

from launcher import proctree  # noqa: E402  (after the path is set)
from launcher.simulate import faults, netns  # noqa: E402

PYTHON = sys.executable
SCRIPT = os.path.join(REPO, "tests", "scripts", "ddp_allreduce.py")
STEP_SLEEP = 0.25
FIRST_STEP = 5  # the first fault fires once algo-2's worker did this many steps
AFTER = 4.0  # seconds of training after each transient fault
TRANSIENT = {"blip": (2, 5, 10), "pause": (5, 10), "vmpause": (5,), "starve": (10,)}
STALLING = ("blip", "vmpause", "starve")  # the workers wait in a collective while it lasts
LOSSES = ("partition", "poweroff", "worker exit 7", "worker SIGKILL")
CONTENDERS = {"launcher": "launcher (job watch)", "static": "torchrun static", "c10d": "torchrun c10d"}
PORT = 29500  # inside the lab's private namespaces: no clash with anything on the machine






def steps_done(directory: str, rank: int) -> int:
    """The worker's steps so far (-1 before its record exists)."""
    try:
        with open(os.path.join(directory, f"rank{rank}.json"), encoding="utf-8") as fh:
            return int(json.load(fh)["steps"])
    except (OSError, ValueError, KeyError):
        return -1


def record(directory: str, rank: int, steps: int, timeout: float = 180.0,
           alive: Callable[[], bool] = lambda: True) -> Optional[dict]:
    """The worker's record once it did ``steps`` steps (polled every 10 ms); None if the job ended or
    ``timeout`` passed first."""
    path = os.path.join(directory, f"rank{rank}.json")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            if data["steps"] >= steps:
                return data
        except (OSError, ValueError):
            pass
        if not alive():
            return None
        time.sleep(0.01)
    return None


def gone_at(pids: Sequence[int], cap: float, since: float) -> Optional[float]:
    """Seconds from ``since`` until every pid exited; None if some outlive ``since + cap``."""
    while any(is_alive(p) for p in pids):
        if time.monotonic() - since > cap:
            return None
        time.sleep(0.01)
    return time.monotonic() - since


def plan(kind: str) -> tuple[list[int], int]:
    """The step at which each length of ``kind`` fires, and the job's number of steps."""
    triggers, step = [], FIRST_STEP
    for seconds in TRANSIENT[kind]:
        triggers.append(step)
        step += int(((0 if kind in STALLING else seconds) + AFTER) / STEP_SLEEP)
    return triggers, step


def _inodes(records: Sequence[dict]) -> list[int]:
    return [os.stat(f"/proc/{r['pid']}/ns/net").st_ino for r in records]


# -- the launcher: simulate fires the faults --------------------------------------------------------
class NoStart(RuntimeError):
    """The job never reached its first step (a failed start)."""


def first_records(data: Sequence[str], alive: Callable[[], bool]) -> list[dict]:
    """Both workers' first records; :class:`NoStart` if the job ended or never got there."""
    found = [record(d, r, 0, alive=alive) for d, r in zip(data, (0, 1))]
    if any(r is None for r in found):
        raise NoStart("a worker never started")
    return [r for r in found if r is not None]


class LauncherJob:
    """``simulate --platform-stop off``, its stderr read as it comes."""

    def __init__(self, tmp: str, fault_specs: Sequence[str], script_args: Sequence[str], cap: float) -> None:
        self.workdir = os.path.join(tmp, "job")
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "launcher", "simulate", "--hosts", "2", "--nproc-per-node", "1", "--network", "netns",
             "--platform-stop", "off", "--deadline", str(cap + 240), "--workdir", self.workdir,
             *(w for spec in fault_specs for w in ("--fault", spec)), "--", SCRIPT, *script_args],
            cwd=tmp, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr or ()), daemon=True).start()
        self.data = [os.path.join(self.workdir, f"algo-{i}", "output", "data") for i in (1, 2)]

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def wait_line(self, text: str, nth: int, timeout: float) -> Optional[float]:
        """When simulate's ``nth`` line with ``text`` came (polled every 10 ms); None if it never did."""
        deadline = time.monotonic() + timeout
        while self.count(text) <= nth:
            if self.proc.poll() is not None and self.count(text) <= nth or time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return time.monotonic()

    def close(self) -> None:
        if self.proc.poll() is None:
            proctree.kill_tree([self.proc.pid])
        self.proc.wait()

    def exit_codes(self) -> list[Optional[int]]:
        with open(os.path.join(self.workdir, "summary.json"), encoding="utf-8") as fh:
            return [h["exit_code"] for h in json.load(fh)["hosts"]]


def launcher_transient(kind: str, cap: float) -> list[bool]:
    triggers, steps = plan(kind)
    specs = [f"algo-2:{kind}:step={s}:{d}" for s, d in zip(triggers, TRANSIENT[kind])]
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        job = LauncherJob(tmp, specs, ["--steps", str(steps), "--step-sleep", str(STEP_SLEEP)], cap)
        try:
            survived = []
            for i in range(len(triggers)):
                if i + 1 < len(triggers):  # the next length fired: this one was survived
                    survived.append(job.wait_line(f"fault: {kind} of algo-2 at ", i + 1, cap + 180) is not None)
                else:
                    try:
                        job.proc.wait(timeout=cap + 240)
                        survived.append(job.exit_codes() == [0, 0] and steps_done(job.data[1], 1) == steps)
                    except subprocess.TimeoutExpired:
                        survived.append(False)
                if not survived[-1]:
                    break
            return survived
        finally:
            job.close()


def launcher_loss(fault: str, cap: float) -> Optional[float]:
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        specs = [f"algo-2:{fault}:step={FIRST_STEP}"] if fault in ("partition", "poweroff") else []
        job = LauncherJob(tmp, specs, loss_args(fault), cap)
        try:
            pids = netns.namespace_pids(_inodes(first_records(job.data, lambda: job.proc.poll() is None)))
            if specs:
                at = job.wait_line("fault: ", 0, 180) or time.monotonic()
            else:
                at = fire_worker_fault(fault, job.data[1])
            return gone_at(pids, cap, at)
        finally:
            job.close()


def loss_args(fault: str) -> list[str]:
    return ["--steps", "0", "--step-sleep", str(STEP_SLEEP),
            *(["--fail-rank", "1", "--exit-code", "7"] if fault == "worker exit 7" else [])]


def fire_worker_fault(fault: str, data_dir: str) -> float:
    """A worker's exit 7 (after its first step: its death is the moment) or SIGKILL; returns when."""
    rec = record(data_dir, 1, 0 if fault == "worker exit 7" else FIRST_STEP)
    if rec is None:
        raise RuntimeError("the worker never started")
    if fault == "worker SIGKILL":
        os.kill(rec["pid"], signal.SIGKILL)
    while is_alive(rec["pid"]):
        time.sleep(0.005)
    return time.monotonic()


# -- plain torchrun: this script fires the faults ------------------------------------------------------
class TorchrunJob:
    """Two plain torchruns in a lab of two hosts."""

    def __init__(self, tmp: str, backend: str, script_args: Sequence[str]) -> None:
        self.lab = netns.Lab(tmp)
        self.procs: list[subprocess.Popen] = []
        self.data = [os.path.join(tmp, f"algo-{i}") for i in (1, 2)]
        try:
            for i in range(2):
                self.lab.add_host(f"algo-{i + 1}", netns.host_address(i))
            for i in range(2):
                os.makedirs(self.data[i])
                rdzv = (["--master-addr", "algo-1", "--master-port", str(PORT), "--node-rank", str(i)]
                        if backend == "static" else
                        ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"algo-1:{PORT}", "--rdzv-id", "bench"])
                argv = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", *rdzv,
                        SCRIPT, *script_args]
                self.procs.append(subprocess.Popen(self.lab.command(f"algo-{i + 1}", argv), cwd=tmp,
                                                   env=clean_env(SM_OUTPUT_DATA_DIR=self.data[i]),
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def start_fault(self, kind: str) -> Callable[[], object]:
        """Start a transient fault on algo-2; returns its end."""
        def pids() -> list[int]:
            return self.lab.pids("algo-2")

        if kind == "blip":
            self.lab.partition("algo-2")
            return lambda: self.lab.heal("algo-2")
        if kind == "starve":
            quota = faults.CpuQuota("bench-algo-2")
            quota.add(pids)
            return quota.remove
        # pause: torchrun's agent, the process the launcher would be; vmpause: every process of the host
        stopped = faults.stop_all((lambda: [self.procs[1].pid]) if kind == "pause" else pids)
        return lambda: faults.continue_all(stopped)

    def close(self) -> None:
        self.lab.close()  # kills whatever still runs in the hosts, by their namespaces
        for proc in self.procs:
            proc.wait()


def torchrun_transient(kind: str, backend: str, cap: float) -> list[bool]:
    triggers, steps = plan(kind)
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        job = TorchrunJob(tmp, backend, ["--steps", str(steps), "--step-sleep", str(STEP_SLEEP)])
        try:
            survived = []
            for trigger, seconds in zip(triggers, TRANSIENT[kind]):
                if record(job.data[1], 1, trigger, alive=job.alive) is None:
                    break  # the job ended or stalled before this length: not reached
                end = job.start_fault(kind)
                time.sleep(seconds)
                end()
                ended = time.monotonic()  # survived: a step done after the fault ended
                nxt = steps_done(job.data[1], 1) + 1
                survived.append(record(job.data[1], 1, nxt, timeout=cap, alive=job.alive) is not None)
                if not survived[-1]:
                    break
            if survived and survived[-1]:  # the last one: both torchruns exit 0 after the last step
                codes = []
                for proc in job.procs:
                    try:
                        codes.append(proc.wait(timeout=max(1.0, cap - (time.monotonic() - ended))))
                    except subprocess.TimeoutExpired:
                        codes.append(None)
                survived[-1] = codes == [0, 0] and steps_done(job.data[1], 1) == steps
            return survived
        finally:
            job.close()


def torchrun_loss(fault: str, backend: str, cap: float) -> Optional[float]:
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        job = TorchrunJob(tmp, backend, loss_args(fault))
        try:
            pids = netns.namespace_pids(_inodes(first_records(job.data, job.alive)))
            if fault in ("partition", "poweroff"):
                record(job.data[1], 1, FIRST_STEP)
                if fault == "partition":
                    job.lab.partition("algo-2")
                else:
                    job.lab.poweroff("algo-2")
                at = time.monotonic()
            else:
                at = fire_worker_fault(fault, job.data[1])
            return gone_at(pids, cap, at)
        finally:
            job.close()


# -- the table --------------------------------------------------------------------------------------------
def loss_cell(times: Sequence[Optional[float]], cap: float) -> str:
    """``median (min-max)`` over the rounds, or ``> cap s`` when any round hit the cap."""
    if not times:
        return "-"
    if any(t is None for t in times):
        done = [t for t in times if t is not None]
        return f"> {cap:g} s" + (f" ({len(done)}/{len(times)} ended)" if done else "")
    values = [t for t in times if t is not None]
    spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f} s{spread}"


def survival_cell(results: Sequence[Sequence[bool]], index: int) -> str:
    """``3/3 survived``; rounds that ended before this length count as not survived."""
    if not results:
        return "-"
    won = sum(len(r) > index and r[index] for r in results)
    return f"{won}/{len(results)} survived"


def table(rows: Sequence[dict], cap: float) -> str:
    names = [n for n in CONTENDERS if any(r["contender"] == n for r in rows)]
    lines = [["fault on algo-2", *(CONTENDERS[n] for n in names)]]
    for kind, lengths in TRANSIENT.items():
        for i, seconds in enumerate(lengths):
            lines.append([f"{kind} {seconds} s: job survived", *(
                survival_cell([r["survived"] for r in rows if r["contender"] == n and r["fault"] == kind], i)
                for n in names)])
    for fault in LOSSES:
        lines.append([f"{fault}: every process exited", *(
            loss_cell([r["seconds"] for r in rows if r["contender"] == n and r["fault"] == fault], cap)
            for n in names)])
    lines = [line for line in lines if any(c != "-" for c in line[1:])]
    return markdown_table(lines[0], lines[1:])


def run_round(name: str, fault: str, cap: float) -> tuple[dict, str]:
    """One round of one contender: the row to record and what to print."""
    if fault in TRANSIENT:
        result = launcher_transient(fault, cap) if name == "launcher" else torchrun_transient(fault, name, cap)
        shown = " ".join(f"{s}s:{'ok' if ok else 'ended'}" for s, ok in zip(TRANSIENT[fault], result))
        return {"contender": name, "fault": fault, "survived": result}, shown
    took = launcher_loss(fault, cap) if name == "launcher" else torchrun_loss(fault, name, cap)
    return {"contender": name, "fault": fault, "seconds": took}, "> cap" if took is None else f"{took:.2f} s"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run every fault with every contender, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap", type=float, default=60.0)
    parser.add_argument("--only", action="append", choices=list(CONTENDERS), default=None)
    parser.add_argument("--faults", default=",".join([*TRANSIENT, *LOSSES]),
                        help="comma-separated: " + ", ".join([*TRANSIENT, *LOSSES]))
    parser.add_argument("--results", default=None, help="append every measurement to this JSON-lines file "
                        "and print the table from all of it")
    args = parser.parse_args(argv)
    why = netns.unavailable()
    if why is not None:
        print(f"bench_faults: skipped: network namespaces: {why}")
        return 0
    chosen = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in TRANSIENT and f not in LOSSES]
    if unknown:
        parser.error(f"unknown fault(s): {', '.join(unknown)}")
    if "starve" in chosen and faults.starve_unavailable() is not None:
        print(f"bench_faults: starve left out: {faults.starve_unavailable()}")
        chosen.remove("starve")
    rows: list[dict] = []
    for fault in chosen:
        for round_ in range(args.rounds):
            for name in args.only or list(CONTENDERS):
                started = time.monotonic()
                try:
                    row, shown = run_round(name, fault, args.cap)
                except NoStart as exc:  # a failed start measures nothing of the fault: run the round again
                    print(f"  {fault:15} round {round_ + 1} {CONTENDERS[name]:22} did not start ({exc}): again",
                          flush=True)
                    row, shown = run_round(name, fault, args.cap)
                rows.append(row)
                print(f"  {fault:15} round {round_ + 1} {CONTENDERS[name]:22} {shown or 'ended before the first'}"
                      f"  ({time.monotonic() - started:.0f} s)", flush=True)
                if args.results:
                    with open(args.results, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps(row) + "\n")
    if args.results:
        with open(args.results, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    print(f"\nfault on algo-2 of 2 namespaced hosts, one rank each, an all-reduce every {STEP_SLEEP:g} s; "
          f"{args.rounds} round(s); transient: the job trained on after it (lengths of one kind one after "
          f"the other in a job); losses: from the fault until every process of both hosts exited, median "
          f"(min-max), capped at {args.cap:g} s")
    print(table(rows, args.cap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
