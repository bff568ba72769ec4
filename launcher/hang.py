"""A hung job's stacks, read: where each rank is, which rank is the odd one out, and the sentence that names it.

Pure functions over text the workers wrote (so over any bytes): Python's ``faulthandler`` dumps, as a
signal or a fatal error prints them, possibly with torchrun's ``[rankN]:`` prefix on every line::

    [rank3]:Thread 0x00007f1c2a7fc6c0 (most recent call first):
    [rank3]:  File "/usr/lib/python3.11/threading.py", line 324 in wait
    [rank3]:
    [rank3]:Current thread 0x00007f1c3b1c5740 (most recent call first):
    [rank3]:  File "/job/train.py", line 57 in load_batch
    [rank3]:  File "/job/train.py", line 88 in <module>

Each rank's position is the innermost frame of its main thread that is the user's own code (not the
standard library, not an installed package, not torch, not the launcher), with the library function it
was in (``all_reduce``). A rank *waits for the others* when a frame below that one is a ``torch.distributed``
function of :data:`DISTRIBUTED_WAITS`: a collective, or joining a group (``init_process_group``, ``new_group``:
the store's rendezvous, the backend's connections, the store-based barrier), or DDP's start-up checks; or the
autograd engine's backward pass (:data:`BACKWARD_WAITS`: DDP's gradient all-reduce is waited for there) or DDP's
broadcast of the buffers in its forward pass (:data:`DDP_WAITS`).
Ranks are grouped by position; the odd one out is the group that is not waiting for the others while others
are, else the smaller groups; when every rank is at one place, that place is named. A rank that gave no stack
while every rank that gave one waits for the others is named as the likely culprit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Optional

MAX_LINE = 4096  # characters of a line that are looked at
MAX_FRAMES = 200  # frames kept per thread (faulthandler itself stops at 100)
MAX_THREADS = 200  # threads kept per dump
_PREFIX = re.compile(r"^\[rank(\d{1,7})\]:\s?")
# what another thread wrote into the same file may stand before faulthandler's text on its line (a progress bar's
# ``\r``-ended text, a print cut short): a header or a frame is looked for anywhere on the line
_HEADER = re.compile(r"(Current thread|Thread) (0x[0-9a-fA-F]+)\b.*\(most recent call first\):\s*$")
_STACK = re.compile(r"^\s*Stack \(most recent call first\):\s*$")  # dump_traceback(all_threads=False)
_FRAME = re.compile(r'(?:^|\s)File "(.*)", line (\d+|\?+) in (.*?)\s*$')
_FATAL = re.compile(r"^\s*Fatal Python error: ")
_STDLIB = re.compile(r"/lib(64)?/python\d+(\.\d+)?t?/")
LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/torch/", "<frozen ")
COLLECTIVE_PART = "/torch/distributed/"
# torch.distributed's collectives: a rank in one waits for the others (a point-to-point recv is no collective)
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "all_reduce_coalesced"})
# Joining a process group waits for every member too, at one of these frames of torch.distributed (names as
# torch 2.x defines them; tests/test_hang.py checks each against the installed torch): the group's entry points,
# the backend's connections (gloo's and NCCL's constructors: ``_create_gloo_process_group`` in torch >= 2.8,
# inside ``_new_process_group_helper`` before), the store's rendezvous (``rendezvous.py``: a TCPStore client
# waits for its server) and the store-based barrier; DDP's constructor checks and broadcasts its parameters.
GROUP_WAITS = frozenset({
    "init_process_group", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
    "init_device_mesh", "_new_process_group_helper", "_create_gloo_process_group", "_create_nccl_process_group",
    "_store_based_barrier", "rendezvous", "_rendezvous_helper", "_create_c10d_store", "_env_rendezvous_handler",
    "_tcp_rendezvous_handler", "_file_rendezvous_handler", "_verify_param_shape_across_processes",
    "_sync_module_states", "_sync_params_and_buffers"})
DISTRIBUTED_WAITS = COLLECTIVES | GROUP_WAITS
# DDP's (and FSDP's) gradient reduction runs inside the autograd engine: the reducer's hooks start the all-reduce
# and the end of the backward pass waits for it, in C++, with no torch.distributed frame on the stack. A rank of a
# data-parallel job whose backward pass has not returned for the hang timeout waits for the others' gradients
# (Lightning, transformers' Trainer and accelerate all call it: ``loss.backward()``).
BACKWARD_PART = "/torch/autograd/"
BACKWARD_WAITS = frozenset({"backward", "_engine_run_backward"})  # torch/autograd/__init__.py, graph.py
# DDP's forward pass broadcasts the module's buffers from rank 0 (``broadcast_buffers=True``, the default: a BERT's
# position ids) through the C++ ``_broadcast_coalesced``, called from this method of torch's DDP module.
DDP_PART = "/torch/nn/parallel/distributed.py"
DDP_WAITS = frozenset({"_distributed_broadcast_coalesced"})
# the outermost frames of every thread that ``threading`` started (threading.py): a frame that follows
# ``_bootstrap`` in a dump is another thread's, whose header another thread's output broke
THREADING_BOOTSTRAP = "_bootstrap"
THREADING_FRAMES = frozenset({THREADING_BOOTSTRAP, "_bootstrap_inner"})
# the launcher's sampler thread: its innermost frame is in launcher/bootstrap.py, in none of the main thread's
SAMPLER = ("/bootstrap.py", ("run", "<module>"))
# the outermost frame of the main thread of a worker started through launcher/bootstrap.py
BOOTSTRAP_MAIN = ("/bootstrap.py", "<module>")


class Frame(NamedTuple):
    """One frame as faulthandler prints it; ``line`` 0 when it printed ``???``."""

    file: str
    line: int
    func: str

    def where(self) -> str:
        """``train.py:57 in load_batch``."""
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line} in {self.func}"


class Thread(NamedTuple):
    """One thread of a dump: its id, whether it took the signal, its frames innermost first."""

    ident: str
    current: bool
    frames: tuple[Frame, ...]


class Position(NamedTuple):
    """Where a rank is: its innermost user frame, the library function it is in, and whether it waits for
    the other ranks in ``torch.distributed`` (:data:`DISTRIBUTED_WAITS`). Plain values: sent between hosts."""

    file: str
    line: int
    func: str
    call: str  # the outermost distributed wait it is in, else the innermost frame's function when not user code
    comm: bool

    def where(self) -> str:
        """``train.py:57 in load_batch``."""
        return Frame(self.file, self.line, self.func).where()


def split_prefix(line: str, default: Optional[int] = None) -> tuple[Optional[int], str]:
    """``[rank3]:text`` -> (3, ``text``); a line without the prefix belongs to ``default``."""
    match = _PREFIX.match(line)
    if match:
        return int(match.group(1)), line[match.end():]
    return default, line


def parse_dumps(lines: Iterable[str], default: Optional[int] = None) -> dict[Optional[int], list[Thread]]:
    """Each rank's last stack dump (its threads in the order printed) from interleaved, prefixed lines.

    A dump starts at a thread header; a thread id seen again, a ``Fatal Python error`` line or a
    ``Stack`` header starts the rank's next dump. Lines that are no frame are skipped: before a dump, the
    worker's output; within it, another thread's (a logger writes while faulthandler does). faulthandler
    writes a line in many writes (a name a character at a time), so another thread's text can also break a
    line: a frame is lost, or a header, and a frame after a thread's outermost ``threading`` frame
    (``_bootstrap``, or ``_bootstrap_inner`` or ``run`` when the lines after it were lost) starts the next thread
    all the same.
    """
    dumps: dict[Optional[int], list[tuple[str, bool, list[Frame]]]] = {}
    reading: dict[Optional[int], bool] = {}  # the rank's last line was part of a thread's frames
    for raw in lines:
        rank, text = split_prefix(raw[:MAX_LINE].rstrip("\r\n"), default)
        header, stack = _HEADER.search(text), _STACK.match(text)
        if header or stack or _FATAL.match(text):
            current = dumps.setdefault(rank, [])
            ident = header.group(2).lower() if header else "stack"
            if not header or any(t[0] == ident for t in current):
                current.clear()
            reading[rank] = bool((header or stack) and len(current) < MAX_THREADS)
            if reading[rank]:
                current.append((ident, not header or header.group(1) == "Current thread", []))
            continue
        if not reading.get(rank):
            continue
        frame = _FRAME.search(text)
        if frame:
            frames = dumps[rank][-1][2]
            number = frame.group(2)
            found = Frame(frame.group(1), int(number) if number.isdigit() else 0, frame.group(3))
            if frames and _ends_a_thread(frames[-1], found):
                if len(dumps[rank]) >= MAX_THREADS:
                    reading[rank] = False
                    continue
                frames = []
                dumps[rank].append((f"?{len(dumps[rank])}", False, frames))
            if len(frames) < MAX_FRAMES:
                frames.append(found)
        # else: another thread's output, written while faulthandler wrote (a logger; a line cut into a frame's
        # line), or what faulthandler adds ("<no Python frame>", "Extension modules: ..."): skipped; the worker
        # ends with its dump, and the next dump starts at its first header
    return {rank: [Thread(i, c, tuple(f)) for i, c, f in threads] for rank, threads in dumps.items() if threads}


def _ends_a_thread(last: Frame, following: Frame) -> bool:
    """``following`` is another thread's frame, whose header another thread's output broke: ``last`` is the
    outermost frame of a thread ``threading`` started (``_bootstrap``), or one before it whose outer lines were
    lost (``_bootstrap_inner`` and ``following`` no ``_bootstrap``; threading's ``run`` and ``following`` none of
    threading's outermost frames)."""
    if last.func == "run" and last.file.endswith("threading.py"):
        return not _is_threading_start(following)
    if not _is_threading_start(last):
        return False
    return last.func == THREADING_BOOTSTRAP or not (following.func == THREADING_BOOTSTRAP
                                                   and following.file.endswith("threading.py"))


def is_user_code(path: str, own: Sequence[str] = ()) -> bool:
    """True for the user's own files: not the standard library, an installed package, torch, or ``own``
    (the launcher's files that run in the worker)."""
    if _STDLIB.search(path) and "/site-packages/" not in path and "/dist-packages/" not in path:
        return False
    return not any(part in path for part in LIBRARY_PARTS) and not any(path.startswith(o) for o in own if o)


def _is_threading_start(frame: Frame) -> bool:
    """One of the outermost frames of a thread that ``threading`` started."""
    return frame.func in THREADING_FRAMES and frame.file.endswith("threading.py")


def thread_id(ident: str) -> Optional[int]:
    """A header's thread id as a number (``0x00007f5624a8ab80``); None for a thread whose header was lost."""
    try:
        return int(ident, 16) if ident.startswith("0x") else None
    except ValueError:
        return None


def main_thread(threads: Sequence[Thread], main: Optional[int] = None) -> Optional[Thread]:
    """The thread the script runs in. When its id ``main`` is known (the worker's bootstrap recorded
    ``threading.main_thread().ident``, the number in faulthandler's header): the thread with that id, or the
    one whose header another thread's output broke (:func:`parse_dumps`) and whose outermost frame is the
    bootstrap's (:data:`BOOTSTRAP_MAIN`), else None. Else by its looks, the last printed first (faulthandler
    prints the threads newest first, the main thread last): the one not started by ``threading``
    (either of its two outermost frames is threading's, so that one lost frame does not hide it) whose
    outermost frame is ``<module>``, else one not started by ``threading`` with a frame outside the standard
    library (the script's, a package's), else any not started by ``threading``, else the one that took the signal. The
    launcher's sampler (:data:`SAMPLER`) is never it, even when its dump was cut short (another thread
    wrote into it, so that its outermost frames are missing)."""
    if main is not None:
        return next((t for t in threads if thread_id(t.ident) == main),
                    next((t for t in threads if t.ident.startswith("?") and t.frames[-1:] and
                          t.frames[-1].file.endswith(BOOTSTRAP_MAIN[0]) and t.frames[-1].func == BOOTSTRAP_MAIN[1]),
                         None))

    def started_by_threading(t: Thread) -> bool:
        first = t.frames[0]
        return (any(_is_threading_start(f) for f in t.frames[-2:])
                or (first.file.endswith(SAMPLER[0]) and first.func not in SAMPLER[1]))

    # faulthandler prints the threads newest first: the main thread, the oldest, last; so the last that fits
    mains = [t for t in reversed(threads) if t.frames and not started_by_threading(t)]
    for thread in mains:
        if thread.frames[-1].func == "<module>":
            return thread
    for thread in mains:
        if any(not _STDLIB.search(f.file) or "-packages/" in f.file for f in thread.frames):
            return thread
    if mains:
        return mains[0]
    return next((t for t in threads if t.current), threads[-1] if threads else None)


def is_distributed_wait(frame: Frame) -> bool:
    """A frame in which a rank waits for the others: of ``torch.distributed`` (:data:`DISTRIBUTED_WAITS`), the
    autograd engine's backward pass, where DDP's gradient all-reduce is waited for (:data:`BACKWARD_WAITS`), or
    DDP's broadcast of the buffers in its forward pass (:data:`DDP_WAITS`)."""
    return (COLLECTIVE_PART in frame.file and frame.func in DISTRIBUTED_WAITS) or \
        (BACKWARD_PART in frame.file and frame.func in BACKWARD_WAITS) or \
        (DDP_PART in frame.file and frame.func in DDP_WAITS)


def position(threads: Sequence[Thread], own: Sequence[str] = (), main: Optional[int] = None) -> Optional[Position]:
    """Where the rank's main thread is (see :class:`Position`, :func:`main_thread`: ``main`` its id, when
    known); None when the dump has no frame of it. Without a user frame, the innermost frame stands for it
    and every frame is looked at for a distributed wait."""
    thread = main_thread(threads, main)
    if thread is None or not thread.frames:
        return None
    frames = thread.frames
    found = next((i for i, f in enumerate(frames) if is_user_code(f.file, own)), None)
    user = frames[found] if found is not None else frames[0]
    waits = [f for f in frames[:found if found is not None else len(frames)] if is_distributed_wait(f)]
    inner = frames[0]
    call = waits[-1].func if waits else "" if inner is user else inner.func
    return Position(user.file, user.line, user.func, call, bool(waits))


def ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 4, 6, 7]`` -> ``0-2, 4, 6-7``."""
    parts: list[str] = []
    run: list[int] = []
    for rank in sorted(set(ranks)):
        if run and rank != run[-1] + 1:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        run.append(rank)
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(parts)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranges(ranks)}"


def _hosts(ranks: Sequence[int], hosts: Mapping[int, str]) -> str:
    names = list(dict.fromkeys(hosts[r] for r in sorted(ranks) if r in hosts))
    return f" ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else ""


def _in(pos: Position) -> str:
    """``in all_reduce (train.py:88)`` or ``at train.py:88 in step``."""
    return f"in {pos.call} ({pos.where().split(' in ')[0]})" if pos.call else f"at {pos.where()}"


def same_place(positions: Mapping[int, Position]) -> dict[int, Position]:
    """Positions with their file's base name only: one script sits at another path on each host."""
    return {rank: pos._replace(file=pos.file.rsplit("/", 1)[-1]) for rank, pos in positions.items()}


