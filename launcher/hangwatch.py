"""Hang detection: no rank progressed for the hang timeout -> every rank's Python stacks, the culprit named.

A thread of the launcher checks once a second when any rank was last heard (:mod:`launcher.progress`:
output lines and beats). The clock starts when this host's workers exist (the rendezvous has its own
bound). When no rank has been heard for ``--hang-timeout`` seconds:

1. every worker is asked for the Python stack of every thread. The workers run with
   ``PYTHONFAULTHANDLER=1`` (unless the user set it), so :data:`STACK_SIGNAL` (SIGABRT) makes each one
   print every thread's stack to its stderr and end; its core size limit is set to 0 first, so no core
   file is written. The stacks reach this host's log in full, as every worker line does;
2. the dumps are read (:mod:`launcher.hang`): each rank's innermost frame in user code, the odd one out;
3. the sentence that names it is logged, becomes the verdict (exit code 124, class ``hang``, see
   :mod:`launcher.codes`) and starts the report; the job is stopped.

A straggler (a rank heard before, now silent for half the timeout while others progress) is logged once
per silence, and nothing is stopped for it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Callable, Optional

from launcher import hang, proctree
from launcher.progress import BEAT_ENV, BEAT_SOCKET, BeatSocket, Progress

if TYPE_CHECKING:
    from launcher.cluster import Cluster

STACK_SIGNAL = signal.SIGABRT
STACK_WAIT = 10.0  # seconds at most from the signal until the dumps are read
QUIET = 0.5  # the dumps are complete when every rank has one and nothing came for this long
HANG_GRACE = 2.0  # a hung worker runs no Python SIGTERM handler: a longer grace period only delays the end
TICK = 1.0
OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the launcher's files in a worker's stack

StopRequest = Callable[[float, str], None]


class HangWatch:
    """This host's hang detector: a thread from :meth:`attach` (with torchrun's pid) to :meth:`close`."""

    def __init__(self, timeout: float, progress: Progress, beats: Optional[BeatSocket],
                 hosts: Mapping[int, str], log: Callable[[str], None]) -> None:
        self.timeout, self.progress, self.beats, self.hosts, self.log = timeout, progress, beats, hosts, log
        self.verdict: Optional[str] = None  # the culprit sentence once a hang was decided
        self.details: list[str] = []  # one line per rank: where it was
        self.silent_for = 0.0
        self.lock = threading.Lock()
        self._request: Optional[StopRequest] = None
        self._pid: Optional[int] = None
        self._closing = threading.Event()
        self._stragglers: set[int] = set()
        self.thread = threading.Thread(target=self._loop, name="hang-watch", daemon=True)

    def feed(self, chunk: bytes, stderr: bool = False) -> None:
        """A chunk of torchrun's output (see :meth:`launcher.progress.Progress.feed`)."""
        self.progress.feed(chunk, stderr)

    def attach(self, request: Optional[StopRequest], pid: Optional[int] = None) -> None:
        """Called by supervise with its stop hook and torchrun's pid once it runs; (None) when it returns."""
        with self.lock:
            self._request, self._pid = request, pid
        if request is not None and not self.thread.is_alive():
            self.thread.start()

    def close(self) -> None:
        """Stop the thread; a decision under way (stacks being read) is finished first (bounded)."""
        self._closing.set()
        if self.thread.is_alive():
            self.thread.join(timeout=STACK_WAIT + 5)
        if self.beats is not None:
            self.beats.close()

    def _loop(self) -> None:
        started: Optional[float] = None
        while not self._closing.is_set():
            if self.beats is not None:
                ready, _, _ = select.select([self.beats], [], [], TICK)
                if ready:
                    self.beats.drain(self.progress)
            else:
                self._closing.wait(TICK)
            with self.lock:
                pid = self._pid
            workers = proctree.children_of(pid) if pid is not None else []
            if not workers:
                started = None  # not started yet (rendezvous), or ended: nothing can hang
                continue
            now = time.monotonic()
            started = started or now
            heard = self.progress.last()
            latest = max([started, *heard.values()])
            self._check_stragglers(heard, latest, now)
            if now - latest >= self.timeout and not self._closing.is_set():
                self._decide(now - latest, workers)
                return

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

    def _decide(self, silent: float, workers: Sequence[int]) -> None:
        self.silent_for = silent
        self.log(f"hang: no rank progressed for {silent:.0f} s (--hang-timeout {self.timeout:g}): "
                 f"asking {len(workers)} worker(s) for the Python stacks of all their threads")
        self.progress.capture()
        signal_workers(workers, STACK_SIGNAL)
        dumps = self._wait_for_dumps(len(workers))
        positions = {rank: pos for rank, threads in dumps.items() if rank is not None
                     for pos in [hang.position(threads, (OWN_DIR,))] if pos is not None}
        self.details = [f"rank {rank} ({self.hosts.get(rank, '?')}): {pos.where()}"
                        + (f", in {pos.call}" if pos.call else "") for rank, pos in sorted(positions.items())]
        sentence = hang.culprit_sentence(positions, self.hosts, silent, self.hosts.keys())
        self.verdict = sentence
        self.log(sentence)
        with self.lock:
            request = self._request
        if request is not None:
            request(HANG_GRACE, f"{sentence.split(';')[0]}: stopping the workers "
                                f"(grace period at most {HANG_GRACE:g} s)")

    def _wait_for_dumps(self, count: int) -> dict[Optional[int], list[hang.Thread]]:
        """The dumps printed since the signal: until every worker's is there and output is quiet, at most
        :data:`STACK_WAIT` s."""
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


def signal_workers(pids: Sequence[int], signum: int) -> None:
    """Send ``signum`` to each worker; before SIGABRT, set its core size limit to 0 (no core file)."""
    import resource  # only on a hang

    for pid in pids:
        if signum == signal.SIGABRT:
            with contextlib.suppress(OSError, ValueError):
                resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def worker_env(environ: Mapping[str, str], run_dir: str) -> tuple[dict[str, str], list[str]]:
    """The workers' variables for hang detection: where beats go, and faulthandler on (unless the user
    set ``PYTHONFAULTHANDLER``: then a note says stacks may not come). Pure."""
    changes = {BEAT_ENV: os.path.join(run_dir, BEAT_SOCKET)}
    notes = []
    if "PYTHONFAULTHANDLER" in environ:
        if not environ["PYTHONFAULTHANDLER"]:
            notes.append("kept PYTHONFAULTHANDLER= (set by the user): a hang's stacks will be missing")
    else:
        changes["PYTHONFAULTHANDLER"] = "1"
    return changes, notes


def for_cluster(cluster: Cluster, timeout: float, run_dir: str, log: Callable[[str], None]) -> HangWatch:
    """This host's hang watch: its ranks named by this host, beats on the run directory's socket."""
    beats: Optional[BeatSocket] = None
    try:
        beats = BeatSocket(run_dir)
    except OSError as exc:
        log(f"progress beats off: cannot bind {os.path.join(run_dir, BEAT_SOCKET)}: {exc}; output lines "
            "still count as progress")
    first = cluster.node_rank * cluster.nproc_per_node
    hosts = {first + i: cluster.current_host for i in range(cluster.nproc_per_node)}
    return HangWatch(timeout, Progress(), beats, hosts, log)


def report(watch: HangWatch, limit: int) -> str:
    """The hang's report: the culprit sentence, then where each rank of this host was; at most ``limit``."""
    text = watch.verdict or ""
    for line in watch.details:
        if len(text) + 1 + len(line) > limit:
            break
        text += "\n" + line
    return text[:limit]
