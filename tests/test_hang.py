"""Reading a hung job's stacks (launcher/hang.py) and its progress (launcher/progress.py): pure parts.

The parser reads what workers print, so it is tested on any text (hypothesis), on dumps rendered in
faulthandler's format with and without torchrun's ``[rankN]:`` prefix and interleaved across ranks
(round trip), and on dumps real Python processes print (signal and fatal-error forms). The distributed
waits it knows are checked against the installed torch's source; the verdict's rules (the odd one out, the
rank that gave no stack while every other rank waits) are checked over any set of positions (hypothesis).
Another thread's output written into a dump as faulthandler writes it (a piece at a time) never makes another
thread's frame the rank's position (hypothesis).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

from conftest import PYTHON
from hypothesis import example, given, settings
from hypothesis import strategies as st

from launcher import hang, hangtimeout, progress
from launcher.hang import Frame, Position, Thread

SITE = "/usr/lib/python3.11/site-packages"
C10D = f"{SITE}/torch/distributed/distributed_c10d.py"


def render(ident: str, current: bool, frames: list[Frame]) -> list[str]:
    """One thread as faulthandler prints it."""
    head = f"{'Current thread' if current else 'Thread'} {ident} (most recent call first):"
    return [head, *(f'  File "{f.file}", line {f.line} in {f.func}' for f in frames), ""]


paths = st.sampled_from(["/job/train.py", "/job/data.py", f"{SITE}/torch/nn/module.py", C10D,
                         "/usr/lib/python3.11/threading.py", "<frozen runpy>", "/job/my lib/x.py"])
funcs = st.from_regex(r"[A-Za-z_<>][A-Za-z0-9_<>]{0,20}", fullmatch=True)
frames_st = st.lists(st.builds(Frame, paths, st.integers(1, 10**6), funcs), min_size=1, max_size=8)
threads_st = st.lists(frames_st, min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=300), max_size=60), st.one_of(st.none(), st.integers(0, 9)))
def test_any_text_parses_without_error_and_bounded(lines: list[str], default: object) -> None:
    dumps = hang.parse_dumps(lines, default)  # type: ignore[arg-type]
    for threads in dumps.values():
        assert 0 < len(threads) <= hang.MAX_THREADS
        assert all(len(t.frames) <= hang.MAX_FRAMES for t in threads)
        hang.position(threads)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000))
def test_any_bytes_parse_as_worker_output(data: bytes) -> None:
    hang.parse_dumps(data.decode("utf-8", "replace").splitlines())
    prog = progress.Progress()
    prog.feed(data, stderr=True)
    beat = progress.parse_beat(data)
    assert beat is None or (beat[0] >= 0 and len(beat[1]) < progress.MAX_BEAT)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 63), threads_st, min_size=1, max_size=5), st.randoms(), st.booleans())
def test_round_trip_interleaved_prefixed_dumps(stacks: dict[int, list[list[Frame]]], rnd: object,
                                               prefixed: bool) -> None:
    # Each rank's lines keep their order; ranks interleave at random, as torchrun's tee threads write them.
    queues = {rank: [f"[rank{rank}]:{line}" for i, frames in enumerate(threads)
                     for line in render(f"0x{i + 1:016x}", i == len(threads) - 1, frames)]
              for rank, threads in stacks.items()}
    if not prefixed:
        queues = {min(stacks): [line.split(":", 1)[1] for line in queues[min(stacks)]]}
    merged = []
    while any(queues.values()):
        rank = rnd.choice([r for r, q in queues.items() if q])  # type: ignore[attr-defined]
        merged.append(queues[rank].pop(0))
    dumps = hang.parse_dumps(merged, default=None if prefixed else 99)
    expected = stacks if prefixed else {99: stacks[min(stacks)]}
    assert {r: [list(t.frames) for t in threads] for r, threads in dumps.items()} == expected


def test_a_second_dump_replaces_the_first() -> None:
    first = render("0x1", True, [Frame("/job/a.py", 1, "old")])
    second = render("0x1", True, [Frame("/job/a.py", 2, "new")])
    dumps = hang.parse_dumps([f"[rank0]:{line}" for line in first + ["noise"] + second])
    assert [t.frames for t in dumps[0]] == [(Frame("/job/a.py", 2, "new"),)]


def real_dump(code: str, fatal: bool) -> list[str]:
    """What a real Python process prints: faulthandler on a registered signal, or on SIGABRT."""
    script = textwrap.dedent(code)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([PYTHON, "-c", script, "fatal" if fatal else "register"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode == -signal.SIGABRT) == fatal, proc.stderr
    return proc.stderr.splitlines()


REAL = """
import faulthandler, os, signal, sys, threading, time
def helper():
    time.sleep(30)
