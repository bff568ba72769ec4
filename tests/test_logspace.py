"""The worker logs' disk budget (launcher/logspace.py): holes only where the copy has read.

The copier's positions (launcher/workerlogs.py) are given as a value. The trimmer must free exactly the
blocks before each position (keeping the last MiB whatever the position), leave the file's size and
every byte after them as they were, and never touch a log the copy does not know.
"""

from __future__ import annotations

import os
import subprocess
import time

from conftest import PYTHON, REPO, assert_gone

from launcher import logspace, proctree

MiB = 1 << 20


def make_log(root, name: str, size: int) -> str:
    path = root / "logs" / "job" / "attempt_0" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(range(251)) * (size // 251) + b"x" * (size % 251))
    return str(path)


def allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_holes_only_behind_the_copy_and_never_in_the_last_mib(tmp_path):
    data_size = 8 * MiB
    cases = {"0/stdout.log": 6 * MiB, "1/stdout.log": 7 * MiB + 4000, "2/stderr.log": 1000, "3/stdout.log": 0}
    paths = {name: make_log(tmp_path, name, data_size) for name in cases}
    untouched = make_log(tmp_path, "3/stderr.log", data_size)  # the copy does not know it: left alone
    original = (tmp_path / "logs" / "job" / "attempt_0" / "0" / "stdout.log").read_bytes()  # every log's bytes
    positions = {paths[name]: pos for name, pos in cases.items()}
    trimmer = logspace.LogTrimmer(os.getpid(), str(tmp_path / "logs"), print, lambda: positions)
    trimmer.stop()  # no thread: one trim, by hand
    trimmer.trim()
    assert trimmer.paused == {}  # nothing lags by 32 MiB
    for name, pos in cases.items():
        expected = min(pos, data_size - logspace.KEEP_BYTES) // 4096 * 4096
        assert trimmer.punched.get(paths[name], 0) == expected, name
        assert os.path.getsize(paths[name]) == data_size  # offsets stay valid
        assert allocated(paths[name]) <= data_size - expected + 64 * 1024, name
        with open(paths[name], "rb") as fh:
            content = fh.read()
        assert content[:expected] == bytes(expected)  # a hole reads as zeros
        assert content[expected:] == original[expected:], name  # everything not yet read is intact
    assert allocated(untouched) >= data_size


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
write = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)  # the worker's descriptor
print("ready", flush=True)
for line in sys.stdin:  # a size in MiB: write it
    os.write(write, b"x" * (int(line) << 20))
    print("written", flush=True)
"""


def test_the_trimmer_sleeps_until_a_log_is_written_sees_a_flood_at_once_and_stops_at_once(tmp_path):
    # One process plays the worker, the test the copier (it has read everything written); the trimmer learns
    # of the log, then sleeps until it is written (inotify): a burst of 40 MiB after a quiet second is freed
    # without waiting for the next periodic trim (1 s while the logs are small), and stop() returns at once
    # wherever the thread is (it once read its wake-up pipe until a blocking read never returned: 5 s).
    log = make_log(tmp_path, "0/stdout.log", 0)
    proc = subprocess.Popen([PYTHON, "-c", WRITER, log], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    trimmer = None
    try:
        assert proc.stdout.readline() == b"ready\n"  # type: ignore[union-attr]
        trimmer = logspace.LogTrimmer(proc.pid, str(tmp_path / "logs"), print,
                                      lambda: {log: os.path.getsize(log)})  # all of it copied
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


def test_a_worker_far_ahead_of_the_copy_waits_for_it_as_a_pipe_would(tmp_path):
    # The worker (a child of this test, which plays torchrun) writes to its log as stdout, 1 MiB every 3 ms,
    # until killed. While the copy stands still it is paused once 32 MiB ahead (a few more under load); once
    # the copy keeps up it is resumed. A worker writing 96 MiB while the copy has ended (nobody would ever
    # catch up) is never held.
    log = make_log(tmp_path, "0/stdout.log", 0)
    copied = {"pos": 0, "copying": True, "keeps_up": False}
    code = ("import os, sys, time\nfor _ in range(int(sys.argv[1])):\n"
            "    os.write(1, b'x' * (1 << 20))\n    time.sleep(0.003)\n")

    def positions() -> dict[str, int]:
        return {log: os.path.getsize(log) if copied["keeps_up"] else copied["pos"]}

    trimmer = logspace.LogTrimmer(os.getpid(), str(tmp_path / "logs"), print, positions, lambda: copied["copying"])
    procs = []
    try:
        with open(log, "ab") as out:
            procs.append(subprocess.Popen([PYTHON, "-c", code, str(1 << 30)], stdout=out))
        waited = time.monotonic() + 60
        while not trimmer.paused and time.monotonic() < waited:
            time.sleep(0.01)
        assert list(trimmer.paused) == [procs[0].pid], "the worker was not paused"
        while proctree.state(procs[0].pid) not in ("T", "t") and time.monotonic() < waited:
            time.sleep(0.01)  # noted as paused just before the SIGSTOP is sent
        assert proctree.state(procs[0].pid) in ("T", "t")
        size = os.path.getsize(log)
        assert logspace.LAG_LIMIT < size <= 3 * logspace.LAG_LIMIT, size
        time.sleep(0.5)
        assert os.path.getsize(log) == size  # it waits
        copied["keeps_up"] = True
        while os.path.getsize(log) < size + 8 * MiB and time.monotonic() < waited:
            time.sleep(0.01)
        assert os.path.getsize(log) >= size + 8 * MiB and not trimmer.paused  # resumed: it writes on
        assert trimmer.pauses == 1
        procs[0].kill()
        procs[0].wait()
        copied.update(keeps_up=False, copying=False)  # the copy has ended: a worker is never held
        size = os.path.getsize(log)
        with open(log, "ab") as out:
            procs.append(subprocess.Popen([PYTHON, "-c", code, "96"], stdout=out))
        assert procs[1].wait(timeout=60) == 0
        assert os.path.getsize(log) == size + 96 * MiB and trimmer.pauses == 1
    finally:
        trimmer.stop()
        for proc in procs:
            proc.kill()
            proc.wait()
    assert_gone([proc.pid for proc in procs])


def test_before_torchrun_makes_the_log_directory_the_trimmer_sleeps(tmp_path, monkeypatch):
    # Until the first log directory is made the trimmer sleeps on inotify (it looks once per START_WAIT, not
    # every START_EVERY); the directory wakes it and it learns of the log at once.
    looks: list[str] = []
    real = logspace.has_entries
    monkeypatch.setattr(logspace, "has_entries", lambda directory: looks.append(directory) or real(directory))
    (tmp_path / "logs").mkdir()
    log = str(tmp_path / "logs" / "job" / "attempt_0" / "0" / "stdout.log")
    trimmer = logspace.LogTrimmer(os.getpid(), str(tmp_path / "logs"), print, lambda: {log: 0})
    try:
        time.sleep(1.0)  # torchrun still importing
        empty = len(looks)
        make_log(tmp_path, "0/stdout.log", 10)
        waited = time.monotonic() + 30
        while trimmer.sizes != {log: 10} and time.monotonic() < waited:
            time.sleep(0.01)
        assert trimmer.sizes == {log: 10}
    finally:
        trimmer.stop()
    assert not trimmer._thread.is_alive()
    assert empty <= 3, looks  # every START_EVERY (0.1 s) would be about 10
