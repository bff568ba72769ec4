"""Restarts in place (:mod:`launcher.restart`) over the job watch: the generation messages and their state.

Attached to a watch (:func:`attach`, done by :func:`launcher.jobwatch.start`) as its coordination, the way hang
detection attaches as its :class:`launcher.jobwatch.Extension`. It owns ``gen_end``, ``gen_stop`` and ``gen``
(see the table in :mod:`launcher.jobwatch.messages`): each host tells node 0 how its generation ended; the first
failure of a generation stops it everywhere; once every end is in (or a host is lost) node 0's rules decide, the
same for every host. Everything but :meth:`Restarts.end_generation` runs on the watch's loop thread.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

from launcher import restart
from launcher.jobwatch import messages
from launcher.jobwatch.watch import REMOTE_GRACE

if TYPE_CHECKING:
    from launcher.jobwatch.watch import StopRequest, Watch

KINDS = frozenset({"gen_end", "gen_stop", "gen"})  # the messages this module owns
# node 0's rules: (generation, every end, when a lost host was last heard: None if none is lost) -> decision
Policy = Callable[[int, list[dict], Optional[float]], dict]


class Restarts:
    """The generation this host runs, what node 0 decided at the end of each, the latest generation whose
    workers were ordered to stop, and this host's end of the current one (node 0: every host's)."""

    kinds = KINDS

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.generation = 0
        self.decisions: dict[int, dict] = {}
        self.stop_gen = -1
        self.my_end: Optional[dict] = None
        self.policy: Optional[Policy] = None  # node 0's rules (launcher/restart.py)
        self.gen_ends: dict[int, dict[int, dict]] = {}  # node 0: every node's end of each generation
        self.end_sent: Optional[dict] = None  # a client: this host's gen_end last sent to the hub

    # -- the main thread's side --
    def end_generation(self, end: dict, timeout: float) -> Optional[dict]:
        """See :meth:`launcher.jobwatch.Watch.end_generation`."""
        watch = self.watch
        with watch.cond:
            gen = self.generation
            self.my_end = {"t": "gen_end", "gen": gen, **end}
        watch.wake()
        deadline = time.monotonic() + timeout
        with watch.cond:  # a client that found no hub (``off``) gets no decision
            while gen not in self.decisions and not watch.events and not watch.off and time.monotonic() < deadline:
                watch.cond.wait(max(0.0, min(0.1, deadline - time.monotonic())))
            return self.decisions.get(gen)

    def attached(self, request: StopRequest) -> None:
        """Supervise attached a stop hook: the workers of a generation already ordered to stop stop now."""
        if self.stop_gen == self.generation:
            self.watch.stop_workers(request, f"job watch: generation {self.generation} failed on another host: "
                                             "stopping the workers here")

    # -- the loop thread --
    def on_message(self, node: int, message: dict) -> None:
        """One of :data:`KINDS` from ``node`` (raises on a malformed one: the watch drops it)."""
        kind = message["t"]
        if kind == "gen_end" and self.watch.role == "hub":
            self._generation_end(node, message)
        elif kind == "gen_stop" and self.watch.role == "client":
            self._gen_stop(int(message["gen"]), str(message["report"])[:messages.REPORT_CHARS])
        elif kind == "gen" and self.watch.role == "client":
            self._decided(message)

    def rejoined(self) -> list[dict]:
        """Node 0, to a node that (re)joined: what it may have missed of the restarts."""
        with self.watch.cond:
            latest = self.decisions.get(max(self.decisions)) if self.decisions else None
            stop_gen = self.stop_gen
        out = [{"t": "gen", **latest}] if latest is not None else []
        return out + ([messages.GenStop(stop_gen, "").encode()] if stop_gen >= 0 else [])

    def joined(self) -> list[dict]:
        """A client, on a new connection to the hub: its end again (the old connection may have lost it)."""
        with self.watch.cond:
            end = self.my_end
        return [_stamped(end)] if end is not None else []

    def tick(self) -> list[dict]:
        """Once per loop turn: node 0 takes its own end and decides; a client returns its end when not yet sent."""
        with self.watch.cond:
            end = self.my_end
        if self.watch.role == "hub":
            if end is not None and 0 not in self.gen_ends.get(int(end["gen"]), {}):
                self._generation_end(0, end)
            self._decide()
            return []
        if end is not None and end is not self.end_sent and self.watch.connected():
            self.end_sent = end
            return [_stamped(end)]
        return []

    def _gen_stop(self, gen: int, head: str) -> None:
        """Generation ``gen`` failed somewhere: stop this host's workers of it (now, or when they start)."""
        watch = self.watch
        with watch.cond:
            if gen <= self.stop_gen or gen < self.generation:
                return
            self.stop_gen = gen
            request = watch.stop_hook if gen == self.generation else None
        if request is not None:
            watch.stop_workers(request, f"job watch: {head.splitlines()[0] if head else 'another host failed'}: "
                                        f"stopping the workers of generation {gen} here (grace period at most "
                                        f"{REMOTE_GRACE:g} s)")

    def _decided(self, message: dict) -> None:
        """Node 0's decision at the end of a generation: remembered; a restart moves on to the next one."""
        gen = int(message["generation"])
        with self.watch.cond:
            if gen in self.decisions or gen != self.generation:
                return
            self.decisions[gen] = {**message, "heard": time.monotonic()}
            if message.get("restart"):
                self.generation, self.my_end = gen + 1, None
            self.watch.cond.notify_all()

    def _generation_end(self, node: int, message: dict) -> None:
        """Node 0: a node's generation ended: a failure stops the generation everywhere; the last end decides."""
        gen = int(message["gen"])
        ends = self.gen_ends.setdefault(gen, {})
        if node in ends:
            return
        # raises on a malformed one; ``at``: when its first failure was, on this (node 0's) clock
        end = restart.end_of({**message, "node": node})
        offset = self.watch.clock_offset(node) if node != 0 else 0.0  # its record's and death's times, here
        end = end._replace(at=time.monotonic() - end.age,
                           record_at=None if end.record_at is None else end.record_at + offset,
                           death_at=None if end.death_at is None else end.death_at + offset)
        ends[node] = end.message()
        if int(message["code"]) != 0 and gen >= self.generation and gen > self.stop_gen:  # the first failure only
            head = str(message.get("head", ""))[:messages.REPORT_CHARS]
            self.watch.post_now(messages.GenStop(gen, head).encode(), skip=node)
            self._gen_stop(gen, head)
        self._decide()

    def _decide(self) -> None:
        """Node 0, once every node's end of the current generation is in (or a host is lost): the decision."""
        watch = self.watch
        with watch.cond:
            gen, policy, events = self.generation, self.policy, list(watch.events)
            known = gen in self.decisions
        if known or policy is None:
            return
        ends = self.gen_ends.get(gen, {})
        lost_at = min((e.at for e in events if e.kind == "lost"), default=None)
        if lost_at is None and len(ends) < watch.members():
            return
        decision = {"t": "gen", **policy(gen, [ends[n] for n in sorted(ends)], lost_at)}
        cause = decision.get("cause")
        if cause is not None:  # how long ago the root cause's failure was: each host places it on its own clock
            decision["cause_age"] = round(max(0.0, time.monotonic() - float(cause["at"])), 3)
        watch.post_now(decision)
        self._decided(decision)


def _stamped(end: dict) -> dict:
    """A client's ``gen_end`` as sent: with its clock (``w``) for node 0's ``clock_offset``."""
    return {**end, "w": round(time.time(), 6)}


def attach(watch: Watch) -> Restarts:
    """Make ``watch`` carry restarts (its ``coordination``)."""
    restarts = Restarts(watch)
    watch.coordination = restarts
    return restarts
