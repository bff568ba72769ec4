"""The launchers of one job watch each other: a failed or silent host stops the job everywhere.

Node 0's launcher runs a hub on the watch port (default: the rendezvous port + 1), bound on every
interface; every other launcher connects to the master address on that port, retrying while its job
runs (at most the rendezvous timeout). They exchange newline-delimited JSON objects, each line at most
:data:`MAX_LINE` bytes:

- ``hello`` {node, host, nnodes}: a client's first line; the hub answers with its own ``hello``, then
  every event it has relayed so far (a late joiner learns what happened before it came);
- ``hb``: a heartbeat, every second both ways;
- ``failed`` {node, host, code, report, primary}: that host's workers failed; ``report`` is the first
  lines of its failure report, ``primary`` False when its failure looks caused by another host (a
  collective whose peer went away, a broken rendezvous);
- ``done`` {node, host}: that host's workers all succeeded (it may leave);
- ``lost`` {node, host, why}: the hub lost that host (also sent to the lost host, best effort);
- ``end``: in a job where only some hosts train (:mod:`launcher.groups`), every training host is
  done: the others stop their script with SIGTERM and their configured grace period, which is no failure.

The hub relays every ``failed`` and every loss to all the others. A peer is lost when its connection
closes before it said ``done`` or ``failed``, when nothing came from it for the heartbeat timeout, or
when it sends garbage (not a JSON object, a line over :data:`MAX_LINE`). Before the handshake nothing
is a loss: a watch port held by another program or a hub that never answers only means no watch.

Any failure or loss elsewhere stops this host's workers at once (the stop path of
:mod:`launcher.supervise` with a grace period of at most :data:`REMOTE_GRACE` s: once a peer is gone
no collective-consistent checkpoint is possible, and a worker blocked in a collective never runs its
Python SIGTERM handler, so a longer grace period only delays the end). The job's root cause, which
every host's report starts with and whose exit code every host exits with, is the first failure that
is not a consequence of another (``primary``), else the first loss or failure seen. A lost host counts
as killed by SIGKILL (exit code 137): from outside, power loss, a preempted VM and a dead network look
the same, and 137 is what platforms' retry policies already treat as "the machine went away".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

from launcher.command import address_of, watch_port
from launcher.groups import training_nodes, watch_place

if TYPE_CHECKING:
    from launcher.cluster import Cluster
    from launcher.failure import RootCause
    from launcher.options import Options
    from launcher.outcome import Outcome

MAX_LINE = 4096  # bytes of one message: a report head is at most ~600 characters
REPORT_LINES, REPORT_CHARS = 2, 600  # what a ``failed`` message carries of a host's report
REMOTE_GRACE = 1.0  # the grace period of a stop caused by another host (at most the configured one)
LOST_CODE = 137  # a lost host: as if SIGKILLed (see the module's docstring)
HANDSHAKE_TIMEOUT = 10.0  # a connection that says no hello in this time is not a launcher
RETRY = 0.5  # between a client's connection attempts
REPORT_LIMIT = 1024
# A worker's failure that is the consequence of another host's: its peer vanished from a collective
# (gloo, NCCL), or the rendezvous store broke.
_SECONDARY = re.compile(r"Connection (closed|reset) by peer|Broken pipe|DistNetworkError|DistStoreError|"
                        r"DistBackendError|NCCL (error|communicator)|remote process exited|timed out|Timeout",
                        re.IGNORECASE)

StopRequest = Callable[[float, str], None]


class Event(NamedTuple):
    """A host that ended badly: it failed (``failed``) or went silent (``lost``)."""

    kind: str
    node: int
    host: str
    code: int
    report: str  # the first lines of its report; for a loss "algo-2 lost: no heartbeat for 3 s"
    primary: bool


def is_secondary(exception: str, rank: Optional[int]) -> bool:
    """True when a failure looks caused by another host: torchrun itself failed (``rank`` None: its
    rendezvous broke) or the exception is a collective's or the store's lost peer."""
    return rank is None or bool(_SECONDARY.search(exception))


def report_head(report: str) -> str:
    """The first lines of a failure report: who failed, how, and the exception line."""
    return "\n".join(report.splitlines()[:REPORT_LINES])[:REPORT_CHARS]


def job_report(cause: Event, here: str) -> str:
    """This host's report when another host caused the failure: the cause first, then what happened here."""
    return f"{cause.report}\nthen {here}"[:REPORT_LIMIT]


