"""Benchmark: one host's fault, side by side, the launcher (its job watch) against plain torchrun.

Two hosts, each its own network namespace on a private bridge (:class:`launcher.simulate.netns.Lab`),
one rank each, tests/scripts/ddp_allreduce.py all-reducing every 0.1 s for ever. Faults on algo-2:
``partition`` (its link goes down), ``poweroff`` (link down, every process SIGKILLed at once), worker
exit 7, worker SIGKILL. Measured: the time from the fault until every process of both hosts (the
machine's PIDs, taken from the namespaces before the fault) has exited, capped (``> CAP s``: it hangs).

- launcher: ``simulate --hosts 2 --nproc-per-node 1 --platform-stop off`` (simulate stops no host: the
  launchers end the job by themselves); partition and poweroff are simulate's ``--fault``.
- torchrun static / c10d: ``python -m torch.distributed.run`` started by this script in the same kind of
  lab (static rendezvous: ``--master-addr algo-1``; c10d: ``--rdzv-backend c10d``), faults fired here.

Usage: ``.venv/bin/python bench/bench_faults.py [--rounds 2] [--cap 60] [--no-c10d]``. Needs network
namespaces (root or unprivileged user namespaces); only the lab's private addresses are used.
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

from launcher import proctree  # noqa: E402  (after the path is set)
from launcher.simulate import netns  # noqa: E402

PYTHON = sys.executable
SCRIPT = os.path.join(REPO, "tests", "scripts", "ddp_allreduce.py")
ENDLESS = ["--steps", "0", "--step-sleep", "0.1"]
FAULT_STEP = 8  # the fault fires once algo-2's worker did this many steps
FAULTS = ("partition", "poweroff", "worker exit 7", "worker SIGKILL")
PORT = 29500  # inside the lab's private namespaces: no clash with anything on the machine


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without another job's variables, the repository importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SM_", "LAUNCHER_", "SAGEMAKER_", "TORCHELASTIC_", "PET_"))}
    env["PYTHONPATH"] = REPO
    env.update(extra)
    return env


def is_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def record(directory: str, rank: int, steps: int, timeout: float = 120.0) -> dict:
    """The worker's record once it did ``steps`` steps (polled every 10 ms)."""
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
        time.sleep(0.01)
    raise RuntimeError(f"rank {rank} never did {steps} step(s) ({path})")


def gone_at(pids: Sequence[int], cap: float, since: float) -> Optional[float]:
    """Seconds from ``since`` until every pid exited; None if some outlive ``since + cap``."""
    while any(is_alive(p) for p in pids):
        if time.monotonic() - since > cap:
            return None
        time.sleep(0.01)
    return time.monotonic() - since


def fire_worker_fault(fault: str, data_dir: str, kill: Callable[[], None]) -> float:
    """Fire a fault on algo-2 (rank 1) that this script fires itself; returns when it happened."""
    if fault == "worker exit 7":  # rank 1 exits 7 after its first step: its death is the moment
        pid = record(data_dir, 1, 0)["pid"]
        while is_alive(pid):
            time.sleep(0.005)
        return time.monotonic()
    if fault == "worker SIGKILL":
        os.kill(record(data_dir, 1, FAULT_STEP)["pid"], signal.SIGKILL)
        return time.monotonic()
    record(data_dir, 1, FAULT_STEP)
    kill()
    return time.monotonic()


def script_args(fault: str) -> list[str]:
    return [*ENDLESS, *(["--fail-rank", "1", "--exit-code", "7"] if fault == "worker exit 7" else [])]


