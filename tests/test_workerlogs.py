"""The workers' output copied from their log files (launcher/workerlogs.py).

Whatever bytes a worker writes, cut into whatever reads: the copy is the text torchrun's ``--tee`` gave
(UTF-8, bad bytes replaced, ``\\r`` and ``\\r\\n`` as line ends), each line once with its rank's prefix.
Then real processes: torchrun's layout of files, written by workers whose ``RANK`` is in their
environment, copied as they write, a line without end shown after a while, the rest at the stop.
"""

from __future__ import annotations

import io
import os
import subprocess
import threading
import time

from conftest import PYTHON, assert_gone
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher import workerlogs

PREFIX = "[rank7]:"


def tee_text(data: bytes) -> str:
    """What torchrun's tailer read from a log: text mode, bad bytes replaced, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace").read()


def expected(data: bytes) -> str:
    text = tee_text(data)
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return "".join(f"{PREFIX}{line}\n" for line in lines)


pieces = st.lists(st.one_of(st.binary(max_size=40),
                            st.sampled_from([b"\r", b"\n", b"\r\n", "é".encode(), "🏖".encode(), b"\xff",
                                             "🏖".encode()[:2], b"x" * 70000])),
                  max_size=30)


@settings(max_examples=300, deadline=None)
@given(pieces, st.lists(st.integers(1, 70000), max_size=8))
def test_every_cut_of_any_bytes_gives_the_tee_text_with_one_prefix_per_line(parts, cuts):
    data = b"".join(parts)
    entry = workerlogs._Log("log", 0, 0)
    entry.prefix = PREFIX
    out, at = [], 0
    for size in [*cuts, len(data)]:
        out.append(entry.text(data[at:at + size]))
        at += size
        assert len(entry.partial) < workerlogs.LINE_LIMIT  # memory stays bounded whatever the line
    out.append(entry.text(b"", final=True))
    assert "".join(out) == expected(data)


def test_a_line_without_end_is_written_as_far_as_it_came_and_its_rest_has_no_second_prefix():
    entry = workerlogs._Log("log", 0, 0)
    entry.prefix = PREFIX
    assert entry.text(b"loading ") == ""
    assert entry.flush() == PREFIX + "loading "
    assert entry.text(b"done\nnext") == "done\n"
    assert entry.text(b"", final=True) == PREFIX + "next\n"


WORKER = """import os, sys, time
local = os.environ["LOCAL_RANK"]
log = os.path.join(sys.argv[1], "job_x", "attempt_0", local)
os.makedirs(log, exist_ok=True)
out = os.open(os.path.join(log, "stdout.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
err = os.open(os.path.join(log, "stderr.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
os.write(out, b"hello from " + local.encode() + b"\\n")
os.write(err, b"waiting without end ")
sys.stdin.readline()
os.write(err, b"and its end\\n")
os.write(out, b"x" * (3 << 20) + b"\\nlast words")
"""


def test_real_workers_are_copied_as_they_write_with_their_ranks_and_the_rest_at_the_stop(tmp_path):
    # Two workers play torchrun's (this test plays torchrun: they are its children, RANK 4 and 5 in their
    # environment). The copier learns of their four files, copies the first lines as they come, shows a
    # line without end after PARTIAL_AFTER, and at the stop the rest, the last line ended.
    got: dict[int, list[bytes]] = {0: [], 1: []}
    lock = threading.Lock()

    def write(stream: int, chunk: bytes) -> None:
        with lock:
            got[stream].append(chunk)

    def text(stream: int) -> str:
        with lock:
            return b"".join(got[stream]).decode()

    workers = [subprocess.Popen([PYTHON, "-c", WORKER, str(tmp_path)], stdin=subprocess.PIPE,
                                env={**os.environ, "LOCAL_RANK": str(local), "RANK": str(4 + local)})
               for local in (0, 1)]
    copier = workerlogs.LogCopier(str(tmp_path), os.getpid(), 4, 4, (lambda c: write(0, c), lambda c: write(1, c)),
                                  print)
    try:
        waited = time.monotonic() + 60
        while text(1).count("waiting without end") < 2 and time.monotonic() < waited:
            time.sleep(0.01)
        assert sorted(text(0).splitlines()) == ["[rank4]:hello from 0", "[rank5]:hello from 1"]
        assert sorted(text(1).split("[rank")) == ["", "4]:waiting without end ", "5]:waiting without end "]
        assert len(copier.positions()) == 4
        for worker in workers:
            worker.communicate(b"go\n", timeout=60)
        while text(1).count("and its end\n") < 2 and time.monotonic() < waited:
            time.sleep(0.01)
        assert copier.stop()
        assert not copier._thread.is_alive()
        err = text(1)
        for rank in (4, 5):  # the rest of the line came without a second prefix, whatever came between
            assert f"[rank{rank}]:waiting without end " in err
        assert err.count("and its end\n") == 2 and err.count("[rank") == 2
        out = text(0)  # two 3 MiB lines, each written in pieces as it comes: the other rank's may come between
        for local in (0, 1):
            assert f"[rank{4 + local}]:hello from {local}\n" in out and f"[rank{4 + local}]:last words\n" in out
        assert out.count("x") == 2 * (3 << 20) and out.count("[rank") == 6 and out.endswith("\n")
        positions = copier.positions()
        assert sorted(positions.values()) == sorted([len("waiting without end and its end\n")] * 2 + [
            len("hello from 0\n") + (3 << 20) + len("\nlast words")] * 2)
    finally:
        copier.stop()
        for worker in workers:
            worker.kill()
            worker.wait()
    assert_gone([worker.pid for worker in workers])


def test_a_worker_gone_before_its_rank_was_read_gets_the_first_rank_plus_its_local_rank(tmp_path):
    log = tmp_path / "job_x" / "attempt_0" / "1"
    log.mkdir(parents=True)
    (log / "stderr.log").write_bytes(b"Traceback (most recent call last):\nKeyError: 3\n")
    (log / "stdout.log").write_bytes(b"")
    got: list[bytes] = []
    copier = workerlogs.LogCopier(str(tmp_path), os.getpid(), 8, 2, (got.append, got.append), print)
    assert copier.stop()
    assert b"".join(got) == b"[rank9]:Traceback (most recent call last):\n[rank9]:KeyError: 3\n"
    assert not copier._thread.is_alive() and copier._watch is None


def test_a_flood_in_one_log_holds_back_neither_the_search_for_new_logs_nor_their_lines(tmp_path):
    # Rank 0's log holds 64 MiB before the copy starts (1024 chunks: the copier always has more to read);
    # its first chunk makes rank 1's log appear (written from the copier's own thread, so the order is
    # fixed). Rank 1's line comes long before the end of rank 0's flood.
    first = tmp_path / "job_x" / "attempt_0" / "0"
    first.mkdir(parents=True)
    with open(first / "stdout.log", "wb") as fh:
        for _ in range(64):
            fh.write((b"y" * 1023 + b"\n") * 1024)
    (first / "stderr.log").write_bytes(b"")
    order: list[str] = []

    def write(chunk: bytes) -> None:
        if not order:
            second = tmp_path / "job_x" / "attempt_0" / "1"
            second.mkdir()
            (second / "stderr.log").write_bytes(b"")
            (second / "stdout.log").write_bytes(b"hello\n")
        order.append("hello" if b"hello" in chunk else "flood")

    copier = workerlogs.LogCopier(str(tmp_path), os.getpid(), 0, 4, (write, write), print)
    total = 64 * 1024 * 1024 + len("hello\n")
    waited = time.monotonic() + 120
    while sum(copier.positions().values()) < total and time.monotonic() < waited:
        time.sleep(0.01)
    assert copier.stop()
    assert order.count("hello") == 1 and order.index("hello") < 10, order.index("hello")
    assert sum(copier.positions().values()) == total


def test_before_torchrun_makes_the_log_directory_the_copier_sleeps_then_copies_at_once(tmp_path, monkeypatch):
    # torchrun makes its logs' directory when it starts the workers, seconds after it starts (its imports, the
    # rendezvous). Until then the copier sleeps on inotify: it looks for the logs once (each stream), not every
    # FIND_EVERY; the directory wakes it. Without inotify it looks every FIND_EVERY and copies them all the same.
    looks: list[str] = []
    real_glob = workerlogs.glob.glob
    monkeypatch.setattr(workerlogs.glob, "glob", lambda pattern: looks.append(pattern) or real_glob(pattern))
    for inotify in (True, False):
        root = tmp_path / f"inotify-{inotify}"
        root.mkdir()
        if not inotify:
            monkeypatch.setattr(workerlogs, "watch_writes", lambda: None)
        looks.clear()
        got: list[bytes] = []
        copier = workerlogs.LogCopier(str(root), os.getpid(), 0, 2, (got.append, got.append), print)
        try:
            time.sleep(1.0)  # torchrun still importing
            empty = len(looks)
            log = root / "job_x" / "attempt_0" / "0"
            log.mkdir(parents=True)
            (log / "stderr.log").write_bytes(b"")
            (log / "stdout.log").write_bytes(b"hello\n")
            waited = time.monotonic() + 30
            while not got and time.monotonic() < waited:
                time.sleep(0.01)
            assert b"".join(got) == b"[rank0]:hello\n"
        finally:
            assert copier.stop()
        if inotify:
            assert empty <= 2, looks  # the first look, for each stream (every FIND_EVERY would be about 40)
