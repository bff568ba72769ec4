"""Which thread of a worker's dump is the script's: the id the worker's bootstrap recorded (launcher/stacks.py,
launcher/bootstrap.py), from real Python processes started through ``launcher/bootstrap.py`` and dumped by
SIGABRT through :func:`launcher.stacks.take`.

- faulthandler prints the main thread last; a thread started by ``_thread`` whose outermost frame is a
  ``<module>`` (what the heuristics look for) is printed before it, and is no main: the recorded id picks the
  script's thread;
- a worker with more threads than faulthandler prints (100) gives a dump without its main thread: the rank
  has no position, and the reason says so, never another thread's frame;
- the bootstrap's sampler, asked to hold still before the dump (:func:`launcher.stacks.park_samplers`), says so
  and is found parked in the dump, beside the main thread; it turned the dump to the worker's own file, which
  another thread's writes to stderr cannot break, and the dump is appended to the worker's log.

Every process started here is ended by PID and proved gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from typing import Any, Callable

from conftest import PYTHON, REPO, assert_gone
from hypothesis import given
from hypothesis import strategies as st

from launcher import hang, stacks

BOOTSTRAP = os.path.join(REPO, "launcher", "bootstrap.py")
SCRIPT = textwrap.dedent("""
    import _thread, os, sys, threading, time
    threads, chatty = int(sys.argv[2]), sys.argv[3:] == ["chatty"]
    def helper():
        while True:
            time.sleep(0.01)
    def bar():  # a progress bar's refresh, as tqdm writes it: no newline
        while True:
            sys.stderr.write("\\r 38%|###7      | 3/8 [00:05<00:08,  1.63s/it]")
            sys.stderr.flush()
            time.sleep(0.0005)
    if chatty:
        threading.Thread(target=bar, daemon=True).start()
    for _ in range(threads):
        threading.Thread(target=helper, daemon=True).start()
    # a thread no ``threading`` started whose outermost frame is a <module>: it looks like a main thread
    started = _thread.allocate_lock()
    started.acquire()
    code = compile("started.release()\\nimport time\\nwhile True: time.sleep(0.01)", "/job/fake.py", "exec")
    _thread.start_new_thread(exec, (code, {"started": started}))
    started.acquire()
    def blocked():
        open(sys.argv[1], "w").close()
        os.read(os.pipe()[0], 1)  # at:read
    blocked()