def _encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


class _Peer:
    """One connection: its read buffer, who it said it is, when it was last heard."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.node: Optional[int] = None
        self.host = ""
        self.heard = time.monotonic()
        self.ended = False  # said done or failed: its closing is no loss

    def lines(self, data: bytes) -> list[dict]:
        """The messages completed by ``data``. Raises ValueError on garbage."""
        self.buffer += data
        *complete, self.buffer = self.buffer.split(b"\n")
        if len(self.buffer) > MAX_LINE or any(len(line) > MAX_LINE for line in complete):
            raise ValueError("a message over the size limit")
        messages = [json.loads(line) for line in complete if line.strip()]
        if not all(isinstance(m, dict) and isinstance(m.get("t"), str) for m in messages):
            raise ValueError("not a message")
        if messages:
            self.heard = time.monotonic()
        return messages


def _text(value: object, limit: int = REPORT_CHARS) -> str:
    return str(value)[:limit]


class Watch:
    """What hub and client share: the loop thread, events, the stop hook. Use :func:`start`."""

    def __init__(self, node: int, host: str, nnodes: int, timeout: float, log: Callable[[str], None]) -> None:
        self.node, self.host, self.nnodes, self.timeout, self.log = node, host, nnodes, timeout, log
        self.interval = min(1.0, timeout / 3)
        self.events: list[Event] = []
        self.cond = threading.Condition()
        self.selector = selectors.DefaultSelector()
        self.peers: dict[socket.socket, _Peer] = {}
        self.closing = False
        self.stopped_job = False  # this watch asked supervise to stop the workers
        self._request: Optional[StopRequest] = None
        self._sent = 0.0
        self.training: Optional[frozenset[int]] = None  # the nodes that train, when not all do
        self.training_ended = False  # this host was told the training world has ended (``end``)
        self.thread = threading.Thread(target=self._loop, name="job-watch", daemon=True)

    # -- the main thread's side --
    def attach(self, request: Optional[StopRequest]) -> None:
        """Called by supervise with its stop hook (None when it returns); stops at once if a cause is known."""
        with self.cond:
            self._request = request
            pending = bool(self.events) and request is not None
        if pending:
            self._stop()
        if request is not None and self.training_ended:
            request(float("inf"), "job watch: the training world has ended: SIGTERM to the script")

    def _training_over(self) -> None:
        """Every training host is done: stop this host's script (SIGTERM, the configured grace period)."""
        with self.cond:
            if self.training_ended:
                return
            self.training_ended = True
            request = self._request
        if request is None:
            self.log("job watch: every training host is done: this host's script will be stopped (SIGTERM)")
        else:
            request(float("inf"), "job watch: the training world has ended: SIGTERM to the script")

    def cause(self) -> Optional[Event]:
        """The job's root cause seen so far: the first primary failure, else the first event."""
        with self.cond:
            return next((e for e in self.events if e.primary), self.events[0] if self.events else None)

    def wait_for_cause(self, timeout: float) -> Optional[Event]:
        """Wait (bounded) for a failure or loss elsewhere, while anyone is connected."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.events and self.connected() and time.monotonic() < deadline:
                self.cond.wait(max(0.0, min(0.1, deadline - time.monotonic())))
        return self.cause()

    def connected(self) -> bool:
        """True while a handshaken peer is connected."""
        return any(p.node is not None for p in list(self.peers.values()))

    def finish(self, code: int, report: str, primary: bool) -> tuple[int, str]:
        """Tell the others how this host ended; the job's exit code and this host's report.

        ``report`` is this host's own (empty on success), ``primary`` False when its failure looks
        caused by another host: then the watch waits (at most the heartbeat timeout + 1 s) for that cause.
        """
        if code != 0 and not primary:
            self.wait_for_cause(self.timeout + 1.0)
        cause = self.cause()
        mine = Event("failed", self.node, self.host, code, report_head(report), primary)
        if code == 0:
            self._leave({"t": "done", "node": self.node, "host": self.host}, code)
            return 0, ""
        self._leave({"t": "failed", **mine._asdict()}, code)
        if cause is None or (primary and not cause.primary):
            return code, report
        return cause.code, job_report(cause, report)

    def close(self) -> None:
        """End the loop thread and close every socket."""
        with self.cond:
            self.closing = True
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        for sock in list(self.peers):
            sock.close()
        self.selector.close()

    # -- the loop thread --
    def _stop(self) -> None:
        cause = self.cause()
        with self.cond:
            request = self._request
        if request is None or cause is None:
            return
        self.stopped_job = True
        request(REMOTE_GRACE, f"job watch: {cause.report.splitlines()[0]}: stopping the workers here "
                              f"(grace period at most {REMOTE_GRACE:g} s)")

    def _record(self, event: Event) -> None:
        with self.cond:
            if any(e.node == event.node for e in self.events):
                return
            self.events.append(event)
            self.cond.notify_all()
        self.log(f"job watch: {event.report.splitlines()[0]}")
        self._stop()

    def _send(self, peer: _Peer, message: dict) -> bool:
        try:
            peer.sock.send(_encode(message))
            return True
        except BlockingIOError:
            return True  # a peer that does not read: its heartbeat timeout decides
        except OSError:
            return False

    def _drop(self, peer: _Peer) -> None:
        self.peers.pop(peer.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(peer.sock)
        peer.sock.close()

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(65536)
            messages = peer.lines(data) if data else []
        except BlockingIOError:
            return
        except (OSError, ValueError, RecursionError) as exc:
            self._gone(peer, "connection closed" if isinstance(exc, OSError) else "sent garbage")
            return
        for message in messages:
            try:
                self._on_message(peer, message)
            except (KeyError, TypeError, ValueError, ArithmeticError):
                self._gone(peer, "sent garbage")
                return
        if not data:
            self._gone(peer, "connection closed")

    def _loop(self) -> None:
        while True:
            with self.cond:
                if self.closing:
                    return
            # Taken before reading: a process paused between a read and this check (SIGSTOP) reads
            # what came meanwhile before it can judge anyone silent.
            now = time.monotonic()
            for key, _mask in self.selector.select(timeout=0.1):
                if key.data is None:
                    self._accept(key.fileobj)
                else:
                    self._read(key.data)
            for peer in list(self.peers.values()):
                if peer.node is None and now - peer.heard > HANDSHAKE_TIMEOUT:
                    self._gone(peer, "no hello")
                elif peer.node is not None and not peer.ended and now - peer.heard > self.timeout:
                    self._gone(peer, f"no heartbeat for {self.timeout:g} s")
            if now - self._sent >= self.interval:
                self._sent = now
                for peer in list(self.peers.values()):
                    if peer.node is not None:
                        self._send(peer, {"t": "hb"})
            self._tick(now)

    def _accept(self, listener: object) -> None:
        raise NotImplementedError

    def _on_message(self, peer: _Peer, message: dict) -> None:
        raise NotImplementedError

    def _gone(self, peer: _Peer, why: str) -> None:
        raise NotImplementedError

    def _tick(self, now: float) -> None:
        """Once per loop turn: what a role does besides reading and heartbeats."""

    def _leave(self, message: dict, code: int) -> None:
        raise NotImplementedError


def _event(message: dict, nnodes: int) -> Event:
    """A ``failed`` or ``lost`` message as an Event; raises on a malformed one."""
    node = int(message["node"])
    if not 0 <= node < nnodes:
        raise ValueError("node out of range")
    if message["t"] == "lost":
        host = _text(message["host"], 100)
        return Event("lost", node, host, LOST_CODE, f"{host} lost: {_text(message['why'], 100)}", False)
    code = int(message["code"])
    return Event("failed", node, _text(message["host"], 100), code if 0 < code < 256 else 1,
                 _text(message["report"]), bool(message["primary"]))


class Hub(Watch):
    """Node 0: accepts the other launchers, relays failures and losses, outlives the job's end."""

    def __init__(self, port: int, *args: object) -> None:
        if socket.has_dualstack_ipv6():  # every interface: the master address is one of them
            self.listener = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self.listener = socket.create_server(("", port))
        super().__init__(*args)  # type: ignore[arg-type]
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.states: dict[int, str] = {}  # node -> running, done, failed, lost
        self.own: Optional[dict] = None  # this host's failure, to tell the clients
        self.own_done = False  # this host's workers all succeeded
        self.end_sent = False  # ``end`` was broadcast: every training node is done

    def close(self) -> None:
        """End the loop thread, close every socket and stop listening."""
        super().close()
        self.listener.close()

    def _accept(self, listener: object) -> None:
        try:
            sock, _addr = self.listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        peer = _Peer(sock)
        self.peers[sock] = peer
        self.selector.register(sock, selectors.EVENT_READ, peer)

    def _broadcast(self, message: dict, skip: Optional[_Peer] = None) -> None:
        for peer in list(self.peers.values()):
            if peer is not skip and peer.node is not None:
                self._send(peer, message)

    def _on_message(self, peer: _Peer, message: dict) -> None:
        kind = message["t"]
        if peer.node is None:
            node = int(message["node"])
            if kind != "hello" or not 0 < node < self.nnodes or node in self.states or \
                    int(message["nnodes"]) != self.nnodes:
                raise ValueError("not a hello of this job")
            peer.node, peer.host = node, _text(message["host"], 100)
            self.states[node] = "running"
            self._send(peer, {"t": "hello", "node": 0, "host": self.host, "nnodes": self.nnodes})
            for event in list(self.events):
                self._send(peer, _as_message(event))
            if self.end_sent:
                self._send(peer, {"t": "end"})
        elif kind == "failed":
            event = _event({**message, "node": peer.node, "host": peer.host}, self.nnodes)
            peer.ended = True
            self.states[peer.node] = "failed"
            self._broadcast(_as_message(event), skip=peer)
            self._record(event)
        elif kind == "done":
            peer.ended = True
            self.states[peer.node] = "done"

    def _gone(self, peer: _Peer, why: str) -> None:
        if peer.node is not None and not peer.ended:
            self.states[peer.node] = "lost"
            event = Event("lost", peer.node, peer.host, LOST_CODE, f"{peer.host} lost: {why}", False)
            self._broadcast(_as_message(event))  # the lost one too: it may hear why, if it still can
            self._record(event)
        self._drop(peer)

    def _leave(self, message: dict, code: int) -> None:
        """Tell everyone, then keep relaying until every node that joined is done, failed or lost."""
        with self.cond:
            if code != 0:
                self.own = message  # sent by the loop thread, which owns the sockets
            else:
                self.own_done = True
        deadline = None if code == 0 else time.monotonic() + self.timeout + REMOTE_GRACE + 10
        while any(s == "running" for s in list(self.states.values())):
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def _tick(self, now: float) -> None:
        with self.cond:
            own, self.own = self.own, None
        if own is not None:
            self._broadcast(own)
        if self.training is not None and not self.end_sent and all(
                (n == self.node and self.own_done) or self.states.get(n) == "done" for n in self.training):
            self.end_sent = True
            self._broadcast({"t": "end"})
            if self.node not in self.training:
                self._training_over()


