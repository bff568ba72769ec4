"""SIGUSR1/SIGUSR2 reach the workers and stop nothing (SLURM's ``--signal=USR1@60``: "checkpoint now")."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import assert_gone, free_port, is_alive
from test_launcher_processes import WORKER, job_pids, make_host, records, start_launcher, wait_for_records

RUN = ["--nproc-per-node", "2", WORKER, "--steps", "16", "--step-sleep", "0.25"]


@pytest.mark.job
@pytest.mark.parametrize("handled, to_every_process", [(True, False), (False, True)],
                         ids=["handled-sent-to-the-launcher", "unhandled-sent-to-every-process-as-slurm-does"])
def test_usr1_is_forwarded_and_the_job_goes_on(tmp_path, handled, to_every_process):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    proc = start_launcher(base, RUN + (["--note-usr1"] if handled else []), free_port(), ["algo-1"])
    try:
        found = wait_for_records(base, 2, timeout=150, steps=2)
        targets = [proc.pid]
        if to_every_process:  # SLURM signals every process of the step: torchrun must survive it too
            targets += [r["ppid"] for r in found.values()] + [r["pid"] for r in found.values()]
        for pid in dict.fromkeys(targets):
            os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
        assert all(is_alive(r["pid"]) for r in found.values()), "a worker died of SIGUSR1"
        _out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    final = records(base)
    assert all(r["steps_done"] == 16 for r in final.values())  # the job went on to its end
    expected = ["SIGUSR1"] if handled else []
    assert all(r["signals"][:1] == expected for r in final.values()), final
    assert_gone(job_pids(proc, base))