def load_batch():
    if sys.argv[1] == "register":
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        os.kill(os.getpid(), signal.SIGUSR2)
    else:
        os.abort()
threading.Thread(target=helper, daemon=True).start()
time.sleep(0.1)
load_batch()
"""


def test_real_dumps_signal_and_fatal_name_the_main_threads_user_frame() -> None:
    for fatal in (False, True):
        lines = real_dump(REAL, fatal)
        dumps = hang.parse_dumps([f"[rank5]:{line}" for line in lines])
        threads = dumps[5]
        assert len(threads) == 2, lines
        pos = hang.position(threads)
        assert pos is not None and (pos.func, pos.line, pos.comm) == ("load_batch", 8 if fatal is False else 10,
                                                                      False), (pos, lines)


def test_user_code_is_not_stdlib_packages_torch_or_the_launcher() -> None:
    assert hang.is_user_code("/job/train.py") and hang.is_user_code("<string>")
    assert hang.is_user_code("/home/me/lib/python/project/train.py")
    for path in ("/usr/lib/python3.11/threading.py", "/root/.pyenv/versions/3.11.7/lib/python3.11/queue.py",
                 f"{SITE}/numpy/core.py", "/usr/lib/python3/dist-packages/x.py", "/src/pytorch/torch/nn/f.py",
                 "<frozen runpy>", "/opt/venv/lib64/python3.13t/selectors.py"):
        assert not hang.is_user_code(path), path
    assert not hang.is_user_code("/opt/launcher/launcher/boot.py", ("/opt/launcher/launcher/",))


def test_position_is_the_innermost_user_frame_with_the_call_it_is_in() -> None:
    frames = (Frame(C10D, 3913, "all_reduce"), Frame(f"{SITE}/torch/distributed/c10d_logger.py", 83, "wrapper"),
              Frame("/job/train.py", 88, "step"), Frame("/job/train.py", 99, "<module>"))
    helper = (Frame("/job/train.py", 5, "prefetch"), Frame("/usr/lib/python3.11/threading.py", 1002, "_bootstrap"))
    pos = hang.position([hang.Thread("0x2", True, helper), hang.Thread("0x1", False, frames)])
    assert pos == Position("/job/train.py", 88, "step", "all_reduce", True)
    assert pos.where() == "train.py:88 in step"
    only_library = (Frame(C10D, 1, "barrier"),)  # no user frame: the innermost stands for it, and it waits
    assert hang.position([hang.Thread("0x1", True, only_library)]) == Position(C10D, 1, "barrier", "barrier", True)
    only_stdlib = (Frame("/usr/lib/python3.11/selectors.py", 415, "select"),)
    assert hang.position([hang.Thread("0x1", True, only_stdlib)]) == Position(only_stdlib[0].file, 415, "select", "",
                                                                              False)


def pos(line: int, func: str, call: str = "", comm: bool = False) -> Position:
    return Position("/job/train.py", line, func, call, comm)


HOSTS = {r: f"algo-{r // 2 + 1}" for r in range(8)}
REDUCE = pos(88, "main", "all_reduce", True)


def test_the_rank_outside_the_collective_is_the_culprit() -> None:
    positions = {r: REDUCE for r in range(8)}
    positions[3] = pos(57, "load_batch")
    assert hang.culprit_sentence(positions, HOSTS, 300, range(8)) == (
        "hang: no progress for 300 s; rank 3 (algo-2) at train.py:57 in load_batch; "
        "ranks 0-2, 4-7 in all_reduce (train.py:88)")


def test_even_two_ranks_one_outside_the_collective() -> None:
    positions = {0: REDUCE, 1: pos(12, "read_input", "read")}
    assert hang.culprit_sentence(positions, HOSTS, 20, range(2)) == (
        "hang: no progress for 20 s; rank 1 (algo-1) at train.py:12 in read_input (in read); "
        "rank 0 in all_reduce (train.py:88)")


def test_a_minority_group_stands_out_when_all_wait_in_collectives() -> None:
    positions = {r: REDUCE for r in range(4)}
    positions[2] = pos(70, "main", "broadcast", True)
    sentence = hang.culprit_sentence(positions, HOSTS, 60, range(4))
    assert sentence.startswith("hang: no progress for 60 s; rank 2 (algo-2) at train.py:70 in main (in broadcast)")


def test_no_rank_stands_out_names_the_shared_place() -> None:
    positions = {r: pos(30, "main") for r in range(4)}
    assert hang.culprit_sentence(positions, HOSTS, 15, range(4)) == (
        "hang: no progress for 15 s; no rank stands out: every rank at train.py:30 in main")
    tie = {0: pos(30, "main"), 1: pos(31, "main")}
    assert "no rank stands out: " in hang.culprit_sentence(tie, HOSTS, 15, range(2))


def test_ranks_without_a_stack_are_named() -> None:
    positions = {r: pos(30, "main") for r in (0, 1, 2)}  # not waiting for the others: the missing are only listed
    sentence = hang.culprit_sentence(positions, HOSTS, 15, range(6))
    assert sentence.endswith("; no stack from ranks 3-5 (algo-2, algo-3)"), sentence


@given(st.sets(st.integers(0, 200)))
def test_ranges_name_every_rank_once(ranks: set[int]) -> None:
    text = hang.ranges(ranks)
    back = set()
    for part in filter(None, text.split(", ")):
        low, _, high = part.partition("-")
        back |= set(range(int(low), int(high or low) + 1))
    assert back == ranks


def test_progress_lines_and_beats_mark_their_rank(tmp_path: object) -> None:
    prog = progress.Progress()
    prog.feed(b"[rank3]:step 1\n[rank10]:loss 2\nno prefix [rank4]: inside\n")
    assert set(prog.last()) == {3, 10}
    beats = progress.BeatSocket(str(tmp_path))
    try:
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for payload in (b"5", b"6 eval", b"junk", b"-1", b"9" * 100):
            sender.sendto(payload, beats.path)
        beats.drain(prog)
        assert set(prog.last()) == {3, 10, 5, 6} and prog.beats == 2
    finally:
        beats.close()
    assert not os.path.exists(beats.path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as nobody:  # nobody listens: fails at once
        nobody.setblocking(False)
        try:
            nobody.sendto(b"1", beats.path)
            raise AssertionError("a beat to nobody was accepted")
        except (FileNotFoundError, ConnectionRefusedError):
            pass


def test_capture_keeps_stderr_after_the_hang_only() -> None:
    prog = progress.Progress()
    prog.feed(b"[rank0]:before\n", stderr=True)
    prog.capture()
    prog.feed(b"[rank0]:on stdout\n")
    prog.feed(b"[rank0]:Thread 0x1 (most recent call first):\n[rank0]:  File \"/j/t.py\", line 3 in f\n", stderr=True)
    assert prog.captured_lines() == ["[rank0]:Thread 0x1 (most recent call first):",
                                     '[rank0]:  File "/j/t.py", line 3 in f']
    assert sys.getsizeof(prog.captured) < progress.CAPTURE_LIMIT + 1024


def test_worker_env_sets_faulthandler_beats_and_nccl_on_gpus_only_unless_the_user_did() -> None:

    plain, notes = hangtimeout.worker_env({}, "/run/x")
    assert plain == {progress.BEAT_ENV: "/run/x/progress.sock", "PYTHONFAULTHANDLER": "1"} and notes == []
    gpu, _ = hangtimeout.worker_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TMPDIR": "/scratch"}, "/run/x", gpus=8)
    assert gpu["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in gpu
    assert gpu["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/scratch/nccl_trace_rank_"
    assert gpu[hangtimeout.NCCL_PIPE_ENV] == "/run/x/nccl_pipe_rank_"
    off, notes = hangtimeout.worker_env({"PYTHONFAULTHANDLER": ""}, "/run/x")
    assert "PYTHONFAULTHANDLER" not in off and "stacks will be missing" in notes[0]


def test_nccl_pipes_nobody_reads_are_skipped_and_a_reader_gets_its_byte(tmp_path: object) -> None:
    from launcher import hangwatch

    prefix = os.path.join(str(tmp_path), "pipe_rank_")
    os.mkfifo(prefix + "1.pipe")
    reader = os.open(prefix + "1.pipe", os.O_RDONLY | os.O_NONBLOCK)  # rank 1 listens, rank 0 has no pipe
    try:
        assert hangwatch.trigger_nccl_dumps({hangtimeout.NCCL_PIPE_ENV: prefix}, [0, 1]) == 1
        assert os.read(reader, 10) == b"1"
    finally:
        os.close(reader)
    os.mkfifo(prefix + "2.pipe")  # nobody reads: skipped at once, never blocks
    assert hangwatch.trigger_nccl_dumps({hangtimeout.NCCL_PIPE_ENV: prefix}, [2]) == 0


def test_a_point_to_point_wait_is_no_collective_two_ranks_still_have_a_culprit() -> None:
    recv = (Frame(C10D, 2700, "recv"), Frame("/job/train.py", 40, "wait_for_peer"))
    reduce = (Frame(C10D, 3913, "all_reduce"), Frame("/job/train.py", 88, "main"))
    positions = {0: hang.position([hang.Thread("0x1", True, reduce)]),
                 1: hang.position([hang.Thread("0x1", True, recv)])}
    assert positions[1] is not None and not positions[1].comm and positions[0].comm  # type: ignore[union-attr]
    assert hang.culprit_sentence(positions, HOSTS, 10, range(2)).startswith(  # type: ignore[arg-type]
        "hang: no progress for 10 s; rank 1 (algo-1) at train.py:40 in wait_for_peer (in recv); rank 0 in all_reduce")


def torch_distributed_dir() -> str:
    """The installed torch's ``torch/distributed`` (found without importing torch)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations, "torch is not installed"
    return os.path.join(list(spec.submodule_search_locations)[0], "distributed")


