"""Benchmark: a whole job on namespaced hosts, the launcher against plain torchrun given the same flags.

N hosts (``--hosts 2 4``), each its own network namespace on a private bridge
(:class:`launcher.simulate.netns.Lab`), one rank each, ``tests/scripts/ddp_allreduce.py`` all-reducing
every 0.1 s. A job's time runs from starting every host until the last has exited.

- ``launcher``: ``python -m launcher --nproc-per-node 1 SCRIPT ...`` on every host, the ``env`` platform
  (``MASTER_ADDR=algo-1``, ``MASTER_PORT``, ``NNODES``, ``NODE_RANK``), at its defaults (job watch on);
- ``torchrun``: ``python -m torch.distributed.run`` with the same rendezvous flags as the launcher gives
  it (``--nnodes N --nproc-per-node 1 --node-rank R --master-addr algo-1 --master-port P
  --rdzv-backend static --max-restarts 0``), the script directly.

- ``flags``: torchrun with every flag and variable the launcher gives it (``--redirects``, ``--log-dir``, its
  bootstrap), without the launcher (nobody copies the workers' output); ``nowatch``: the launcher with
  ``--no-job-watch``; ``baseline``: the
  launcher of another copy of the repository (``--baseline DIR``), e.g. before a change.

The launcher's modules are byte-compiled first (into ``__pycache__``, as ``pip install`` does; torch's were
compiled by its install), so that each start reads them rather than compiling them: under
``PYTHONDONTWRITEBYTECODE=1`` (common in training images) an uncompiled copy compiles every module at every
start, about 40 ms of CPU per start here. ``--no-compile`` leaves them as they are.

Rounds rotate their order; printed: each round's times and the CPU seconds of all the job's processes
(each reaped by its parent, so all count in the bench's children), then per size and job length the
median of the per-round ratios of the first way to each other (with the middle half), the median CPU of
each, the count of rounds, and the machine's load average before and after. ``--trace`` runs the
launcher once per size and prints every host's output lines with the seconds since the job's start
(where a launcher's time goes). ``--by-process`` also samples ``/proc`` every 50 ms during each job and prints
the CPU seconds of each kind of the job's processes (launchers, torchruns, workers): whether the launcher
costs more than its own CPU (the sampling itself costs some CPU, the same for both ways).

Usage: ``.venv/bin/python bench/bench_start.py [--hosts 2 4] [--pairs 8] [--steps 60 140]
[--ways launcher torchrun flags nowatch baseline] [--baseline DIR] [--no-compile] [--trace] [--by-process]``.
Needs network namespaces (root or unprivileged user namespaces); only the lab's private addresses are used.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchlib import clean_env, spread  # noqa: E402  (bench/ is the script's directory)

from launcher.simulate import netns  # noqa: E402  (after the path is set)

PYTHON = sys.executable
SCRIPT = os.path.join(REPO, "tests", "scripts", "ddp_allreduce.py")
PORT = 29500  # inside the lab's private namespaces: no clash with anything on the machine
STEP_SLEEP = "0.1"


WAYS = ("launcher", "torchrun", "flags", "baseline", "nowatch")
KINDS = (("launcher", "-m\0launcher\0"), ("torchrun", "torch.distributed.run"), ("worker", "ddp_allreduce.py"))
TICK = os.sysconf("SC_CLK_TCK")


class ProcessCPU:
    """The CPU seconds of each kind of process (:data:`KINDS`, by command line) among the descendants of
    ``roots``, sampled from ``/proc`` every 50 ms until :meth:`stop`: what a process used in its last 50 ms is
    missed, so each figure is a lower bound, alike for every way."""

    def __init__(self, roots: Sequence[int]) -> None:
        self.roots = set(roots)
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (kind, CPU seconds at the last look)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            parents, stats = {}, {}
            for name in os.listdir("/proc"):
                if name.isdigit():
                    try:
                        with open(f"/proc/{name}/stat", "rb") as fh:
                            stats[int(name)] = fh.read().rsplit(b")", 1)[1].split()
                    except OSError:
                        continue
                    parents[int(name)] = int(stats[int(name)][1])
            for pid, fields in stats.items():
                ancestor = pid
                while ancestor not in self.roots and ancestor > 1:
                    ancestor = parents.get(ancestor, 1)
                if ancestor <= 1 or pid in self.roots:
                    continue
                kind = self.cpu.get(pid, ("other", 0.0))[0]
                if kind == "other":  # a zombie's command line is empty: a process keeps the kind it was seen as
                    try:
                        with open(f"/proc/{pid}/cmdline") as fh:
                            command = fh.read()
                    except OSError:
                        continue
                    kind = next((kind for kind, mark in KINDS if mark in command), "other")
                self.cpu[pid] = (kind, (int(fields[11]) + int(fields[12])) / TICK)

    def stop(self) -> dict[str, float]:
        """Stop sampling; the CPU seconds per kind."""
        self._stop.set()
        self._thread.join()
        totals = {kind: 0.0 for kind, _ in KINDS}
        for kind, seconds in self.cpu.values():
            if kind in totals:  # not the lab's own processes
                totals[kind] += seconds
        return totals


def argv_for(way: str, hosts: int, rank: int, steps: int, run_dir: str) -> list[str]:
    """One host's command line (``run_dir``: where ``flags`` puts torchrun's logs)."""
    script = [SCRIPT, "--steps", str(steps), "--step-sleep", STEP_SLEEP]
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--nnodes", str(hosts), "--nproc-per-node", "1",
                "--node-rank", str(rank), "--master-addr", "algo-1", "--master-port", str(PORT),
                "--rdzv-backend", "static"]
    if way == "torchrun":
        return [*torchrun, "--max-restarts", "0", *script]
    if way == "flags":  # what the launcher gives torchrun, without the launcher
        return [*torchrun, "--rdzv-id", "ddp-launcher", "--rdzv-conf", "timeout=900", "--max-restarts", "0",
                "--log-dir", os.path.join(run_dir, "logs"), "--redirects", "3",
                os.path.join(REPO, "launcher", "bootstrap.py"), *script]
    return [PYTHON, "-m", "launcher", "--nproc-per-node", "1", *(["--no-job-watch"] if way == "nowatch" else []),
            *script]


def run_job(lab: netns.Lab, way: str, hosts: int, steps: int, tmp: str, trace: bool = False,
            strace: str = "", baseline: str = "", by_process: bool = False) -> tuple[float, float]:
    """Every host of one job: seconds from the first start until the last exit, and the CPU seconds of every
    process of the job (each reaped by its parent, so all of them count in this process's children).
    ``by_process``: also print the CPU of each kind of process (:class:`ProcessCPU`)."""
    procs, readers, lines = [], [], []
    sampler = ProcessCPU([os.getpid()]) if by_process else None
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    for rank in range(hosts):
        out = tempfile.mkdtemp(dir=tmp)
        env = clean_env(MASTER_ADDR="algo-1", MASTER_PORT=str(PORT), NNODES=str(hosts), NODE_RANK=str(rank),
                        SM_OUTPUT_DATA_DIR=out, SM_MODEL_DIR=out, OMP_NUM_THREADS="1")
        env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "PBS_"))}
        if way == "baseline":
            env["PYTHONPATH"] = baseline
        if way == "flags":
            os.makedirs(os.path.join(out, "exits"))
            env.update(TORCHELASTIC_ERROR_FILE=os.path.join(out, "torchrun_error.json"),
                       DDP_LAUNCHER_EXIT_DIR=os.path.join(out, "exits"), PYTHONFAULTHANDLER="1")
        argv = argv_for(way, hosts, rank, steps, out)
        if strace:
            argv = ["strace", "-f", "--seccomp-bpf", "-ttt", "-e", "trace=execve,exit_group,connect,wait4", "-o",
                    f"{strace}.{way}.{rank}", *argv]
        proc = subprocess.Popen(lab.command(f"algo-{rank + 1}", argv), cwd=out,
                                env=env, stdout=subprocess.PIPE if trace else subprocess.DEVNULL,
                                stderr=subprocess.PIPE if trace else subprocess.DEVNULL)
        procs.append(proc)
        if trace:
            def read(stream: Any, rank: int = rank) -> None:
                for line in iter(stream.readline, b""):
                    lines.append((time.monotonic() - started, rank, line.decode(errors="replace").rstrip()))
            for stream in (proc.stdout, proc.stderr):
                readers.append(threading.Thread(target=read, args=(stream,), daemon=True))
                readers[-1].start()
    codes = [proc.wait(timeout=600) for proc in procs]
    took = time.monotonic() - started
    if sampler is not None:
        print(f"    {way}: CPU s by process, " + ", ".join(f"{kind} {cpu:.2f}" for kind, cpu in sampler.stop().items()))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    for reader in readers:
        reader.join()
    for at, rank, line in sorted(lines):
        print(f"  {at:7.3f} algo-{rank + 1}: {line[:160]}")
    if codes != [0] * hosts:
        raise SystemExit(f"bench_start: {way} exited {codes}")
    return took, cpu_s



def main(argv: Sequence[str] = ()) -> int:
    """Run the pairs, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--steps", type=int, nargs="+", default=[60, 140])
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=["launcher", "torchrun"],
                        help="the first is compared with the others")
    parser.add_argument("--baseline", default="", help="a copy of the repository whose launcher is 'baseline'")
    parser.add_argument("--no-compile", action="store_true", help="leave the launcher's modules uncompiled")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--strace", default="", help="with --trace: strace each host into this prefix")
    parser.add_argument("--by-process", action="store_true", help="print each job's CPU by kind of process")
    args = parser.parse_args(list(argv) or None)
    if not args.no_compile:
        for root in (REPO, *([args.baseline] if args.baseline else [])):
            compileall.compile_dir(os.path.join(root, "launcher"), quiet=1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        for hosts in args.hosts:
            with netns.Lab(tmp) as lab:
                for i in range(hosts):
                    lab.add_host(f"algo-{i + 1}", netns.host_address(i))
                if args.trace:
                    for way in ("launcher", "torchrun"):
                        print(f"{hosts} hosts, {way}, {args.steps[0]} steps:")
                        took, cpu_s = run_job(lab, way, hosts, args.steps[0], tmp, True, args.strace)
                        print(f"  took {took:.3f} s, CPU {cpu_s:.2f} s")
                    continue
                for steps in args.steps:
                    load = os.getloadavg()[0]
                    times: dict[str, list[float]] = {way: [] for way in args.ways}
                    cpus: dict[str, list[float]] = {way: [] for way in args.ways}
                    for i in range(args.pairs):
                        order = args.ways[i % len(args.ways):] + args.ways[:i % len(args.ways)]
                        for way in order:
                            took, cpu_s = run_job(lab, way, hosts, steps, tmp, baseline=args.baseline,
                                                  by_process=args.by_process)
                            times[way].append(took)
                            cpus[way].append(cpu_s)
                        print(f"  {hosts} hosts, {steps} steps, round {i + 1}: "
                              + ", ".join(f"{way} {times[way][-1]:.2f} s (CPU {cpus[way][-1]:.2f} s)"
                                          for way in args.ways), flush=True)
                    first = args.ways[0]
                    for other in args.ways[1:]:
                        ratios = [a / b for a, b in zip(times[first], times[other])]
                        rows.append((hosts, steps, f"{first}/{other}", spread(times[first]), spread(times[other]),
                                     spread(ratios), spread(cpus[first]), spread(cpus[other]), len(ratios),
                                     f"{load:.1f}-{os.getloadavg()[0]:.1f}"))
    if rows:
        print("\n| hosts | steps | ways | first s | other s | ratio, median (middle half) | first CPU s | other CPU s "
              "| rounds | load average |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(str(cell) for cell in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
