"""Prepared check for a machine with a GPU (never part of the test suite): a 1-rank NCCL job hung in a
CUDA synchronisation behind a spinning kernel.

The worker joins an NCCL process group, all-reduces a few times (the Flight Recorder keeps them), starts a
kernel that spins for about an hour (``torch.cuda._sleep``) and calls ``torch.cuda.synchronize()``: the
main thread waits in one C call that releases the GIL, so the bootstrap's sampler sees it still. The
launcher runs with ``--hang-timeout`` :data:`TIMEOUT` and ``TMPDIR`` in a fresh directory. Checked:

1. the job ends with exit code 124 (class ``hang``) within the timeout + 60 s, before NCCL's own 600 s;
2. the report names the line of the synchronisation (``gpu_hang_worker.py:<line>``);
3. the Flight Recorder's dump landed: ``$TMPDIR/nccl_trace_rank_0`` exists and is not empty.

Prints one line per check and ``ok``/``FAILED``; exit code 0 when every check passed, 1 otherwise, 0 with
``skipped`` when no GPU is visible. Usage: ``.venv/bin/python bench/gpu_hang_check.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 30.0
WORKER = '''import os, torch, torch.distributed as dist
dist.init_process_group("nccl")
torch.cuda.set_device(0)
x = torch.ones(1024, device="cuda")
for _ in range(5):
    dist.all_reduce(x)
torch.cuda.synchronize()
print("collectives done; spinning", flush=True)
torch.cuda._sleep(2 ** 62)  # a kernel that spins for (practically) ever
torch.cuda.synchronize()  # at:sync
'''


def main() -> int:
    """Run the job, print the checks."""
    import torch

    if not torch.cuda.is_available():
        print("gpu_hang_check: skipped: no GPU visible")
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu-hang-") as tmp:
        script = os.path.join(tmp, "gpu_hang_worker.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(WORKER)
        line = next(i for i, text in enumerate(WORKER.splitlines(), 1) if text.endswith("# at:sync"))
        env = {**os.environ, "TMPDIR": tmp, "PYTHONPATH": REPO}
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "launcher", "--platform", "local", "--nproc-per-node", "1",
                               "--hang-timeout", f"{TIMEOUT:g}", "--outcome-file", os.path.join(tmp, "outcome.json"),
                               script], cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT + 300)
        took = time.monotonic() - started
        output = proc.stdout + proc.stderr
        traces = [os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith("nccl_trace_rank_")]
        checks = [
            (f"exit code 124 (got {proc.returncode}) within {TIMEOUT:g} + 60 s (took {took:.0f} s)",
             proc.returncode == 124 and took < TIMEOUT + 60),
            (f"the report names gpu_hang_worker.py:{line} (the synchronisation)",
             f"gpu_hang_worker.py:{line}" in output),
            (f"the Flight Recorder's dump landed: {traces}",
             any(os.path.getsize(path) > 0 for path in traces)),
        ]
        for what, passed in checks:
            print(f"{'ok' if passed else 'FAILED'}: {what}")
        if not all(passed for _, passed in checks):
            print("\n".join(output.splitlines()[-60:]))
        return 0 if all(passed for _, passed in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