def test_every_distributed_wait_is_a_function_of_the_installed_torch() -> None:
    # The names are torch's, not guesses: each is defined (def NAME or def NAME[...]) in torch.distributed.
    import re

    defined: set[str] = set()
    for root, _dirs, files in os.walk(torch_distributed_dir()):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name), encoding="utf-8", errors="replace") as fh:
                    defined.update(re.findall(r"^\s*def (\w+)\s*[\[(]", fh.read(), re.MULTILINE))
    assert sorted(hang.DISTRIBUTED_WAITS - defined) == []


def inside_init(user_line: int) -> tuple[Frame, ...]:
    """A rank inside ``init_process_group`` as torch 2.14 nests it (the frames a real dump showed)."""
    logger = f"{SITE}/torch/distributed/c10d_logger.py"
    return (Frame(C10D, 669, "_create_gloo_process_group"), Frame(C10D, 2874, "_new_process_group_helper"),
            Frame(C10D, 2553, "init_process_group"), Frame(logger, 97, "wrapper"), Frame(logger, 83, "wrapper"),
            Frame("/job/train.py", user_line, "main"), Frame("/job/train.py", 200, "<module>"))


def test_a_wait_inside_init_process_group_is_a_distributed_wait_named_by_its_entry_point() -> None:
    pos = hang.position([hang.Thread("0x1", True, inside_init(126))])
    assert pos == Position("/job/train.py", 126, "main", "init_process_group", True)
    store = (Frame(f"{SITE}/torch/distributed/rendezvous.py", 200, "_create_c10d_store"),
             Frame(f"{SITE}/torch/distributed/rendezvous.py", 280, "_env_rendezvous_handler"),
             Frame(C10D, 2543, "init_process_group"), Frame("/job/train.py", 9, "<module>"))
    assert hang.position([hang.Thread("0x1", True, store)]) == Position("/job/train.py", 9, "<module>",
                                                                        "init_process_group", True)
    barrier = (Frame(C10D, 1610, "_store_based_barrier"), Frame(C10D, 6900, "new_group"),
               Frame("/job/train.py", 12, "<module>"))
    assert hang.position([hang.Thread("0x1", True, barrier)]).call == "new_group"  # type: ignore[union-attr]
    blocked = {0: hang.position([hang.Thread("0x1", True, inside_init(126))]),
               1: hang.position([hang.Thread("0x1", True, (Frame("/job/train.py", 85, "read_input"),))])}
    assert hang.culprit_sentence(blocked, HOSTS, 20, range(2)) == (  # type: ignore[arg-type]
        "hang: no progress for 20 s; rank 1 (algo-1) at train.py:85 in read_input; "
        "rank 0 in init_process_group (train.py:126)")
    assert hang.culprit_rank(blocked) == 1  # type: ignore[arg-type]


