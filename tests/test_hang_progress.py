"""What counts as progress, and which hang timeout is in force (launcher/bootstrap.py's sampler,
launcher/progress.py, launcher/hangtimeout.py): real threads sampled, the timeout rule on any job history.

The sampler is tried on a real thread in each state the hangs page names: blocked on a lock, in a read,
in a sleep, in a poll loop inside the library (not moved), and in loops that call a function again and
again, go round several lines, spin on one line, or sleep the sampler's own period per step (moved).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher import bootstrap, hangtimeout, progress
from launcher.errors import ConfigError

LOOKS = 8  # looks at a thread, PERIOD apart


class Running:
    """``work(stop)`` in a daemon thread until the test ends (it must return when ``stop`` is set, or never
    block for good: a blocked one is released through ``release``)."""

    def __init__(self, work: Callable[[threading.Event], None], release: Callable[[], None] = lambda: None):
        self.stop, self.release = threading.Event(), release
        STOP[0] = False
        self.thread = threading.Thread(target=work, args=(self.stop,), daemon=True)
        self.thread.start()
        time.sleep(0.2)  # it reached its state

    def looks(self, count: int = LOOKS) -> list[bootstrap.Look]:
        sampler = bootstrap.Sampler(self.thread.ident, self.thread.native_id)
        seen = []
        for _ in range(count + 1):
            seen.append(sampler.look())
            time.sleep(bootstrap.PERIOD)
        return seen[1:]  # the first look always moves (nothing seen before)

    def running_looks(self, count: int = LOOKS, ran: float = 0.001) -> list[bootstrap.Look]:
        """``count`` looks, each after the thread ran for at least ``ran`` s of CPU since the look before: a
        loaded machine may not run it between two looks 0.1 s apart, and such a look proves nothing. More
        looks are taken as needed, for at most 120 s."""
        clock = time.pthread_getcpuclockid(self.thread.ident)
        sampler = bootstrap.Sampler(self.thread.ident, self.thread.native_id)
        sampler.look()  # the first look always moves (nothing seen before)
        seen, spent, deadline = [], time.clock_gettime(clock), time.monotonic() + 120
        while len(seen) < count:
            assert time.monotonic() < deadline, f"the thread ran before {len(seen)} looks of {count} in 120 s"
            time.sleep(bootstrap.PERIOD)
            now = time.clock_gettime(clock)
            look = sampler.look()
            if now - spent >= ran:
                seen.append(look)
            spent = now
        return seen

    def end(self) -> None:
        self.stop.set()
        STOP[0] = True
        self.release()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


STOP = [False]  # a one-line loop that calls nothing: no new frame ever


def one_line_loop(stop: threading.Event) -> None:
    while not STOP[0]: pass  # noqa: E701


def square(i: int) -> int:
    return i * i


def calls_a_function(stop: threading.Event) -> None:
    while not stop.is_set(): square(3)  # noqa: E701


def a_loop_of_lines(stop: threading.Event) -> None:
    total = 0
    while not stop.is_set():
        total += square(total % 7)
        total -= square(total % 5)
        total = total % 7


def serves_for_ever(stop: threading.Event) -> None:
    import socketserver

    with socketserver.TCPServer(("127.0.0.1", 0), socketserver.BaseRequestHandler) as server:
        threading.Thread(target=lambda: (stop.wait(), server.shutdown()), daemon=True).start()
        server.serve_forever(poll_interval=0.02)  # a poll loop inside the library, for ever


def sleeps_a_period(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(bootstrap.PERIOD)  # a step that is one C call at the sampler's own period


@pytest.mark.parametrize("state", ["lock", "read", "sleep", "library poll loop"])
def test_a_thread_that_waits_or_polls_inside_the_library_has_not_moved(state: str) -> None:
    read_end, write_end = os.pipe()
    lock = threading.Lock()
    lock.acquire()
    works = {"lock": lambda stop: lock.acquire(), "read": lambda stop: os.read(read_end, 1),
             "sleep": lambda stop: stop.wait(60), "library poll loop": serves_for_ever}
    releases = {"lock": lock.release, "read": lambda: os.write(write_end, b"x")}
    running = Running(works[state], release=releases.get(state, lambda: None))
    try:
        seen = running.looks()
    finally:
        running.end()
        os.close(read_end)
        os.close(write_end)
    assert [(look.moved, look.stepped, look.waiting) for look in seen] == [(False, False, False)] * LOOKS
    if state == "library poll loop":
        assert any(look.busy for look in seen), seen  # its inner frames move: that is only busy
    else:
        assert not any(look.busy for look in seen), seen


@pytest.mark.parametrize("work", [calls_a_function, a_loop_of_lines, one_line_loop])
def test_a_thread_that_runs_its_own_code_moves_at_every_look(work: Callable) -> None:
    # Each look finds a new frame, another line or a new callee, or the thread in its own line with its CPU
    # clock moved: wherever the look lands. A one-line loop moves too (it cannot be told from a loop whose
    # step is one C call); it does not come round (the livelock rule of docs/hangs.md finds it).
    running = Running(work)
    try:
        seen = running.running_looks(3 * LOOKS)
    finally:
        running.end()
    assert all(look.moved for look in seen), seen
    assert any(look.stepped for look in seen) == (work is not one_line_loop), seen


def test_a_long_library_call_that_keeps_reading_and_writing_moves(tmp_path: Path) -> None:
    # One call of the library for ever (the script's frame, line and callee never change): a checkpoint
    # written or read in one call. The main thread's I/O counters grow: that is progress.
    import shutil

    source = tmp_path / "sparse"
    with open(source, "wb") as fh:
        fh.truncate(1 << 40)  # a terabyte of holes: read for far longer than the test looks
    with open(source, "rb") as src, open(os.devnull, "wb") as dst:

        def copies(stop: threading.Event) -> None:
            with contextlib.suppress(ValueError, OSError):  # the files closed under it: the end
                shutil.copyfileobj(src, dst)

        running = Running(copies, release=lambda: (src.close(), dst.close()))
        try:
            seen = running.running_looks()
        finally:
            running.end()
    # moved: the I/O counters (the frames never change, and the innermost is the library's); never a step
    assert all(look.moved for look in seen) and not any(look.stepped for look in seen), seen


def test_a_loop_whose_step_is_one_c_call_at_the_samplers_period_moves() -> None:
    running = Running(sleeps_a_period)
    try:
        seen = running.looks(3 * LOOKS)
    finally:
        running.end()
    assert any(look.moved for look in seen) and not any(look.waiting for look in seen), seen


def test_the_sampler_beats_the_launchers_socket_and_lines_stop_counting(tmp_path: object) -> None:
    prog = progress.Progress()
    prog.feed(b"[rank0]:starting\n[rank1]:starting\n")
    assert prog.last_step() is not None and set(prog.last()) == {0, 1}
    beats, stop = progress.BeatSocket(str(tmp_path)), threading.Event()
    thread = None
    try:
        thread = bootstrap.start_sampler({bootstrap.BEAT_VARIABLE: beats.path, "RANK": "0"}, stop)
        assert thread is not None and thread.daemon
        deadline = time.monotonic() + 30
        while 0 not in prog.beating and time.monotonic() < deadline:
            time.sleep(0.05)
            beats.drain(prog)
        assert 0 in prog.beating and prog.beats == 0  # sampled: no explicit beat
    finally:
        stop.set()
        beats.close()
        if thread is not None:
            thread.join(timeout=10)
            assert not thread.is_alive()
    heard, stepped = prog.last(), dict(prog.stepped)
    prog.feed(b"[rank0]:a status thread's line\n[rank1]:a line\n")
    assert prog.last()[0] == heard[0] and prog.stepped[0] == stepped[0]  # rank 0 is sampled: its lines prove nothing
    assert prog.last()[1] > heard[1] and prog.stepped[1] > stepped[1]  # rank 1 has only its lines
    line_step = prog.stepped[1]
    prog.beat(1, b"~moved")  # moving is no step; an explicit beat is
    assert prog.stepped[1] == line_step and prog.last()[1] > line_step and prog.beats == 0
    prog.beat(1, b"eval")
    assert prog.stepped[1] > line_step and prog.beats == 1
    heard = prog.last()[1]
    prog.beat(1, b"~busy")  # the library's frames moved: after a step, that is no progress
    prog.beat(1, b"~wait")  # waiting in a collective: no progress, noted
    assert prog.last()[1] == heard and set(prog.waiting()) == {1}
    prog.beat(1, b"~moved")
    assert prog.last()[1] > heard and prog.waiting() == {}
    prog.beat(2, b"~busy")  # before its first step, a rank's busy library (an import, a load) counts
    assert 2 in prog.last()
    prog.beat(3, b"~end")  # its script ended: heard through the teardown (nothing samples it), for a while
    first = prog.last()[3]
    time.sleep(0.05)
    assert prog.last()[3] > first >= prog.ended[3]
    assert bootstrap.start_sampler({"RANK": "0"}) is None
    assert bootstrap.start_sampler({bootstrap.BEAT_VARIABLE: "/x", "RANK": "0", "DDP_LAUNCHER_SAMPLE": "0"}) is None


gaps = st.lists(st.floats(min_value=0.01, max_value=5000), min_size=0, max_size=60)


@settings(max_examples=150, deadline=None)
@given(gaps, st.sampled_from([0, 1]), st.floats(min_value=1, max_value=3000))
def test_the_learned_timeout_is_the_start_bound_then_bounded_and_never_shrinks(steps: list[float], gpus: int,
                                                                               start: float) -> None:
    rule = hangtimeout.policy(None, start, gpus, {})
    clock = hangtimeout.Clock(rule)
    assert clock.timeout()[0] == rule.start
    now, before = 10.0, 0.0
    for i, gap in enumerate(steps):
        now += gap
        clock.observe(now)
        value, why = clock.timeout()
        if i < hangtimeout.WARMUP:  # the first event ends no gap: i gaps so far
            assert value == rule.start and "start" in why
        else:
            assert rule.floor <= value <= rule.ceiling and "learned" in why
            assert value >= before
            learned = steps[1:i + 1][hangtimeout.SKIP:]
            assert value == pytest.approx(min(rule.ceiling, max(rule.floor, hangtimeout.MULTIPLE * max(learned))))
            before = value
    clock.observe(now)  # no new step: a silence that has not ended teaches nothing
    assert clock.timeout()[0] == (before or rule.start)
    assert rule.ceiling == (hangtimeout.CEILING_GPU if gpus else hangtimeout.CEILING_CPU)


@settings(max_examples=100, deadline=None)
@given(gaps, st.floats(min_value=0.5, max_value=3000))
def test_a_fixed_timeout_holds_after_the_start_whatever_the_steps(steps: list[float], fixed: float) -> None:
    clock = hangtimeout.Clock(hangtimeout.policy(fixed, 540, 0, {}))
    assert clock.timeout()[0] == max(fixed, 540)
    clock.observe(None, running=fixed * 0.99)
    assert clock.timeout()[0] == max(fixed, 540)
    now = fixed * 0.99
    for gap in steps:
        now += gap
        clock.observe(now)
        assert clock.timeout() == (fixed, f"{fixed:g} s (--hang-timeout)")
    clock.restart()  # the workers ended: a new start
    assert clock.timeout()[0] == max(fixed, 540)


def test_without_a_step_a_fixed_timeout_applies_once_the_start_bound_has_passed() -> None:
    clock = hangtimeout.Clock(hangtimeout.policy(20, 60, 0, {}))
    clock.observe(None, running=59)
    assert clock.timeout()[0] == 60
    clock.observe(None, running=60)
    assert clock.timeout()[0] == 20


@settings(max_examples=50, deadline=None)
@given(st.floats(min_value=0.5, max_value=3000), st.floats(min_value=0, max_value=1))
def test_a_fixed_timeout_without_a_start_bound_ends_the_start_once_the_workers_ran_that_long(
        fixed: float, part: float) -> None:
    # Whether the sampler ever sees a step (where its looks land) does not decide how long an early hang takes.
    clock = hangtimeout.Clock(hangtimeout.policy(fixed, hangtimeout.START, 0, {}))
    clock.observe(None, running=fixed * part * 0.999)
    assert clock.timeout()[0] == max(fixed, hangtimeout.START)
    clock.observe(None, running=fixed)
    assert clock.timeout()[0] == fixed


def test_a_restarted_generation_keeps_what_was_learned_and_starts_under_the_start_bound(tmp_path: object) -> None:
    """A job-wide restart builds the next generation's hang watch from the last one's: the learned gaps stay
    (not 16 more steps of warm-up under the start's bound), and the new generation's start has its bound."""
    from conftest import resolve_cluster

    from launcher import hangwatch

    cluster = resolve_cluster({"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1", "SM_NUM_CPUS": "2",
                               "SM_NUM_GPUS": "0", "SM_MODULE_NAME": "x"})
    rule = hangtimeout.policy(None, 540, 0, {"DDP_LAUNCHER_TEST_HANG_FLOOR": "4"})
    first = hangwatch.for_cluster(cluster, rule, str(tmp_path), lambda _line: None)
    for step in range(hangtimeout.WARMUP + 2):
        first.clock.observe(float(step) * 2.0)
    learned = first.clock.timeout()[0]
    assert learned == hangtimeout.MULTIPLE * 2.0
    first.close()
    second = hangwatch.for_cluster(cluster, rule, str(tmp_path), lambda _line: None, previous=first)
    assert second.clock.timeout()[0] == 540  # the new generation's start
    second.clock.observe(100.0)  # its first step: the start is over, what was learned is in force at once
    assert second.clock.timeout()[0] == learned
    second.close()


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0/"), min_size=1, max_size=40),
       st.integers(min_value=0, max_value=200))
def test_the_beat_address_fits_a_unix_socket_whatever_the_tmpdir(name: str, depth: int) -> None:
    run_dir = os.path.join("/" + "/".join([name] * (depth // 10 + 1))[:depth + 1], "ddp-launcher-123-" + "a" * 16)
    address = progress.beat_address(run_dir)
    path = os.path.join(run_dir, progress.BEAT_SOCKET)
    if len(os.fsencode(path)) <= progress.MAX_SOCKET_PATH:
        assert address == path
    else:  # Linux's abstract namespace: the run directory's name, unique to this launcher
        assert address == "@ddp-launcher-123-aaaaaaaaaaaaaaaa/progress.sock"
        assert progress.socket_address(address) == "\0" + address[1:]
    assert len(os.fsencode(progress.socket_address(address))) <= progress.MAX_SOCKET_PATH


def test_a_run_directory_too_deep_for_a_socket_path_gets_an_abstract_socket(tmp_path: Path) -> None:
    """A TMPDIR of more than about 55 characters: the socket cannot have its path, so it gets a name in the
    abstract namespace; the sampler and ddp_utils' beats reach it, and nothing of it is in the run directory."""
    import sys

    # a name as the launcher makes it (pid + random hex): the abstract namespace is the whole machine's, and
    # a fixed name collided with the same test of another suite running beside this one (EADDRINUSE)
    name = f"ddp-launcher-{os.getpid()}-{os.urandom(8).hex()}"
    run_dir = tmp_path / ("x" * 60) / name
    run_dir.mkdir(parents=True)
    prog, stop, thread = progress.Progress(), threading.Event(), None
    beats = progress.BeatSocket(str(run_dir))
    try:
        assert beats.path == f"@{name}/progress.sock"
        assert os.listdir(run_dir) == [] and beats.rebind_if_gone(prog) is None
        thread = bootstrap.start_sampler({bootstrap.BEAT_VARIABLE: beats.path, "RANK": "3"}, stop)
        assert select.select([beats], [], [], 30)[0]
        beats.drain(prog)
        assert 3 in prog.beating
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_scripts"))
        try:
            import ddp_utils
        finally:
            sys.path.pop(0)
        environ = {progress.BEAT_ENV: beats.path, "RANK": "5"}
        with pytest.MonkeyPatch.context() as patch:
            for key, value in environ.items():
                patch.setenv(key, value)
            ddp_utils.beat("eval", force=True)
        deadline = time.monotonic() + 30  # the sampler of rank 3 beats meanwhile
        while 5 not in prog.beating and time.monotonic() < deadline:
            select.select([beats], [], [], 1)
            beats.drain(prog)
        assert 5 in prog.beating and prog.beats == 1  # an explicit beat
    finally:
        stop.set()
        beats.close()
        if thread is not None:
            thread.join(timeout=10)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender, pytest.raises(OSError):
        sender.sendto(b"1", progress.socket_address(beats.path))  # closed: nobody listens on the name any more


def beat_arrives(beats: progress.BeatSocket, prog: progress.Progress, sender: socket.socket, rank: int) -> bool:
    """Send ``rank``'s beat to the socket's path; whether it arrives (False: nobody is bound there)."""
    try:
        sender.sendto(str(rank).encode(), beats.path)
    except OSError:
        return False
    assert select.select([beats], [], [], 30)[0]
    beats.drain(prog)
    return rank in prog.beating


@pytest.mark.parametrize("removed", ["the socket", "the run directory", "replaced by a file"])
def test_a_beat_socket_whose_file_is_removed_is_bound_again(tmp_path: Path, removed: str) -> None:
    """The workers send beats to the socket's path: with its file gone (a /tmp cleaner that ignores the run
    directory's lock) no beat arrives and a healthy job would look hung, so the hang watch binds it again."""
    run_dir, prog = tmp_path / "run", progress.Progress()
    exits = run_dir / "exits"
    run_dir.mkdir(0o700)  # as launcher.cli.make_run_dir makes them
    exits.mkdir(0o700)
    beats = progress.BeatSocket(str(run_dir), remake=[str(exits)])
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        assert beats.rebind_if_gone(prog) is None and beat_arrives(beats, prog, sender, 0)
        sender.sendto(b"1", beats.path)  # waiting on the old socket when its file goes: read, not lost
        if removed == "the socket":
            os.unlink(beats.path)
        elif removed == "the run directory":
            shutil.rmtree(run_dir)
        else:
            os.unlink(beats.path)
            (run_dir / progress.BEAT_SOCKET).write_text("not a socket")
        assert not beat_arrives(beats, prog, sender, 2)
        assert beats.rebind_if_gone(prog) == f"progress beats: {beats.path} was removed (a /tmp cleaner?): bound again"
        assert 1 in prog.beating
        assert beat_arrives(beats, prog, sender, 2)
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700 and stat.S_IMODE(exits.stat().st_mode) == 0o700
        assert beats.rebind_if_gone(prog) is None
    finally:
        sender.close()
        beats.close()
    assert not os.path.exists(beats.path)


def test_a_hang_watch_binds_its_beat_socket_again_and_says_so_once(tmp_path: Path) -> None:
    from conftest import resolve_cluster

    from launcher import hangwatch

    cluster = resolve_cluster({"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1", "SM_NUM_CPUS": "2",
                               "SM_NUM_GPUS": "0", "SM_MODULE_NAME": "x"})
    run_dir, lines = tmp_path / "run", []
    run_dir.mkdir()
    watch = hangwatch.for_cluster(cluster, hangtimeout.policy(None, 540, 0, {}), str(run_dir), lines.append,
                                  remake=[str(run_dir / "exits")])
    try:
        shutil.rmtree(run_dir)
        run_dir.write_text("a file where the run directory was")  # it cannot be made again, for now
        for _ in range(3):
            watch._keep_beats()  # the hang watch's thread does this once a second
        assert len(lines) == 1 and lines[0].startswith(f"progress beats: {run_dir}/progress.sock is gone and cannot "
                                                       "be bound again: [Errno 17] File exists"), lines
        run_dir.unlink()
        for _ in range(3):
            watch._keep_beats()
        assert lines[1:] == [f"progress beats: {run_dir}/progress.sock was removed (a /tmp cleaner?): bound again"]
        assert (run_dir / "exits").is_dir()
    finally:
        watch.close()


def test_the_floor_is_lowered_only_by_a_valid_test_variable() -> None:
    assert hangtimeout.policy(None, 540, 0, {hangtimeout.FLOOR_ENV: "3"}).floor == 3
    assert "tests only" in hangtimeout.policy(None, 540, 0, {hangtimeout.FLOOR_ENV: "3"}).describe()
    for bad in ("0", "-1", "nan", "inf", "301", "x", ""):
        with pytest.raises(ConfigError, match=hangtimeout.FLOOR_ENV):
            hangtimeout.policy(None, 540, 0, {hangtimeout.FLOOR_ENV: bad})


@pytest.mark.parametrize("options, environ, says", [
    ([], {}, "hangs:     learned: 5 x the longest gap between steps, after 16 gaps (the first 2 not counted), "
             "at least 300 s, at most 1800 s; until the first step 540 s (--hang-start-timeout)"),
    (["--hang-timeout", "30", "--hang-start-timeout", "20"], {},
     "hangs:     30 s between progress events (--hang-timeout); until the first step 30 s"),
    ([], {hangtimeout.FLOOR_ENV: "2"}, "at least 2 s (lowered by DDP_LAUNCHER_TEST_HANG_FLOOR: tests only)"),
    (["--hang-timeout", "0"], {}, "hangs:     off (--hang-timeout 0)"),
])
def test_the_dry_run_says_which_timeout_is_in_force(options: list[str], environ: dict[str, str], says: str) -> None:
    from conftest import REPO

    from launcher import cli

    script = os.path.join(REPO, "tests", "scripts", "hang_worker.py")
    plan = cli.plan(["--platform", "local", "--dry-run", *options, script], {"PATH": "/usr/bin", **environ})
    assert says in cli.describe(plan, False)
    assert (plan.hang is None) == (options[-1:] == ["0"])


def test_a_finished_script_leaves_no_frame_held_by_the_sampler() -> None:
    # A frame held past its function's return keeps its locals alive (a process group being destroyed):
    # once the script has ended, the sampler lets go before the interpreter finalizes.
    import weakref

    class Resource:
        pass

    held, entered, leave = [], threading.Event(), threading.Event()

    def work() -> None:
        resource = Resource()
        held.append(weakref.ref(resource))
        entered.set()
        leave.wait(10)  # the innermost Python frame is this one: the sampler holds it

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    assert entered.wait(10)
    sampler = bootstrap.Sampler(thread.ident)
    sampler.look()
    assert sampler.frame is not None
    leave.set()
    thread.join(timeout=10)
    assert held[0]() is not None  # the returned frame, held by the sampler, keeps its local alive
    sampler.finish(timeout=0)
    assert held[0]() is None and sampler.frame is None
    assert sampler.look() == (True, True, False, False) and sampler.frame is None  # finishing counts as moving
    assert sampler.user is None and sampler.callee is None
