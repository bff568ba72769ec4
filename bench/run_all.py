"""Run every benchmark one after the other (they share the machine's cores, so never in parallel).

    .venv/bin/python bench/run_all.py
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = (
    ["bench_launcher.py", "--pairs", "15", "--steps", "100"],
    ["bench_simulate.py", "--pairs", "7"],
    ["bench_train_throughput.py", "--rounds", "5", "--variants"],
    ["bench_faults.py", "--rounds", "3"],
    ["bench_watch_scale.py", "--rounds", "3"],
    ["bench_watch_end.py", "--rounds", "30"],
    ["bench_hangs.py", "--rounds", "20"],
    ["bench_restart.py", "--rounds", "5", "--hosts", "2,4,8"],
    ["bench_held_memory.py", "--nproc", "2"],
)

if __name__ == "__main__":
    for name, *args in BENCHMARKS:
        print(f"\n## {name} {' '.join(args)}", flush=True)
        subprocess.run([sys.executable, os.path.join(HERE, name), *args], check=True)