def odd_ones_out(positions: Mapping[int, Position]) -> list[Position]:
    """The positions whose ranks stand out: those not waiting for the others while other ranks
    are; else those of the smaller groups when one group is the largest; else none (see :func:`same_place`)."""
    positions = same_place(positions)
    groups: dict[Position, list[int]] = {}
    for rank, pos in positions.items():
        groups.setdefault(pos, []).append(rank)
    if len(groups) < 2:
        return []
    waiting = [p for p in groups if p.comm]
    if waiting and len(waiting) < len(groups):
        return [p for p in groups if not p.comm]
    sizes = sorted((len(r) for r in groups.values()), reverse=True)
    if sizes[0] == sizes[1]:
        return []
    biggest = max(groups, key=lambda p: len(groups[p]))
    return [p for p in groups if p is not biggest]


def silent_culprits(positions: Mapping[int, Position], expected: Iterable[int] = ()) -> list[int]:
    """The ``expected`` ranks that gave no stack, when every rank that gave one waits for the others
    (:attr:`Position.comm`): they are likely what the others wait for. Else none."""
    missing = sorted(set(expected) - set(positions))
    return missing if missing and positions and all(p.comm for p in positions.values()) else []


def culprit_rank(positions: Mapping[int, Position], expected: Iterable[int] = ()) -> Optional[int]:
    """The one rank that stands out, when exactly one does: the one silent rank (:func:`silent_culprits`),
    else the one rank of :func:`odd_ones_out`."""
    silent = silent_culprits(positions, expected)
    if silent:
        return silent[0] if len(silent) == 1 else None
    odd = set(odd_ones_out(positions))
    ranks = [rank for rank, pos in same_place(positions).items() if pos in odd]
    return ranks[0] if len(ranks) == 1 else None