def test_the_rank_without_a_stack_while_the_others_wait_is_the_likely_culprit() -> None:
    positions = {r: REDUCE for r in (0, 2, 3)}
    assert hang.culprit_sentence(positions, HOSTS, 15, range(4), {1: "SIGABRT ignored"}) == (
        "hang: no progress for 15 s; rank 1 (algo-1) gave no stack (SIGABRT ignored), likely the culprit: "
        "every other rank waits for the others; ranks 0, 2-3 in all_reduce (train.py:88)")
    assert hang.culprit_rank(positions, range(4)) == 1
    # a whole host without stacks while the others wait: its ranks, together
    assert hang.culprit_sentence({0: REDUCE, 1: REDUCE}, HOSTS, 15, range(4)).startswith(
        "hang: no progress for 15 s; ranks 2-3 (algo-2) gave no stack, the likely culprits: ")
    # a rank that does not wait is named first; the missing one is only listed
    mixed = {0: REDUCE, 1: pos(57, "load_batch")}
    assert hang.culprit_sentence(mixed, HOSTS, 15, range(3), {2: "no dump in 30 s"}) == (
        "hang: no progress for 15 s; rank 1 (algo-1) at train.py:57 in load_batch; rank 0 in all_reduce "
        "(train.py:88); no stack from rank 2 (algo-2) (no dump in 30 s)")
    assert hang.culprit_rank(mixed, range(3)) == 1


