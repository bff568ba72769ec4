"""Hang detection: no rank progressed for the hang timeout -> every rank's Python stacks, the culprit named.

A thread of the launcher checks once a second when any rank was last heard (:mod:`launcher.progress`:
explicit beats, the bootstrap's samples of each rank's main thread, lines of ranks that have neither).
The clock starts when this host's workers exist (the rendezvous has its own bound); the timeout in force
is the start's bound until the first step, then a fixed or a learned one (:mod:`launcher.hangtimeout`).
With several hosts, node 0 decides for the job: every other launcher adds to each job-watch
heartbeat how long ago its ranks were last heard (``age``) and last stepped (``step``), and the job is
hung when no rank of any host progressed for the timeout in force, or when at least as many ranks as not
have waited in a ``torch.distributed`` collective for the timeout and no rank beat explicitly meanwhile (the
livelock rule: the others spin; every host adds to its heartbeats how many of its ranks wait, ``wait``, and
its latest explicit beat, ``xb``). Then, on every host at once (node 0
leads through the job watch's ``hang`` messages; see :class:`launcher.jobwatch.Extension`):

1. ``freeze``: every launcher asks its workers' samplers to hold still (:func:`launcher.stacks.park_samplers`:
   faulthandler must not read a thread's frames while it changes them), stops its workers (SIGSTOP) and says
   ``frozen``: from now on no worker can die or notice that another did, so no stack changes while the others
   are taken;
2. ``dump``: every launcher sends :data:`launcher.stacks.STACK_SIGNAL` (SIGABRT) and SIGCONT to its
   workers. They run with ``PYTHONFAULTHANDLER=1`` (unless the user set it), so each writes the stack of
   every thread to its stderr file and ends; its core size limit is set to 0 first, so no core file is
   written. Each launcher reads the dumps straight from those files, torchrun held stopped meanwhile
   (:mod:`launcher.stacks`: bounded under load), and sends node 0 its ranks' positions (``stacks``: each
   innermost frame in user code, and why a rank gave no stack). The stacks reach each host's log in full,
   as every worker line does;
3. ``verdict``: node 0 names the odd one out in one sentence (:mod:`launcher.hang`), or the rank that gave
   no stack while every other rank waits for the others, and sends it to every host; it starts every
   host's report, the job ends with exit code 124 (class ``hang``, :mod:`launcher.codes`) everywhere.

From the freeze until its own workers' stacks are read, a launcher holds any stop that comes (the platform's
SIGTERM, the job watch's for another host): decided at once, its signal reaches the workers after the dump, at most
:data:`HOLD` seconds later (:meth:`launcher.supervise._StopSignals.hold`); a SIGTERM beside the stack signal ended
a worker in the middle of its dump.

Each step ends when every host (every worker) is done, at most :data:`FREEZE_WAIT` and :data:`STACK_WAIT`
seconds, bounds meant for a heavily loaded host: a host that does not answer is named as having given no
stack. A straggler (a rank heard before, now silent for half the timeout while others progress) is logged
once per silence; nothing is stopped for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from launcher import hang, hangtimeout, proctree, stacks
from launcher.hangtimeout import NCCL_PIPE_ENV
from launcher.progress import BeatSocket, Progress, beat_address
from launcher.stacks import signal_workers

if TYPE_CHECKING:
    from launcher.cluster import Cluster
    from launcher.jobwatch import Watch

STACK_WAIT = 30.0  # seconds at most from the signal until every worker dumped (ends as soon as all did)
FREEZE_WAIT = 10.0  # seconds node 0 waits for every host to say its workers are frozen (ends as soon as all did)
QUIET = 0.5  # the dumps are complete when every rank has one and nothing came for this long
HANG_GRACE = 2.0  # a hung worker runs no Python SIGTERM handler: a longer grace period only delays the end
HOLD = FREEZE_WAIT + 2 * STACK_WAIT + 5  # seconds at most a stop waits for this host's dump (a follower's worst)
TICK = 1.0  # how often the silence is judged
TURN = 0.2  # how often another host looks for node 0's orders
MAX_GROUPS_BYTES = 3000  # what a ``stacks`` message carries (the job watch's lines are at most 4096 bytes)
MAX_WHY_BYTES = 600  # ... and why ranks gave no stack, in the same line
MAX_KIDS = 8  # ... and where the ranks' children were (a DataLoader's workers)
# NCCL's Flight Recorder (torch >= 2.3): ring buffer of the last collectives, written out on a timeout.
NCCL_DUMP_WAIT = 2.0  # seconds the Flight Recorder gets to write its traces
OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the launcher's files in a worker's stack

StopRequest = Callable[[float, str], None]
StopHold = Callable[[Optional[float]], None]  # seconds to hold a stop for; None: no longer


class HangWatch:
    """This host's hang detector: a thread from :meth:`attach` (with torchrun's pid) to :meth:`close`.

    ``watch`` is the job watch with several hosts (node 0's hub decides, the others follow); None alone.
    ``timeout`` is a fixed hang timeout; ``rule`` (:mod:`launcher.hangtimeout`), when given, replaces it
    (the start's bound, a fixed or a learned timeout); :attr:`timeout` is then the one in force.
    """

    def __init__(self, timeout: float, progress: Progress, beats: Optional[BeatSocket],
                 hosts: Mapping[int, str], log: Callable[[str], None], watch: Optional[Watch] = None,
                 node: int = 0, rule: Optional[hangtimeout.Policy] = None,
                 clock: Optional[hangtimeout.Clock] = None, nccl_env: Optional[Mapping[str, str]] = None) -> None:
        self.timeout, self.progress, self.beats, self.hosts, self.log = timeout, progress, beats, hosts, log
        self.clock = clock or hangtimeout.Clock(rule or hangtimeout.Policy(timeout, start=timeout), log)
        self.why = ""  # why the timeout in force is what it is
        self.watch, self.node = watch, node
        self.nccl_env: Mapping[str, str] = nccl_env or {}  # the workers' environment (the Flight Recorder's pipe)
        self.verdict: Optional[str] = None  # the culprit sentence once a hang was decided
        self.culprit: tuple[Optional[int], Optional[str]] = (None, None)  # the rank that stands out, its host
        self.details: list[str] = []  # one line per rank of this host: where it was
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self._request: Optional[StopRequest] = None
        self._hold: Optional[StopHold] = None
        self._pid: Optional[int] = None
        self._closing = threading.Event()
        self._stragglers: set[int] = set()
        self._busy_until = 0.0  # another host in the middle of a hang: wait for the verdict until then
        self._frozen_at = 0.0
        self._dumped = False
        self._started: Optional[float] = None
        self._beats_note: Optional[str] = None  # the last thing said of the beat socket's file (logged once)
        self._remote: dict[int, float] = {}  # node -> when its ranks were last heard (this clock)
        self._remote_step: dict[int, float] = {}  # node -> its ranks' latest step-like event (this clock)
        self._remote_wait: dict[int, tuple[int, float]] = {}  # node -> (its ranks waiting, since: the latest)
        self._remote_explicit: dict[int, float] = {}  # node -> its ranks' latest explicit beat (this clock)
        self._phases: list[dict] = []  # node 0's orders not yet carried out (another host)
        self._frozen: set[int] = set()  # nodes that said frozen (node 0)
        self._stacks: dict[int, dict] = {}  # node -> its stacks message (node 0)
        self._why: dict[int, str] = {}  # rank -> why it gave no stack (this host's ranks; node 0: every host's)
        self._kids: list[tuple[int, int, hang.Position]] = []  # (rank, pid, position) of the ranks' children
        self.thread = threading.Thread(target=self._loop, name="hang-watch", daemon=True)
        if watch is not None:
            watch.add_extension(self)

    # -- supervise's side --
    def feed(self, chunk: bytes, stderr: bool = False) -> None:
        """A chunk of torchrun's output (see :meth:`launcher.progress.Progress.feed`)."""
        self.progress.feed(chunk, stderr)

    def attach(self, request: Optional[StopRequest], pid: Optional[int] = None,
               hold: Optional[StopHold] = None) -> None:
        """Called by supervise with its stop hook, torchrun's pid and its hold of a stop once it runs; (None) when
        it returns."""
        with self.lock:
            self._request, self._pid, self._hold = request, pid, hold
        if request is not None and not self.thread.is_alive():
            self.thread.start()

    def close(self) -> None:
        """Stop the thread; a decision under way (stacks being read) is finished first (bounded).

        The thread is woken at once (its select or sleep would otherwise end the launcher up to
        :data:`TURN` later, on every host at the end of every job)."""
        self._closing.set()
        with self.changed:
            self.changed.notify_all()
        if self.beats is not None:
            self.beats.wake()
        if self.thread.is_alive():
            self.thread.join(timeout=FREEZE_WAIT + 2 * STACK_WAIT + 5)
        if self.beats is not None:
            self.beats.close()

    # -- the job watch's side (its loop thread: never blocks) --
    def beat(self) -> dict:
        """Fields for this host's heartbeats: how long ago its ranks were last heard (none before they run)."""
        if self.node == 0 or self._started is None:
            return {}
        now, step, explicit = time.monotonic(), self.progress.last_step(), self.progress.last_beat
        waits = self.progress.waiting()
        return {"age": round(now - self._latest_local(), 3), **({"step": round(now - step, 3)} if step else {}),
                **({"wait": [len(waits), round(now - max(waits.values()), 3)]} if waits else {}),
                **({"xb": round(now - explicit, 3)} if explicit is not None else {})}

    def on_message(self, node: int, host: str, message: dict) -> None:
        """A heartbeat's ``age`` (node 0), or a ``hang`` message; a malformed one raises (the watch drops it)."""
        kind = message["t"]
        now = time.monotonic()
        with self.changed:
            if kind == "hb" and self.node == 0 and "age" in message:
                age = float(message["age"])
                if 0 <= age < 10 * 86400:
                    self._remote[node] = now - age
                step = float(message.get("step", -1))
                if 0 <= step < 10 * 86400:
                    self._remote_step[node] = now - step
                count, waited = message.get("wait", [0, 0.0])
                self._remote_wait[node] = (min(int(count), 4096), now - min(max(float(waited), 0.0), 10 * 86400))
                explicit = float(message.get("xb", -1))
                if 0 <= explicit < 10 * 86400:
                    self._remote_explicit[node] = now - explicit
            elif kind == "hang" and self.node == 0:
                phase = str(message["phase"])
                if phase == "frozen":
                    self._frozen.add(node)
                elif phase == "stacks":
                    self._stacks[node] = {"host": host, "ranks": [int(r) for r in message["ranks"]][:4096],
                                          "groups": _read_groups(message["groups"]),
                                          "why": _read_why(message.get("why", [])),
                                          "kids": _read_kids(message.get("kids", []))}
                self.changed.notify_all()
            elif kind == "hang" and node == 0 and self.node != 0:
                self._phases.append(message)
                self.changed.notify_all()

    # -- the thread --
    def _latest_local(self) -> float:
        return max([self._started or time.monotonic(), *self.progress.last().values()])

    def _workers(self) -> list[int]:
        with self.lock:
            pid = self._pid
        return proctree.children_of(pid) if pid is not None else []

    def _loop(self) -> None:
        judged = 0.0
        workers: list[int] = []
        while not self._closing.is_set() or (self.verdict is None and time.monotonic() < self._busy_until):
            if self.beats is not None:
                ready, _, _ = select.select([self.beats], [], [], TURN)
                if ready:
                    self.beats.drain(self.progress)
            else:
                self._closing.wait(TURN)
            if self.node != 0 and self._follow():
                return
            if time.monotonic() - judged < TICK:
                continue
            judged = time.monotonic()
            self._keep_beats()
            workers = self._workers()
            if not workers:
                if self._started is not None:  # ended (a restart starts again with the start's bound)
                    self.clock.restart()
                self._started = None  # not started yet (rendezvous), or ended: nothing can hang
                continue
            now = time.monotonic()
            self._started = self._started or now
            latest = self._latest_local()
            self._check_stragglers(self.progress.last(), latest, now)
            if self.node != 0:
                continue
            with self.lock:
                latest = max([latest, *self._remote.values()])
                steps = [s for s in (self.progress.last_step(), *self._remote_step.values())
                         if s is not None and s >= self._started]
            self.clock.observe(max(steps, default=None), now - self._started)
            self.timeout, self.why = self.clock.timeout()
            if self._closing.is_set():
                continue
            if now - latest >= self.timeout:
                self._lead(now - latest, workers)
                return
            waited = self._waited(now)
            if waited is not None and waited[0] >= self.timeout:
                self._lead(waited[0], workers, waited[1])
                return

    def _waited(self, now: float) -> Optional[tuple[float, str]]:
        """The livelock rule (docs/hangs.md): most ranks wait in ``torch.distributed`` for the others and
        the rest never join. When at least as many ranks wait as do not, and none beat explicitly meanwhile:
        how long the last of them has waited, and a phrase for the log; else None."""
        with self.lock:
            nodes = self._running_nodes() | {0}
            waits = [(n, since) for node, (n, since) in self._remote_wait.items() if node in nodes and n]
            explicit = [t for node, t in self._remote_explicit.items() if node in nodes]
        local = self.progress.waiting()
        if local:
            waits.append((len(local), max(local.values())))
        count, total = sum(n for n, _ in waits), len(self.hosts) * len(nodes)
        free = total - count
        if not waits or free < 1 or count < free:
            return None
        since = max([since for _, since in waits] + [self._started or now])
        if self.progress.last_beat is not None:
            explicit.append(self.progress.last_beat)
        since = max([since, *explicit])
        return now - since, (f"{count} of {total} ranks waited in torch.distributed for the others for "
                             f"{now - since:.0f} s; {free} never joined")

    def _keep_beats(self) -> None:
        """Bind the beat socket again if its file is gone (:meth:`BeatSocket.rebind_if_gone`): the workers'
        beats would otherwise be lost, and a healthy job taken for a hung one."""
        note = self.beats.rebind_if_gone(self.progress) if self.beats is not None else None
        if note is not None and note != self._beats_note:
            self.log(note)
        self._beats_note = note

    def _check_stragglers(self, heard: Mapping[int, float], latest: float, now: float) -> None:
        for rank, when in heard.items():
            silent = now - when
            if silent < self.timeout / 2:
                self._stragglers.discard(rank)
            elif rank not in self._stragglers and now - latest < self.timeout / 4:
                self._stragglers.add(rank)
                host = self.hosts.get(rank, "")
                self.log(f"straggler: rank {rank}{f' ({host})' if host else ''} silent for {silent:.0f} s "
                         f"while other ranks progress (hang timeout {self.timeout:g} s)")

    def _lead(self, silent: float, workers: Sequence[int], because: str = "") -> None:
        """Node 0 (or a single host): freeze, dump, read, name the culprit, tell everyone, stop."""
        others = self._running_nodes()
        self.log(f"hang: {because or f'no rank progressed for {silent:.0f} s'}; hang timeout {self.why}: asking "
                 f"every worker{f' of {len(others) + 1} hosts' if others else ''} for the Python stacks of "
                 "all its threads")
        if others:
            self._post({"phase": "freeze"})
        self._nccl_dumps()
        self._holding(HOLD)
        try:
            self._freeze(workers)
            if others:
                self._wait(lambda: others <= self._frozen, FREEZE_WAIT)
                self._post({"phase": "dump"})
            positions = self._dump(workers)
        finally:
            self._holding(None)
        if others:
            self._wait(lambda: others <= set(self._stacks), STACK_WAIT + 3)
        hosts = dict(self.hosts)
        expected = set(self.hosts)
        why = dict(self._why)
        kids = list(self._kids)
        with self.lock:
            for reply in self._stacks.values():
                kids += reply["kids"]
                expected |= set(reply["ranks"])
                hosts.update({rank: reply["host"] for rank in reply["ranks"]})
                why.update(reply["why"])
                for pos, ranks in reply["groups"]:
                    positions.update({rank: pos for rank in ranks})
        unanswered = self._expected_remote(others)
        why.update({rank: "its host sent no stacks" for rank in unanswered})
        expected |= unanswered
        sentence = hang.culprit_sentence(positions, hosts, silent, expected, why)
        rank = hang.culprit_rank(positions, expected)
        sentence += hang.children_clause(kids, rank)
        self.culprit = (rank, hosts.get(rank) if rank is not None else None)
        if others:
            self._post({"phase": "verdict", "text": sentence, "rank": rank, "host": self.culprit[1]})
        self._conclude(sentence)

    def _follow(self) -> bool:
        """Another host: carry out node 0's orders; True once the verdict came. Frozen workers whose
        ``dump`` never comes (node 0 gone) are dumped here anyway, for this host's log."""
        with self.lock:
            phases, self._phases = self._phases, []
        if self._frozen_at and not self._dumped and time.monotonic() - self._frozen_at > FREEZE_WAIT + STACK_WAIT:
            self.log("hang: node 0 sent no dump order: taking this host's stacks anyway")
            phases.append({"phase": "dump"})
        for message in phases:
            phase = message.get("phase")
            self._busy_until = time.monotonic() + FREEZE_WAIT + STACK_WAIT + 10
            if phase == "freeze":
                self.log("hang: node 0 found no progress anywhere: freezing the workers here for their stacks")
                self._nccl_dumps()
                self._holding(HOLD)  # until this host's dump (below), or the hold's bound
                self._freeze(self._workers())
                self._frozen_at = time.monotonic()
                self._post({"phase": "frozen"})
            elif phase == "dump" and not self._dumped:
                self._dumped = True
                ranks = sorted(self.hosts)
                try:
                    positions = self._dump(self._workers())
                finally:
                    self._holding(None)
                self._post({"phase": "stacks", "ranks": ranks, "groups": _write_groups(positions),
                            "why": _write_why(self._why), "kids": _write_kids(self._kids)})
            elif phase == "verdict":
                rank, host = message.get("rank"), message.get("host")
                self.culprit = (rank if isinstance(rank, int) else None, str(host)[:100] if host else None)
                self._conclude(str(message.get("text", ""))[:1000] or "hang: (no verdict text)")
                return True
        return False

    def _dump(self, workers: Sequence[int]) -> dict[int, hang.Position]:
        """Stacks of this host's (frozen) workers, each read from its stderr file (:func:`launcher.stacks.take`);
        a worker whose file cannot be read, from the output torchrun copies. Logged per rank."""
        self.progress.capture()
        with self.lock:
            parent = self._pid
        taken = stacks.take(workers, parent, STACK_WAIT)
        dumps: dict[Optional[int], list[hang.Thread]] = dict(taken.dumps)
        if taken.unread:
            dumps = {**self._wait_for_dumps(len(workers)), **dumps}
        positions = {rank: pos for rank, threads in dumps.items() if rank is not None
                     for pos in [hang.position(threads, (OWN_DIR,), taken.mains.get(rank))] if pos is not None}
        self._kids = [(rank, pid, pos) for rank, kids in sorted(taken.children.items()) for pid, threads in kids
                      for pos in [hang.position(threads, (OWN_DIR,))] if pos is not None]
        self._why = {rank: why for rank, why in taken.why.items() if rank not in positions}
        self._why.update({rank: stacks.NO_MAIN for rank in taken.mains  # a dump from the copied output: said here
                          if rank in dumps and rank not in positions and rank not in self._why})
        self._why.update({rank: "" for rank in self.hosts if rank not in positions and rank not in self._why})
        self.details = [f"rank {rank} ({self.hosts.get(rank, '?')}): " + (
            f"{positions[rank].where()}" + (f", in {positions[rank].call}" if positions[rank].call else "")
            if rank in positions else "no stack" + (f" ({self._why[rank]})" if self._why[rank] else ""))
            for rank in sorted({*positions, *self._why})]
        self.details += [f"rank {rank} ({self.hosts.get(rank, '?')}), its child pid {pid}: {pos.where()}"
                         + (f", in {pos.call}" if pos.call else "") for rank, pid, pos in self._kids]
        return dict(positions)

    def _holding(self, seconds: Optional[float]) -> None:
        """Hold a stop that comes while this host's stacks are taken (``seconds`` at most); None: no longer."""
        with self.lock:
            hold = self._hold
        if hold is not None:
            hold(seconds)

    def _freeze(self, workers: Sequence[int]) -> None:
        """Stop the workers (SIGSTOP) once their samplers hold still (:func:`launcher.stacks.park_samplers`)."""
        late = stacks.park_samplers(workers)
        if late:
            self.log(f"hang: the sampler of {len(late)} worker(s) did not hold still within "
                     f"{stacks.PARK_WAIT:g} s (pid {', '.join(map(str, late))}): their stacks may come incomplete")
        signal_workers(workers, signal.SIGSTOP)

    def _nccl_dumps(self) -> None:
        """GPU runs: the Flight Recorder's traces first (its thread must run: before the freeze)."""
        if self.nccl_env and trigger_nccl_dumps(self.nccl_env, sorted(self.hosts)):
            self.log(f"hang: asked NCCL's Flight Recorder of each rank here for its trace "
                     f"({self.nccl_env.get('TORCH_NCCL_DEBUG_INFO_TEMP_FILE', '')}<rank>)")
            time.sleep(NCCL_DUMP_WAIT)

    def _conclude(self, sentence: str) -> None:
        self.verdict = sentence
        self.log(sentence)
        with self.lock:
            request = self._request
        if request is not None:
            request(HANG_GRACE, f"{sentence.split(';')[0]}: stopping the workers "
                                f"(grace period at most {HANG_GRACE:g} s)")

    def _running_nodes(self) -> set[int]:
        watch = self.watch
        states = getattr(watch, "states", None) if watch is not None else None
        return {n for n, state in (states or {}).items() if state == "running" and n != 0}

    def _expected_remote(self, nodes: set[int]) -> set[int]:
        """The ranks of hosts that sent no stacks (node k holds k*n..k*n+n-1 with n ranks per host here)."""
        per = len(self.hosts)
        return {node * per + i for node in nodes if node not in self._stacks for i in range(per)}

    def _post(self, fields: dict) -> None:
        if self.watch is not None:
            self.watch.post({"t": "hang", **fields})

    def _wait(self, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not done() and time.monotonic() < deadline:
                self.changed.wait(min(0.1, max(0.0, deadline - time.monotonic())))

    def _wait_for_dumps(self, count: int) -> dict[Optional[int], list[hang.Thread]]:
        """The dumps torchrun copied to the launcher since the signal (workers whose file cannot be read):
        until ``count`` ranks have one and output is quiet, at most :data:`STACK_WAIT` s."""
        deadline = time.monotonic() + STACK_WAIT
        size, changed = -1, time.monotonic()
        dumps: dict[Optional[int], list[hang.Thread]] = {}
        while time.monotonic() < deadline:
            lines = self.progress.captured_lines()
            if len(lines) != size:
                size, changed = len(lines), time.monotonic()
                dumps = hang.parse_dumps(lines)
            elif len([r for r in dumps if r is not None]) >= count and time.monotonic() - changed >= QUIET:
                break
            time.sleep(0.1)
        return hang.parse_dumps(self.progress.captured_lines())


def _write_groups(positions: Mapping[int, hang.Position]) -> list[list[Any]]:
    """Positions as ``[[file, line, func, call, comm, [ranks]], ...]``, within :data:`MAX_GROUPS_BYTES`."""
    groups: dict[hang.Position, list[int]] = {}
    for rank, pos in sorted(positions.items()):
        groups.setdefault(pos, []).append(rank)
    out: list[list[Any]] = []
    size = 0
    for pos, ranks in groups.items():
        item = [pos.file[-200:], pos.line, pos.func[:100], pos.call[:100], pos.comm, ranks]
        size += len(str(item)) + 8
        if size > MAX_GROUPS_BYTES:
            break
        out.append(item)
    return out


def _write_why(why: Mapping[int, str]) -> list[list[Any]]:
    """Why ranks gave no stack as ``[[reason, [ranks]], ...]``, within :data:`MAX_WHY_BYTES`."""
    groups: dict[str, list[int]] = {}
    for rank, reason in sorted(why.items()):
        groups.setdefault(reason[:60], []).append(rank)
    out: list[list[Any]] = []
    size = 0
    for reason, ranks in groups.items():
        size += len(json.dumps([reason, ranks])) + 2
        if size > MAX_WHY_BYTES:
            break
        out.append([reason, ranks])
    return out


def _write_kids(kids: Sequence[tuple[int, int, hang.Position]]) -> list[list[Any]]:
    """The ranks' children's positions as ``[[rank, pid, file, line, func], ...]``: at most :data:`MAX_KIDS`."""
    return [[rank, pid, pos.file[-200:], pos.line, pos.func[:100]] for rank, pid, pos in kids[:MAX_KIDS]]


def _read_kids(items: object) -> list[tuple[int, int, hang.Position]]:
    """The inverse of :func:`_write_kids`, from another host: raises on a malformed value."""
    if not isinstance(items, list):
        raise ValueError("kids")
    return [(int(rank), int(pid), hang.Position(str(file)[:200], int(line), str(func)[:100], "", False))
            for rank, pid, file, line, func in items[:MAX_KIDS]]


def _read_why(items: object) -> dict[int, str]:
    """The inverse of :func:`_write_why`, from another host: raises on a malformed value."""
    if not isinstance(items, list):
        raise ValueError("why")
    return {int(rank): str(reason)[:60] for reason, ranks in items[:64] for rank in ranks[:4096]}


def _read_groups(groups: object) -> list[tuple[hang.Position, list[int]]]:
    """The inverse of :func:`_write_groups`, from another host: raises on a malformed value."""
    if not isinstance(groups, list):
        raise ValueError("groups")
    read = []
    for item in groups[:1000]:
        file, line, func, call, comm, ranks = item
        read.append((hang.Position(str(file)[:200], int(line), str(func)[:100], str(call)[:100], bool(comm)),
                     [int(r) for r in ranks][:4096]))
    return read


def trigger_nccl_dumps(environ: Mapping[str, str], ranks: Sequence[int]) -> int:
    """Ask each rank's NCCL Flight Recorder to write its trace (a byte to its pipe); how many took it.
    A pipe nobody reads (no NCCL, or the user's own setting elsewhere) is skipped at once."""
    prefix = environ.get(NCCL_PIPE_ENV)
    done = 0
    for rank in ranks if prefix else ():
        with contextlib.suppress(OSError):
            fd = os.open(f"{prefix}{rank}.pipe", os.O_WRONLY | os.O_NONBLOCK)
            try:
                done += os.write(fd, b"1") == 1
            finally:
                os.close(fd)
    return done


def for_cluster(cluster: Cluster, rule: hangtimeout.Policy, run_dir: str, log: Callable[[str], None],
                watch: Optional[Watch] = None, previous: Optional[HangWatch] = None,
                worker_env: Optional[Mapping[str, str]] = None, remake: Sequence[str] = ()) -> HangWatch:
    """This host's hang watch: its ranks named by this host, beats on the run directory's socket, the
    timeout of ``rule``. ``previous``: the last generation's (a job-wide restart): what it learned of the
    job's steps stays, and the new generation starts under the start's bound. ``worker_env``: the workers'
    environment (where the NCCL Flight Recorder's pipe is, on GPU hosts). ``remake``: the run directory's
    directories to make again with the beat socket if the directory is removed under the job."""
    clock = None
    if previous is not None:
        clock = previous.clock
        clock.restart()
    beats: Optional[BeatSocket] = None
    try:
        beats = BeatSocket(run_dir, remake)
    except OSError as exc:
        log(f"progress beats off: cannot bind {beat_address(run_dir)}: {exc}; output lines "
            "still count as progress")
    first = cluster.node_rank * cluster.nproc_per_node
    hosts = {first + i: cluster.current_host for i in range(cluster.nproc_per_node)}
    return HangWatch(rule.fixed or rule.start, Progress(), beats, hosts, log, watch, cluster.node_rank, rule, clock,
                     nccl_env=worker_env)


def report(watch: HangWatch, limit: int) -> str:
    """The hang's report: the culprit sentence, then where each rank of this host was; at most ``limit``."""
    text = watch.verdict or ""
    for line in watch.details:
        if len(text) + 1 + len(line) > limit:
            break
        text += "\n" + line
    return text[:limit]
