"""The worker logs' disk budget (launcher/logspace.py): holes only where torchrun's tailer has read.

A real process plays torchrun's tailer: it opens a log read-only and reads a known number of bytes.
The trimmer must free exactly the blocks before that position (keeping the last MiB whatever the
position), leave the file's size and every byte after them as they were, and never touch a log that
no reader has opened.
"""

from __future__ import annotations

import os
import subprocess
import time

from conftest import PYTHON, REPO, assert_gone

from launcher import logspace

MiB = 1 << 20
READER = """import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
left = int(sys.argv[2])
while left:
    left -= len(os.read(fd, min(left, 1 << 20)))
print("read", flush=True)
time.sleep(600)
"""


def make_log(root, name: str, size: int) -> str:
    path = root / "logs" / "job" / "attempt_0" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(range(251)) * (size // 251) + b"x" * (size % 251))
    return str(path)


def allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_holes_only_behind_the_tailer_and_never_in_the_last_mib(tmp_path):
    data_size = 8 * MiB
    cases = {"0/stdout.log": 6 * MiB, "1/stdout.log": 7 * MiB + 4000, "2/stderr.log": 1000}
    paths = {name: make_log(tmp_path, name, data_size) for name in cases}
    untouched = make_log(tmp_path, "3/stderr.log", data_size)  # nobody reads it: left alone
    original = (tmp_path / "logs" / "job" / "attempt_0" / "0" / "stdout.log").read_bytes()  # every log's bytes
    readers = [subprocess.Popen([PYTHON, "-c", READER, paths[name], str(pos)], stdout=subprocess.PIPE)
               for name, pos in cases.items()]
    try:
        for reader in readers:
            assert reader.stdout.readline() == b"read\n"
        # Each reader plays torchrun for its own log (the trimmer looks at one process's descriptors).
        for reader, (name, pos) in zip(readers, cases.items()):
            trimmer = logspace.LogTrimmer(reader.pid, str(tmp_path / "logs"), print)
            trimmer.stop()  # no thread: one trim, by hand
            trimmer.trim()
            expected = min(pos, data_size - logspace.KEEP_BYTES) // 4096 * 4096
            assert trimmer.punched.get(os.path.realpath(paths[name]), 0) == expected, name
            assert os.path.getsize(paths[name]) == data_size  # offsets stay valid
            assert allocated(paths[name]) <= data_size - expected + 64 * 1024, name
            with open(paths[name], "rb") as fh:
                content = fh.read()
            assert content[:expected] == bytes(expected)  # a hole reads as zeros
            assert content[expected:] == original[expected:], name  # everything not yet read is intact
        assert allocated(untouched) >= data_size
    finally:
        for reader in readers:
            reader.kill()
            reader.wait()
    assert_gone([r.pid for r in readers])


def test_a_full_disk_is_named(tmp_path):
    assert logspace.disk_full_note(str(tmp_path)) is None  # this test's own disk has room
    assert logspace.free_bytes(str(tmp_path / "missing")) is None


def test_a_full_tmpfs_is_named(tmp_path):
    import shutil

    import pytest

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("user and mount namespaces are not available here")
    full = tmp_path / "full"
    full.mkdir()
    # A 512 KiB tmpfs in a private mount namespace of this test's own, filled up.
    code = "import sys; from launcher.logspace import disk_full_note; print(disk_full_note(sys.argv[1]))"
    script = ('mount -t tmpfs -o size=512k tmpfs "$1" && dd if=/dev/zero of="$1/fill" bs=4k 2>/dev/null; '
              'exec "$2" -c "$3" "$1"')
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(full), PYTHON, code],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("the disk of TMPDIR is full (0 KiB free at "), proc.stdout


WRITER = """import os, sys, time
read = os.open(sys.argv[1], os.O_RDONLY)  # the tailer's descriptor, as torchrun's
write = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)  # the worker's, which torchrun keeps a copy of
print("ready", flush=True)
for line in sys.stdin:  # a size in MiB: write it, and read all of it as the tailer would
    os.write(write, b"x" * (int(line) << 20))
    while os.read(read, 1 << 20):
        pass
    print("written", flush=True)
"""


def test_the_trimmer_sleeps_until_a_log_is_written_sees_a_flood_at_once_and_stops_at_once(tmp_path):
    # One process plays torchrun (it holds the log for reading and for writing); the trimmer learns of the
    # log, then sleeps until it is written (inotify): a burst of 40 MiB after a quiet second is freed
    # without waiting for the next periodic trim (1 s while the logs are small), and stop() returns at once
    # wherever the thread is (it once read its wake-up pipe until a blocking read never returned: 5 s).
    log = make_log(tmp_path, "0/stdout.log", 0)
    proc = subprocess.Popen([PYTHON, "-c", WRITER, log], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    trimmer = None
    try:
        assert proc.stdout.readline() == b"ready\n"  # type: ignore[union-attr]
        trimmer = logspace.LogTrimmer(proc.pid, str(tmp_path / "logs"), print)
        waited = time.monotonic() + 30
        while trimmer.sizes != {log: 0} and time.monotonic() < waited:
            time.sleep(0.01)
        assert trimmer.sizes == {log: 0}  # learned of the log
        time.sleep(1.5)  # quiet: the trimmer sleeps until a write (or its next trim, 1 s after the last)
        proc.stdin.write(b"40\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        assert proc.stdout.readline() == b"written\n"  # type: ignore[union-attr]
        written = time.monotonic()
        while trimmer.freed < 32 * MiB and time.monotonic() < written + 30:
            time.sleep(0.005)
        took = time.monotonic() - written
        assert trimmer.freed >= 32 * MiB and allocated(log) <= 8 * MiB, (trimmer.freed, allocated(log))
        time.sleep(1.5)  # quiet again: asleep until a write
        trimmer.stop()
        assert not trimmer._thread.is_alive() and trimmer._writes is None  # ended, its descriptors closed by stop()
        print(f"\nfreed {trimmer.freed >> 20} MiB {took * 1000:.0f} ms after the burst was read")
    finally:
        if trimmer is not None:
            trimmer.stop()
        proc.kill()
        proc.wait()
    assert_gone([proc.pid])