def _as_message(event: Event) -> dict:
    if event.kind == "lost":
        return {"t": "lost", "node": event.node, "host": event.host, "why": event.report.split(" lost: ", 1)[-1]}
    return {"t": "failed", **event._asdict()}


class Client(Watch):
    """Every other node: connects to the hub, hears its relays, tells it how this host ended."""

    def __init__(self, address: str, port: int, deadline: float, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.address, self.port, self.deadline = address, port, deadline
        self.hub: Optional[_Peer] = None
        self.next_try = 0.0
        self.complained = False

    def _accept(self, listener: object) -> None:  # a client listens on nothing
        raise AssertionError

    def _tick(self, now: float) -> None:
        if self.hub is not None or self.events or now < self.next_try or now > self.deadline:
            return
        self.next_try = now + RETRY
        try:
            sock = socket.create_connection((self.address, self.port), timeout=1.0)
        except OSError:
            return
        sock.setblocking(False)
        self.hub = _Peer(sock)
        self.peers[sock] = self.hub
        self.selector.register(sock, selectors.EVENT_READ, self.hub)
        self._send(self.hub, {"t": "hello", "node": self.node, "host": self.host, "nnodes": self.nnodes})

    def _on_message(self, peer: _Peer, message: dict) -> None:
        kind = message["t"]
        if peer.node is None:
            if kind != "hello" or int(message["node"]) != 0 or int(message["nnodes"]) != self.nnodes:
                raise ValueError("not this job's hub")
            peer.node, peer.host = 0, _text(message["host"], 100)
            self.log(f"job watch: connected to the hub on {peer.host} ({self.address}:{self.port})")
        elif kind == "end":
            self._training_over()
        elif kind in ("failed", "lost"):
            event = _event(message, self.nnodes)
            if event.node != self.node or event.kind == "lost":
                self._record(event)

    def _gone(self, peer: _Peer, why: str) -> None:
        if peer.node is None:
            if not self.complained:
                self.complained = True
                self.log(f"job watch: {self.address}:{self.port} is not this job's hub ({why}); retrying")
            self.next_try = time.monotonic() + 2 * RETRY
        elif not peer.ended:
            self._record(Event("lost", 0, peer.host, LOST_CODE, f"{peer.host} lost: {why}", False))
        self._drop(peer)
        self.hub = None

    def _leave(self, message: dict, code: int) -> None:
        """Send how this host ended (bounded: 1 s); then the hub may forget it."""
        with self.cond:
            self.closing = True
        self.thread.join(timeout=5)
        hub = self.hub
        if hub is None or hub.node is None:
            return
        hub.ended = True
        try:
            hub.sock.settimeout(1.0)
            hub.sock.sendall(_encode(message))
            hub.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def start(node: int, host: str, nnodes: int, master: str, port: int, timeout: float, connect_for: float,
          log: Callable[[str], None], training: Optional[frozenset[int]] = None) -> Optional[Watch]:
    """Start this host's watch (hub on node 0, else client); None if the hub cannot listen (logged).

    ``training``: the nodes that train, when not all do (the hub sends ``end`` when they are all done)."""
    try:
        watch: Watch = (Hub(port, node, host, nnodes, timeout, log) if node == 0 else
                        Client(master, port, time.monotonic() + connect_for, node, host, nnodes, timeout, log))
    except OSError as exc:
        log(f"job watch off: cannot listen on port {port}: {os.strerror(exc.errno) if exc.errno else exc}")
        return None
    if node == 0:
        log(f"job watch: hub on port {port}")
    watch.training = training
    watch.thread.start()
    return watch


def for_cluster(cluster: Cluster, options: Options, log: Callable[[str], None]) -> Optional[Watch]:
    """The watch of this host's launcher (several nodes); None if the hub cannot listen (logged)."""
    port = watch_port(cluster, options)
    node, nnodes, hub = watch_place(cluster)
    return start(node, cluster.current_host, nnodes, address_of(hub, options.resolve), port,
                 options.heartbeat_timeout, float(options.rdzv_timeout), log, training_nodes(cluster))


def conclude(watch: Watch, host: str, outcome: Outcome, cause: Optional[RootCause], code: int,
             report: str) -> tuple[int, str]:
    """The job's exit code and this host's report, told to the others (see :meth:`Watch.finish`)."""
    if code != 0 and watch.stopped_job and outcome.stop_signal is not None:
        killed = "; the rest killed after it" if outcome.killed_after_grace else ""
        return watch.finish(code, f"{host}: its workers were stopped because of that (SIGTERM, grace period at most "
                                  f"{REMOTE_GRACE:g} s{killed})", False)
    primary = outcome.stop_signal is not None or (
        cause is not None and not is_secondary(cause.exception, cause.rank))
    return watch.finish(code, report, primary)
