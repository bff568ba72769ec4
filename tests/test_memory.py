"""The launcher's memory and disk stay bounded whatever the workers print, and it still finds the real cause.

One real launcher run (1 process) whose worker prints one endless stdout line (no newline ever), long
stderr lines and then ordinary stderr lines, about 1.4 GB in all, and then fails with a known exception
(no error file: the launcher must find it in the log). The launcher's own peak RSS (VmHWM) is sampled
from /proc until it exits, and the disk its run directory under ``$TMPDIR`` takes (the blocks
allocated, torchrun's worker logs included) every 20 ms.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
from conftest import assert_gone, free_port
from test_launcher_processes import job_pids, make_host, start_launcher

MiB = 1 << 20
ENDLESS_MIB, LONG_MIB, LONG_COUNT, LINES_MIB = 128, 50, 4, 1024
PEAK_LIMIT_KIB = 50 * 1024
# Each log: its last MiB, at most 32 MiB not copied yet (launcher/logspace.py), and what the worker writes
# (at GB/s into the page cache) before the trimmer's next look; a loaded machine delays looks, hence the
# margin: 121-267 MiB in 11 quiet runs since the launcher copies the logs itself. Unbounded: 1.4 GB.
DISK_LIMIT_MIB = 400

NOISY = """\
import json, os, sys
MiB = 1 << 20
with open(os.path.join(os.environ["WORKER_RECORD_DIR"], "rank0.json"), "w") as fh:
    json.dump({"rank": 0, "pid": os.getpid(), "ppid": os.getppid()}, fh)  # torchrun's pid too
endless, long_mib, long_count, lines = (int(a) for a in sys.argv[1:5])

def write(fd, data, times):
    for _ in range(times):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

write(1, b"e" * MiB, endless)                        # one stdout line that never ends
for _ in range(long_count):                          # long stderr lines
    write(2, b"L" * MiB, long_mib)
    write(2, b"\\n", 1)
block = b"".join(b"step %08d loss 0.123456 lr 0.001 ordinary progress line\\n" % i for i in range(18000))
write(2, block, lines * MiB // len(block))           # ordinary stderr lines
raise KeyError("the real cause: shard 42 is missing")
"""


class Drain:
    """Read a stream in bounded chunks as fast as it comes; count the bytes, keep the last 64 KiB."""

    def __init__(self, stream) -> None:
        self.count = 0
        self.tail = b""
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream) -> None:
        fd = stream.fileno()  # never read through the text wrapper: os.read straight from the pipe
        while True:
            chunk = os.read(fd, MiB)
            if not chunk:
                return
            self.count += len(chunk)
            self.tail = (self.tail + chunk)[-65536:]


class DiskSampler:
    """The largest number of bytes allocated under ``root``'s ``ddp-launcher-*`` run directories."""

    def __init__(self, root) -> None:
        self.root, self.peak, self.done = str(root), 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.02):
            used = 0
            for name in os.listdir(self.root):
                if name.startswith("ddp-launcher-"):
                    for top, _dirs, files in os.walk(os.path.join(self.root, name)):
                        for file in files:
                            with contextlib.suppress(OSError):
                                used += os.lstat(os.path.join(top, file)).st_blocks * 512
            self.peak = max(self.peak, used)

    def stop(self) -> int:
        self.done.set()
        self.thread.join(timeout=30)
        return self.peak


def sample(pid: int, proc) -> tuple[int, int, float]:
    """Sample ``pid`` until it exits: the largest VmHWM and VmRSS (KiB), its last CPU time (s)."""
    hwm = rss = 0
    cpu = 0.0
    while proc.poll() is None:
        try:
            with open(f"/proc/{pid}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if line.startswith(("VmHWM", "VmRSS")))
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            break
        if "VmHWM" in fields:
            hwm = max(hwm, int(fields["VmHWM"].split()[0]))
            rss = max(rss, int(fields["VmRSS"].split()[0]))
            cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        time.sleep(0.02)
    return hwm, rss, cpu


@pytest.mark.job
def test_gigabytes_of_output_in_bounded_memory(tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text(NOISY)
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    started = time.monotonic()
    proc = start_launcher(base, ["--nproc-per-node", "1", str(script), str(ENDLESS_MIB), str(LONG_MIB),
                                 str(LONG_COUNT), str(LINES_MIB)],
                          free_port(), ["algo-1"], TMPDIR=str(tmp_path))  # torchrun's logs go under tmp_path
    out, err = Drain(proc.stdout), Drain(proc.stderr)
    disk = DiskSampler(tmp_path)
    hwm, rss, cpu = sample(proc.pid, proc)
    proc.wait(timeout=300)
    disk_peak = disk.stop()
    elapsed = time.monotonic() - started
    out.thread.join(timeout=30)
    err.thread.join(timeout=30)
    assert len(job_pids(proc, base)) == 3  # the launcher, torchrun, the worker
    assert_gone(job_pids(proc, base))
    payload = (ENDLESS_MIB + LONG_MIB * LONG_COUNT + LINES_MIB) * MiB
    print(f"\nlauncher peak RSS {hwm / 1024:.1f} MiB (max VmRSS sampled {rss / 1024:.1f} MiB); "
          f"{(out.count + err.count) / MiB:.0f} MiB through it in {elapsed:.1f} s "
          f"({(out.count + err.count) / MiB / elapsed:.0f} MiB/s, start-up included); launcher CPU {cpu:.1f} s; "
          f"peak disk under TMPDIR {disk_peak / MiB:.1f} MiB")
    assert proc.returncode == 1, err.tail[-3000:]
    assert out.count >= ENDLESS_MIB * MiB and out.count + err.count >= payload  # everything went through
    report = (base / "output" / "failure").read_text()
    assert report.splitlines()[:2] == ["algo-1: rank 0 (local rank 0) exited with code 1",
                                       "KeyError: 'the real cause: shard 42 is missing'"], report
    assert err.tail.decode("utf-8", "replace").rstrip("\n").endswith(report.rstrip("\n"))
    assert 0 < hwm <= PEAK_LIMIT_KIB, f"launcher peak RSS {hwm} KiB"
    assert 0 < disk_peak <= DISK_LIMIT_MIB * MiB, f"peak disk under TMPDIR {disk_peak / MiB:.1f} MiB"