""")
LINE = next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if line.endswith("# at:read"))
BOUND = 60.0  # stacks.take's bound: generous (a loaded host); the test ends far sooner


def start_worker(tmp_path: Any, threads: int, *mode: str, **extra: str) -> subprocess.Popen:
    """Start one worker through the bootstrap (rank 3, ``threads`` helper threads, with ``chatty`` a thread that
    writes a progress bar meanwhile; ``extra`` in its environment: without ``DDP_LAUNCHER_PROGRESS`` no sampler)
    and wait until its script blocks."""
    tmp_path.mkdir(exist_ok=True)
    script, exits, ready = tmp_path / "train.py", tmp_path / "exits", tmp_path / "ready"
    script.write_text(SCRIPT)
    exits.mkdir()
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "RANK": "3", "DDP_LAUNCHER_EXIT_DIR": str(exits)}
    env.pop("DDP_LAUNCHER_PROGRESS", None)
    with open(tmp_path / "stderr.log", "wb") as fh:
        proc = subprocess.Popen([PYTHON, "-u", BOOTSTRAP, str(script), str(ready), str(threads), *mode],
                                stderr=fh, stdout=subprocess.DEVNULL, env={**env, **extra})
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() >= deadline:
            proc.kill()
            proc.wait()
            raise AssertionError((tmp_path / "stderr.log").read_text())
        time.sleep(0.05)
    return proc


def freeze_and_take(proc: subprocess.Popen, before: Callable[[], None] = lambda: None) -> stacks.Taken:
    """``before()`` (checks on the living worker), then freeze the worker and take its stacks; whatever happens,
    the worker is ended by PID and proved gone."""
    try:
        before()
        stacks.signal_workers([proc.pid], signal.SIGSTOP)
        return stacks.take([proc.pid], None, BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert_gone([proc.pid])


def take_one(tmp_path: Any, threads: int, *mode: str, **extra: str) -> tuple[stacks.Taken, int, subprocess.Popen]:
    """Start one worker (:func:`start_worker`), freeze it, take its stacks."""
    proc = start_worker(tmp_path, threads, *mode, **extra)
    main = []

    def recorded() -> None:
        main.append(int((tmp_path / "exits" / f"{proc.pid}.thread").read_text()))
        assert stacks.describe(proc.pid).main == main[0]

    taken = freeze_and_take(proc, recorded)
    return taken, main[0], proc


def test_the_recorded_main_thread_is_chosen_though_printed_last_after_one_that_looks_like_a_main(
        tmp_path: Any) -> None:
    taken, main, proc = take_one(tmp_path, 3)
    assert proc.returncode == -signal.SIGABRT and taken.why == {} and taken.mains == {3: main}
    threads = taken.dumps[3]
    assert len(threads) == 5 and hang.thread_id(threads[-1].ident) == main  # faulthandler: the main thread last
    # by its looks the thread running /job/fake.py's <module> is a main thread too: printed before the main one,
    # it is passed over (the last printed that fits), and taken in another order; the id is never fooled
    decoy = hang.main_thread(threads[::-1])
    assert decoy is not None and decoy.frames[-1].file == "/job/fake.py", threads
    assert hang.main_thread(threads[::-1], main) is hang.main_thread(threads, main) is threads[-1]
    pos = hang.position(threads, (), taken.mains[3])
    assert pos is not None and (pos.file, pos.line, pos.func) == (str(tmp_path / "train.py"), LINE, "blocked")
    # another thread's line (a C++ library's warning) breaks the main thread's header: its frames, read as a
    # thread without a header, are still the main thread's (their outermost frame is the bootstrap's)
    lines = (tmp_path / "stderr.log").read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if f"{main:#018x} (most recent call first)" in line)
    lines[head:head + 1] = [lines[head][:10] + "[W gloo] a warning", lines[head][10:]]
    broken = hang.parse_dumps(lines, 3)[3]
    assert len(broken) == 5 and all(hang.thread_id(t.ident) != main for t in broken), broken
    assert hang.position(broken, (), main) == pos


def test_a_dump_without_the_main_thread_gives_no_position_and_says_why(tmp_path: Any) -> None:
    taken, main, _ = take_one(tmp_path, 110)  # faulthandler prints 100 threads, newest first: not the main one
    threads = taken.dumps[3]
    assert len(threads) == 100 and all(hang.thread_id(t.ident) != main for t in threads)
    assert hang.main_thread(threads, main) is None and hang.position(threads, (), main) is None
    assert taken.why == {3: stacks.NO_MAIN}
    assert "no stack from rank 3 (its main thread is not in its dump)" in hang.culprit_sentence(
        {}, {}, 300, [3], taken.why)


def test_a_progress_bar_written_into_the_dump_never_stands_another_threads_frame_in(tmp_path: Any) -> None:
    for round_ in range(5):  # wherever the bar's writes land in faulthandler's (a line's words, a header)
        taken, main, _ = take_one(tmp_path / str(round_), 2, "chatty")
        pos = hang.position(taken.dumps.get(3, []), (), main)
        text = (tmp_path / str(round_) / "stderr.log").read_text()
        script = str(tmp_path / str(round_) / "train.py")
        if pos is None:  # the main thread's header and outermost frame both lost to the bar: said as such
            assert taken.why[3] in (stacks.NO_MAIN, "ended without a dump"), text[-3000:]
        else:  # one of its own frames (a line the bar broke is lost: then an outer one), never a helper's or bar's
            assert (pos.file, pos.func) in {(script, "blocked"), (script, "<module>"), (BOOTSTRAP, "run"),
                                             (BOOTSTRAP, "<module>")}, (pos, text[-3000:])


def test_the_sampler_holds_still_before_the_stacks_are_taken(tmp_path: Any) -> None:
    # The bootstrap's sampler looks at the main thread ten times a second. faulthandler reads every thread's frames
    # without the GIL: a dump taken while the sampler looked once printed "sys", line 4 in ??? for it and crashed
    # (SIGSEGV) before it reached the main thread, printed last. Asked first, the sampler says it holds still and
    # waits in C: in the dump its thread is in _park (in _hold_the_gil), and the main thread is there, at the
    # script's line.
    beats = str(tmp_path / "beats.sock")  # nobody listens: the sampler's beats are lost, as it allows
    proc = start_worker(tmp_path / "sampled", 0, DDP_LAUNCHER_PROGRESS=beats)
    exits = tmp_path / "sampled" / "exits"

    def parked() -> None:
        assert not (exits / f"{proc.pid}.parked").exists()
        assert stacks.park_samplers([proc.pid], BOUND) == []
        assert (exits / stacks.PARK_NAME).exists() and (exits / f"{proc.pid}.parked").exists()

    taken = freeze_and_take(proc, parked)
    threads = taken.dumps[3]
    parked = [t for t in threads if any(f.func == "_park" and f.file.endswith("bootstrap.py") for f in t.frames)]
    assert len(parked) == 1 and parked[0].frames[-1].func == "_bootstrap", threads
    pos = hang.position(threads, (), taken.mains[3])
    assert pos is not None and (pos.func, pos.line) == ("blocked", LINE), threads
    # a worker whose sampler is off is not asked (nothing would answer): no request in its exit directory
    quiet = start_worker(tmp_path / "off", 0, DDP_LAUNCHER_PROGRESS=beats, DDP_LAUNCHER_SAMPLE="0")
    try:
        assert stacks.park_samplers([quiet.pid], BOUND) == []
        assert not (tmp_path / "off" / "exits" / stacks.PARK_NAME).exists()
    finally:
        quiet.kill()
        quiet.wait()
        assert_gone([quiet.pid])


def take_parked(where: Any, beats: str) -> tuple[stacks.Taken, stacks.Worker, subprocess.Popen]:
    """Start a chatty worker with its sampler, park the sampler, freeze the worker, take its stacks; the worker
    as described once parked."""
    proc = start_worker(where, 2, "chatty", DDP_LAUNCHER_PROGRESS=beats)
    seen: list[stacks.Worker] = []

    def parked() -> None:
        assert stacks.park_samplers([proc.pid], BOUND) == []
        seen.append(stacks.describe(proc.pid))

    return freeze_and_take(proc, parked), seen[0], proc


def test_a_parked_worker_dumps_into_its_own_file_whole_though_a_thread_writes_to_stderr_meanwhile(
        tmp_path: Any) -> None:
    # In stderr a logger's line joined a frame's line of the dump ("in all_reduceINFO:chatty:chat 122") and the
    # rank's collective was misread. With its sampler parked, the worker dumps into <pid>.stacks, which no thread
    # of the script writes: every round reads the main thread whole, at the script's line, and the dump is then
    # appended to the worker's log (the host's log has it in full), while the bar's text stays in stderr only.
    beats = str(tmp_path / "beats.sock")
    for round_ in range(3):
        where = tmp_path / str(round_)
        taken, worker, proc = take_parked(where, beats)
        own = where / "exits" / f"{proc.pid}.stacks"
        assert worker.own == str(own) and worker.dump_file() == (str(own), 0), worker
        assert proc.returncode == -signal.SIGABRT and taken.why == {}, taken
        dump = own.read_text()
        # six threads: the main one, the fake main, two helpers, the bar and the sampler
        assert "38%" not in dump and dump.count("(most recent call first)") == 6, dump
        pos = hang.position(taken.dumps[3], (), taken.mains[3])
        assert pos is not None and (pos.func, pos.line) == ("blocked", LINE), dump
        log = (where / "stderr.log").read_text()
        assert "38%" in log and log.endswith(dump) and "most recent call first" not in log[:worker.offset]
    # a worker whose user turned faulthandler off gives no own file: nothing would be written to it
    proc = start_worker(tmp_path / "off", 0, DDP_LAUNCHER_PROGRESS=beats, PYTHONFAULTHANDLER="")
    try:
        assert stacks.park_samplers([proc.pid], BOUND) == []
        assert stacks.describe(proc.pid).own is None
        assert not (tmp_path / "off" / "exits" / f"{proc.pid}.stacks").exists()
    finally:
        proc.kill()
        proc.wait()
        assert_gone([proc.pid])


def test_a_parked_sampler_keeps_every_thread_of_the_script_out_of_python_until_the_dump(tmp_path: Any) -> None:
    # faulthandler reads each thread's frames without the GIL. A thread of the script that runs Python meanwhile
    # (a logger's, a progress bar's) changes its frames under it: the dump can show a wrong frame, or crash
    # before the main thread, printed last (CI: a chatty rank's dump had no main thread). Parked, the sampler
    # holds the GIL in C: from <pid>.parked on, the bar, which wrote every half millisecond, writes nothing
    # more (one write under way may end), while the worker still runs; and the dump is whole.
    beats = str(tmp_path / "beats.sock")
    proc = start_worker(tmp_path, 2, "chatty", DDP_LAUNCHER_PROGRESS=beats)
    log = tmp_path / "stderr.log"
    sizes: list[int] = []

    def held() -> None:
        grown = log.stat().st_size
        time.sleep(0.5)
        assert log.stat().st_size > grown  # the bar writes while the sampler looks
        assert stacks.park_samplers([proc.pid], BOUND) == []
        time.sleep(0.2)  # a write under way ends
        for _ in range(5):
            sizes.append(log.stat().st_size)
            time.sleep(0.2)
        # the worker lives on. (Not "every thread asleep" from /proc: a thread waiting for the GIL wakes every
        # switch interval to ask for it, and is seen running for that instant; CI caught one.)
        assert proc.poll() is None

    taken = freeze_and_take(proc, held)
    assert len(set(sizes)) == 1, sizes  # not one more character of the bar's
    assert proc.returncode == -signal.SIGABRT and taken.why == {}, taken
    pos = hang.position(taken.dumps[3], (), taken.mains[3])
    assert pos is not None and (pos.func, pos.line) == ("blocked", LINE), taken.dumps[3]


@given(st.binary(max_size=80))
def test_any_thread_file_reads_as_an_id_or_none(tmp_path_factory: Any, data: bytes) -> None:
    directory = tmp_path_factory.mktemp("exits")
    (directory / "7.thread").write_bytes(data)
    ident = stacks.main_ident(str(directory), 7)
    assert ident is None or (0 < ident < 2 ** 64 and data.strip().decode() == str(ident))
    assert stacks.main_ident(str(directory), 8) is None