positions_st = st.dictionaries(st.integers(0, 15), st.sampled_from(
    [REDUCE, pos(88, "main", "init_process_group", True), pos(57, "load_batch"), pos(85, "read_input", "read")]),
    max_size=16)


@settings(max_examples=300, deadline=None)
@given(positions_st, st.integers(1, 16))
def test_the_verdict_over_any_positions(positions: dict[int, Position], world: int) -> None:
    expected = range(max([world, *[r + 1 for r in positions]]))
    hosts = {r: f"algo-{r // 2 + 1}" for r in expected}
    sentence = hang.culprit_sentence(positions, hosts, 20, expected)
    missing = sorted(set(expected) - set(positions))
    rank = hang.culprit_rank(positions, expected)
    assert sentence.startswith("hang: no progress for 20 s")
    if missing and positions and all(p.comm for p in positions.values()):
        assert hang.silent_culprits(positions, expected) == missing
        assert rank == (missing[0] if len(missing) == 1 else None)
        assert "gave no stack" in sentence and "no stack from" not in sentence
    else:
        assert hang.silent_culprits(positions, expected) == []
        assert ("no stack from " in sentence) == bool(missing)
        waiting = {r for r, p in positions.items() if p.comm}
        idle = set(positions) - waiting
        if waiting and idle:  # the ranks that do not wait stand out
            odd = {r for r, p in hang.same_place(positions).items() if p in hang.odd_ones_out(positions)}
            assert odd == idle and rank == (min(idle) if len(idle) == 1 else None)
    if rank is not None:
        assert f"rank {rank} ({hosts[rank]})" in sentence


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 4095), st.text(max_size=120), max_size=300))
def test_why_ranks_gave_no_stack_travels_bounded(why: dict[int, str]) -> None:
    import json

    from launcher import hangwatch

    written = hangwatch._write_why(why)
    assert len(json.dumps(written)) <= hangwatch.MAX_WHY_BYTES
    back = hangwatch._read_why(json.loads(json.dumps(written)))
    assert all(why[rank][:60] == reason for rank, reason in back.items())
    if len(json.dumps([[r[:60], list(range(len(why)))] for r in set(why.values())])) < hangwatch.MAX_WHY_BYTES // 2:
        assert set(back) == set(why)  # little to say: every rank arrives


def test_the_samplers_collectives_are_the_verdicts() -> None:
    from launcher import bootstrap

    assert bootstrap.WAITS == hang.COLLECTIVES  # bootstrap imports nothing from the launcher: a copy, kept equal