def _why(ranks: Sequence[int], why: Mapping[int, str]) -> str:
    """`` (SIGABRT ignored)``: the distinct reasons these ranks gave no stack, if known."""
    reasons = list(dict.fromkeys(why[r] for r in ranks if why.get(r)))
    return f" ({', '.join(reasons[:3])})" if reasons else ""


def culprit_sentence(positions: Mapping[int, Position], hosts: Mapping[int, str], silent_for: float,
                     expected: Iterable[int] = (), why: Optional[Mapping[int, str]] = None) -> str:
    """``hang: no progress for 300 s; rank 3 (algo-2) at train.py:57 in load_batch; ranks 0-2, 4-7 in
    all_reduce (train.py:88)``: the odd ones out first, then the others; or the place every rank shares.
    ``expected`` ranks with no position are named as such, with ``why`` (rank -> reason) when known: as the
    likely culprit when every other rank waits for the others (:func:`silent_culprits`)."""
    head = f"hang: no progress for {silent_for:.0f} s"
    why = why or {}
    expected = set(expected)
    positions = same_place(positions)
    groups: dict[Position, list[int]] = {}
    for rank in sorted(positions):
        groups.setdefault(positions[rank], []).append(rank)
    silent = silent_culprits(positions, expected)
    if silent:
        culprits = "the likely culprits" if len(silent) > 1 else "likely the culprit"
        parts = [f"{_ranks(silent)}{_hosts(silent, hosts)} gave no stack{_why(silent, why)}, {culprits}: "
                 "every other rank waits for the others"]
        parts += [f"{_ranks(groups[pos])} {_in(pos)}" for pos in sorted(groups, key=lambda p: (-len(groups[p]),
                                                                                               groups[p][0]))]
        return "; ".join([head, *parts])
    missing = sorted(expected - set(positions))
    tail = [f"no stack from {_ranks(missing)}{_hosts(missing, hosts)}{_why(missing, why)}"] if missing else []
    if not groups:
        return "; ".join([head, *tail])
    odd = odd_ones_out(positions)
    ordered = sorted(groups, key=lambda p: (p not in odd, -len(groups[p]) if p not in odd else len(groups[p]),
                                            groups[p][0]))
    if not odd and len(groups) == 1:
        only = ordered[0]
        everyone = "every rank" if not missing else f"{_ranks(groups[only])}"
        return "; ".join([f"{head}; no rank stands out: {everyone} {_in(only)}"
                          + (f" (called at {only.where()})" if only.call else ""), *tail])
    parts = []
    for pos in ordered:
        ranks = groups[pos]
        if pos in odd:
            parts.append(f"{_ranks(ranks)}{_hosts(ranks, hosts)} at {pos.where()}"
                         + (f" (in {pos.call})" if pos.call else ""))
        else:
            parts.append(f"{_ranks(ranks)} {_in(pos)}")
    if not odd:
        parts[0] = "no rank stands out: " + parts[0]
    return "; ".join([head, *parts, *tail])


def children_clause(kids: Sequence[tuple[int, int, Position]], culprit: Optional[int]) -> str:
    """``; rank 1's child pid 812 at data.py:20 in __getitem__``: where the culprit's children were (its
    DataLoader's workers), or every rank's when no rank stands out; at most three; "" when none."""
    chosen = [k for k in kids if culprit is None or k[0] == culprit][:3]
    return "".join(f"; rank {rank}'s child pid {pid} at {pos.where()}" for rank, pid, pos in chosen)