def run_launcher(fault: str, cap: float) -> Optional[float]:
    """One job through ``simulate --platform-stop off``; seconds from the fault to the last exit."""
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        workdir = os.path.join(tmp, "job")
        extra = ["--fault", f"algo-2:{fault}:step={FAULT_STEP}"] if fault in ("partition", "poweroff") else []
        proc = subprocess.Popen([PYTHON, "-m", "launcher", "simulate", "--hosts", "2", "--nproc-per-node", "1",
                                 "--network", "netns", "--platform-stop", "off", "--deadline", str(cap + 30),
                                 "--workdir", workdir, *extra, "--", SCRIPT, *script_args(fault)],
                                cwd=tmp, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        fired = threading.Event()
        threading.Thread(target=_watch_fault_line, args=(proc, fired), daemon=True).start()
        try:
            data = [os.path.join(workdir, f"algo-{i}", "output", "data") for i in (1, 2)]
            first = [record(d, r, 0) for d, r in zip(data, (0, 1))]
            pids = netns.namespace_pids(_inodes(first))
            if extra:
                fired.wait(timeout=120)
                at = time.monotonic()
            else:
                at = fire_worker_fault(fault, data[1], lambda: None)
            return gone_at(pids, cap, at)
        finally:
            if proc.poll() is None:
                proctree.kill_tree([proc.pid])
            proc.wait()


def _watch_fault_line(proc: subprocess.Popen, fired: threading.Event) -> None:
    for line in proc.stderr or ():
        if "fault: " in line:
            fired.set()


def _inodes(records: Sequence[dict]) -> list[int]:
    return [os.stat(f"/proc/{r['pid']}/ns/net").st_ino for r in records]


def run_torchrun(fault: str, backend: str, cap: float) -> Optional[float]:
    """Two plain torchruns in a lab (static or c10d rendezvous); seconds from the fault to the last exit."""
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        lab = netns.Lab(tmp)
        procs = []
        try:
            for i in range(2):
                lab.add_host(f"algo-{i + 1}", netns.host_address(i))
            for i in range(2):
                os.makedirs(os.path.join(tmp, f"algo-{i + 1}"))
                rdzv = (["--master-addr", "algo-1", "--master-port", str(PORT), "--node-rank", str(i)]
                        if backend == "static" else
                        ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"algo-1:{PORT}", "--rdzv-id", "bench"])
                argv = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", *rdzv,
                        SCRIPT, *script_args(fault)]
                procs.append(subprocess.Popen(lab.command(f"algo-{i + 1}", argv), cwd=tmp,
                                              env=clean_env(SM_OUTPUT_DATA_DIR=os.path.join(tmp, f"algo-{i + 1}")),
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            data = [os.path.join(tmp, f"algo-{i}") for i in (1, 2)]
            first = [record(d, r, 0) for d, r in zip(data, (0, 1))]
            pids = netns.namespace_pids(_inodes(first))
            deed = {"partition": lambda: lab.partition("algo-2"),
                    "poweroff": lambda: lab.poweroff("algo-2")}.get(fault, lambda: None)
            at = fire_worker_fault(fault, data[1], deed)
            return gone_at(pids, cap, at)
        finally:
            lab.close()  # kills whatever still runs in the hosts, by their namespaces
            for proc in procs:
                proc.wait()


def cell(times: Sequence[Optional[float]], cap: float) -> str:
    """``median (min-max)`` over the rounds, or ``> cap s`` when any round hit the cap."""
    if any(t is None for t in times):
        done = [t for t in times if t is not None]
        return f"> {cap:g} s" + (f" ({len(done)}/{len(times)} ended)" if done else "")
    values = [t for t in times if t is not None]
    spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f} s{spread}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run every fault with every contender, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cap", type=float, default=60.0)
    parser.add_argument("--no-c10d", action="store_true", help="leave out torchrun with the c10d rendezvous")
    args = parser.parse_args(argv)
    why = netns.unavailable()
    if why is not None:
        print(f"bench_faults: skipped: network namespaces: {why}")
        return 0
    contenders: dict[str, Callable[[str], Optional[float]]] = {
        "launcher (job watch)": lambda f: run_launcher(f, args.cap),
        "torchrun static": lambda f: run_torchrun(f, "static", args.cap)}
    if not args.no_c10d:
        contenders["torchrun c10d"] = lambda f: run_torchrun(f, "c10d", args.cap)
    results: dict[tuple[str, str], list[Optional[float]]] = {}
    for fault in FAULTS:
        for _round in range(args.rounds):
            for name, run in contenders.items():
                took = run(fault)
                results.setdefault((fault, name), []).append(took)
                print(f"  {fault:15} {name:22} {'> cap' if took is None else f'{took:.2f} s'}", flush=True)
    print(f"\nfrom the fault on algo-2 until every process of both hosts exited ({args.rounds} round(s), "
          f"median (min-max), capped at {args.cap:g} s; goals: <= 2 s after a kill or a worker failure, "
          f"<= 5 s after a partition)")
    header = ["fault", *contenders]
    rows = [header] + [[fault, *(cell(results[(fault, n)], args.cap) for n in contenders)] for fault in FAULTS]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return 0


if __name__ == "__main__":
    sys.exit(main())