def test_the_culprits_children_end_the_sentence() -> None:
    kid = hang.Position("/job/data.py", 20, "__getitem__", "", False)
    kids = [(0, 11, kid._replace(line=5)), (1, 12, kid), (1, 13, kid)]
    assert hang.children_clause(kids, 1) == ("; rank 1's child pid 12 at data.py:20 in __getitem__"
                                             "; rank 1's child pid 13 at data.py:20 in __getitem__")
    assert hang.children_clause(kids, None).count("; rank ") == 3 and hang.children_clause([], 1) == ""


def test_a_line_another_thread_writes_during_the_dump_is_skipped() -> None:
    lines = ["Thread 0x0000000000000002 (most recent call first):",
             '  File "/usr/lib/python3.11/threading.py", line 320 in wait',
             "INFO:chatty:chat 41",  # a logger's line, written between two of faulthandler's
             '  File "/job/train.py", line 12 in chatter',
             "",
             "Current thread 0x0000000000000001 (most recent call first):",
             "chat 42",
             '  File "/job/train.py", line 30 in read_input',
             '  File "/job/train.py", line 50 in <module>',
             "  Extension modules: numpy (total: 1)"]
    threads = hang.parse_dumps(lines, 3)[3]
    assert [len(t.frames) for t in threads] == [2, 2]
    assert hang.position(threads) == hang.Position("/job/train.py", 30, "read_input", "", False)


def test_the_launchers_sampler_is_never_the_main_thread_even_cut_short() -> None:
    lines = ["Thread 0x0000000000000003 (most recent call first):",
             '  File "/usr/lib/python3.11/threading.py", line 331 in wait',  # the sampler in its wait, cut short
             "",
             "Thread 0x0000000000000002 (most recent call first):",
             '  File "/opt/launcher/bootstrap.py", line 200 in __new__',  # the rest of its dump lost
             "",
             "Current thread 0x0000000000000001 (most recent call first):",
             '  File "/job/train.py", line 30 in read_input']  # cut short too: no <module>
    threads = hang.parse_dumps(lines, 0)[0]
    assert hang.position(threads, ("/opt/launcher/",)) == hang.Position("/job/train.py", 30, "read_input", "", False)


THREADING = "/usr/lib/python3.11/threading.py"
MAIN_FRAMES = [Frame("/job/train.py", 30, "read_input"), Frame("/job/train.py", 50, "main"),
               Frame("/job/train.py", 70, "<module>")]


def started(number: int, inner: list[Frame]) -> list[Frame]:
    """A thread ``threading`` started: its frames, innermost first, down to threading's own."""
    return [*inner, Frame(THREADING, 1000 + number, "run"), Frame(THREADING, 1100 + number, "_bootstrap_inner"),
            Frame(THREADING, 1200 + number, "_bootstrap")]


def faulthandler_pieces(threads: list[tuple[str, list[Frame]]]) -> list[str]:
    """A dump as faulthandler writes it: a header in three writes, a frame's file and function a character
    at a time (CPython's traceback.c), every thread but the first (the newest) before the main thread last."""
    pieces: list[str] = []
    for number, (head, frames) in enumerate(threads):
        pieces += [f"{head} ", f"0x{number + 1:016x}", " (most recent call first):\n"]
        for frame in frames:
            pieces += ["  File ", '"', *frame.file, '"', ", line ", str(frame.line), " in ", *frame.func, "\n"]
        pieces.append("\n")
    return pieces


others_st = st.lists(st.lists(st.builds(Frame, st.sampled_from(["/job/train.py", "/job/data.py", THREADING,
                                                                f"{SITE}/tqdm/_monitor.py"]),
                                        st.integers(100, 999), funcs), max_size=3), max_size=3)
foreign_st = st.sampled_from(["chat 42\n", "INFO:chatty:chat 42\n", "\r 45%|####      | 9/20", "\n", "\r",
                              "\r 38%|###7      | 3/8 [00:05<00:08,  1.63s/it]"])


@settings(max_examples=400, deadline=None)
@given(others_st, st.lists(st.tuples(st.integers(0, 10**6), foreign_st), max_size=3))
@example(others=[[Frame("/job/train.py", 100, "<"), Frame("/job/train.py", 100, "<0"),
                  Frame(f"{SITE}/tqdm/_monitor.py", 100, "<0")]],
         writes=[(204, "chat 42\n"), (1954, "chat 42\n"), (12691, "chat 42\n")])  # found by hypothesis here
