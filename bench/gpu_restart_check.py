"""Prepared check for a machine with a GPU (never part of the test suite): a job-wide restart of a 1-rank CUDA
job frees the old generation's GPU memory before the new generation starts (NVIDIA's ``ft_launcher`` waits up to
50 s for this; the launcher starts a new generation only after every process of the old one is gone).

The launcher runs ``--max-restarts 1 --nproc-per-node 1`` on this one host (one node decides for itself: no job
watch). The worker records, at its start and before it allocates anything, its pid, its generation
(``TORCHELASTIC_RESTART_COUNT``), the time, ``torch.cuda.mem_get_info()``'s free bytes and the processes that
``nvidia-smi --query-compute-apps`` says hold GPU memory; then it allocates :data:`FRACTION` of the card's memory.
Generation 0 exits 3 while it holds that block; generation 1 allocates the same block and exits 0. Checked:

1. the launcher exits 0 after exactly 1 restart: the outcome's ``restarts`` has 1 entry, ``recovered`` is true;
2. generation 0 held the block when it exited (its free memory fell by at least the block);
3. generation 1 saw at its start at least generation 0's free memory at its start less :data:`MARGIN`: the old
   block was free before the new generation started (both measured the same way, each with its own CUDA context,
   so memory that other processes hold does not count);
4. ``nvidia-smi`` at generation 1's start lists no memory for generation 0's pid (only where it lists generation
   1's own pid, i.e. its pids are this pid namespace's; said as not checkable otherwise).

Measured and printed: the seconds from generation 0's ``sys.exit(3)`` to generation 1's first line, and the free
memory each generation saw at its start. One line per check, ``ok``/``FAILED``; exit code 0 when every check
passed, 1 otherwise, 0 with ``skipped`` when no GPU is visible (``nvidia-smi -L``, ``/dev/nvidia0``). This checker
never imports torch; the worker does. Usage: ``.venv/bin/python bench/gpu_restart_check.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRACTION = 0.6  # of the card's total memory, allocated by every generation
MARGIN = 1 << 30  # bytes
LIMIT = 300.0  # seconds for the whole job (two generations' torch start on one host)
WORKER = '''import json, os, subprocess, sys, time
started = time.time()  # generation 1's first line
import torch

out, fraction = sys.argv[1], float(sys.argv[2])
generation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
free, total = torch.cuda.mem_get_info()
try:
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30).stdout
except (OSError, subprocess.SubprocessError):
    apps = None


def record(**fields):
    with open(out, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"generation": generation, **fields}) + "\\n")


record(event="start", pid=os.getpid(), started=started, free=free, total=total, apps=apps)
block = torch.ones(int(total * fraction), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
record(event="held", free=torch.cuda.mem_get_info()[0], exit_at=time.time())
if generation == 0:
    sys.exit(3)  # while it holds the block
'''


def gpu_visible() -> bool:
    """True when ``nvidia-smi -L`` lists a GPU or ``/dev/nvidia0`` exists."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        if listed.returncode == 0 and "GPU" in listed.stdout:
            return True
    except (OSError, subprocess.SubprocessError):
        pass
    return os.path.exists("/dev/nvidia0")


def run_job(tmp: str, script: str, records: str) -> tuple[int, str]:
    """The launcher's exit code and output; a job past :data:`LIMIT` is stopped by SIGTERM (its workers with it)."""
    env = {**os.environ, "TMPDIR": tmp, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "--platform", "local", "--nproc-per-node", "1",
                             "--max-restarts", "1", "--outcome-file", os.path.join(tmp, "outcome.json"),
                             script, records, str(FRACTION)],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        proc.terminate()
        output, _ = proc.communicate(timeout=120)
        output += f"\n(stopped after {LIMIT:g} s)"
    return proc.returncode, output


def main() -> int:
    """Run the job, print the checks and the measured figures."""
    if not gpu_visible():
        print("gpu_restart_check: skipped: no GPU visible (nvidia-smi -L, /dev/nvidia0)")
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu-restart-") as tmp:
        script, records = os.path.join(tmp, "gpu_restart_worker.py"), os.path.join(tmp, "records.jsonl")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(WORKER)
        code, output = run_job(tmp, script, records)
        try:
            with open(os.path.join(tmp, "outcome.json"), encoding="utf-8") as fh:
                outcome = json.load(fh)
        except (OSError, ValueError):
            outcome = {}
        seen: dict[tuple[int, str], dict] = {}
        if os.path.exists(records):
            with open(records, encoding="utf-8") as fh:
                seen = {(r["generation"], r["event"]): r for r in map(json.loads, fh)}
        start0, held0, start1 = seen.get((0, "start"), {}), seen.get((0, "held"), {}), seen.get((1, "start"), {})
        gib = float(1 << 30)
        block = int(start0.get("total", 0) * FRACTION)
        apps = {line.split(",")[0].strip(): line.strip() for line in (start1.get("apps") or "").splitlines() if line}
        pids = str(start0.get("pid")), str(start1.get("pid"))
        checks = [
            (f"exit code 0 (got {code}) after exactly 1 restart (restarts: {len(outcome.get('restarts', []))}, "
             f"recovered: {outcome.get('recovered')})",
             code == 0 and len(outcome.get("restarts", [])) == 1 and outcome.get("recovered") is True),
            (f"generation 0 held the block ({block / gib:.1f} GiB) when it exited: free "
             f"{start0.get('free', 0) / gib:.1f} -> {held0.get('free', 0) / gib:.1f} GiB",
             bool(start0 and held0) and start0["free"] - held0["free"] >= block),
            (f"generation 1 saw {start1.get('free', 0) / gib:.2f} GiB free at its start, at least generation 0's "
             f"{start0.get('free', 0) / gib:.2f} GiB less {MARGIN / gib:g} GiB (total "
             f"{start0.get('total', 0) / gib:.2f} GiB)",
             bool(start0 and start1) and start1["free"] >= start0["free"] - MARGIN),
        ]
        if pids[1] in apps:
            checks.append((f"nvidia-smi at generation 1's start lists no memory for generation 0's pid {pids[0]}: "
                           f"{sorted(apps.values())}", pids[0] not in apps))
        else:
            print(f"not checkable: nvidia-smi at generation 1's start does not list its pid {pids[1]} "
                  f"(another pid namespace, or no nvidia-smi): {start1.get('apps')!r}")
        for what, passed in checks:
            print(f"{'ok' if passed else 'FAILED'}: {what}")
        if held0 and start1:
            print(f"measured: generation 0's sys.exit(3) -> generation 1's first line: "
                  f"{start1['started'] - held0['exit_at']:.2f} s; free at the start: generation 0 "
                  f"{start0['free'] / gib:.2f} GiB, generation 1 {start1['free'] / gib:.2f} GiB, "
                  f"of {start0['total'] / gib:.2f} GiB")
        if not all(passed for _, passed in checks):
            print("\n".join(output.splitlines()[-60:]))
        return 0 if all(passed for _, passed in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