def test_another_threads_writes_inside_a_dump_never_make_its_frame_the_position(
        others: list[list[Frame]], writes: list[tuple[int, str]]) -> None:
    # Up to three writes of another thread (a logger's line, a progress bar's \r-ended text) land anywhere in the
    # dump, between any two of faulthandler's writes: the position is one of the main thread's own frames, even by
    # the thread's looks alone (no id recorded). (Four can break all three outermost threading frames of a thread
    # and the main thread's header: then only the recorded id tells. Three broke _bootstrap_inner, _bootstrap and
    # the header once, when threading's run was not yet taken for a thread's end.)
    threads = [("Thread", started(n, inner)) for n, inner in enumerate(others)]
    pieces = faulthandler_pieces([*threads, ("Current thread", MAIN_FRAMES)])
    for at, text in sorted(writes, reverse=True):
        pieces.insert(at % (len(pieces) + 1), text)
    parsed = hang.parse_dumps("".join(pieces).splitlines(), 0).get(0, [])
    pos = hang.position(parsed)
    mains = {(f.file, f.line) for f in MAIN_FRAMES}
    assert pos is None or (pos.file, pos.line) in mains, (pos, "".join(pieces))
    if not writes:
        assert pos == Position("/job/train.py", 30, "read_input", "", False)


def test_a_header_broken_by_a_logger_does_not_join_the_main_thread_to_the_one_before() -> None:
    # The CI failure of a chatty rank: a logger's line inside the main thread's header; its frames then followed
    # the chatting thread's, and the chatting thread was named.
    pieces = faulthandler_pieces([("Thread", started(0, [Frame("/job/train.py", 140, "chatter")])),
                                  ("Current thread", MAIN_FRAMES)])
    header = pieces.index("Current thread ")
    pieces.insert(header + 1, "INFO:chatty:chat 7\n")
    threads = hang.parse_dumps("".join(pieces).splitlines(), 0)[0]
    assert [t.frames[-1].func for t in threads] == ["_bootstrap", "<module>"]
    assert hang.position(threads) == Position("/job/train.py", 30, "read_input", "", False)


def test_a_known_main_thread_id_picks_that_thread_and_no_other() -> None:
    script = Frame("/job/train.py", 9, "<module>")
    boot = Frame("/opt/launcher/bootstrap.py", 392, "<module>")
    looks_main = Thread("0x00007f0000000001", True, (Frame("/job/other.py", 3, "spin"), script))
    real = Thread("0x00007f0000000002", False, (Frame("/job/train.py", 57, "load_batch"), boot))
    assert hang.main_thread([looks_main, real]) is real  # by its looks: the last printed that fits
    assert hang.main_thread([real, looks_main]) is looks_main  # ... which another order fools
    assert hang.main_thread([real, looks_main], 0x7F0000000002) is real  # the id: whatever the order
    assert hang.main_thread([looks_main, real], 0x7F0000000002) is real
    pos = hang.position([looks_main, real], (), 0x7F0000000002)
    assert pos is not None and (pos.line, pos.func) == (57, "load_batch")
    assert hang.main_thread([looks_main], 0x7F0000000002) is None  # missing: no other thread stands for it
    assert hang.position([looks_main], (), 0x7F0000000002) is None
    headless = Thread("?1", False, real.frames)  # its header broken by another thread's output
    assert hang.main_thread([looks_main, headless], 0x7F0000000002) is headless
    assert hang.main_thread([Thread("?1", False, looks_main.frames)], 0x7F0000000002) is None


@given(st.integers(0, 2 ** 64 - 1))
def test_a_header_id_reads_back_as_the_number_faulthandler_printed(ident: int) -> None:
    lines = render(f"0x{ident:016x}", True, [Frame("/job/train.py", 1, "<module>")])
    threads = hang.parse_dumps(lines)[None]
    assert hang.thread_id(threads[0].ident) == ident and hang.main_thread(threads, ident) is threads[0]


def test_a_header_right_after_a_progress_bar_is_still_a_header() -> None:
    # tqdm's refresh ends in "]" with no newline: faulthandler's header follows it on the same line
    bar = "\r 38%|###7      | 3/8 [00:05<00:08,  1.63s/it]"
    lines = "".join([bar, *faulthandler_pieces([("Current thread", MAIN_FRAMES)])]).splitlines()
    assert hang.position(hang.parse_dumps(lines, 0)[0]) == Position("/job/train.py", 30, "read_input", "", False)

