"""The watch both roles share: framing (newline-delimited JSON), tags (HMAC-SHA256), connections and the loop.

See :mod:`launcher.jobwatch` for the design and :mod:`launcher.jobwatch.messages` for the messages."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import math
import os
import selectors
import socket
import threading
import time
from typing import Callable, NamedTuple, Optional, Protocol

from launcher import codes
from launcher.jobwatch import messages

MAX_LINE = 4096  # bytes of one message: a report head is at most ~600 characters
REPORT_LINES, REPORT_CHARS = 2, 600  # what a ``failed`` message carries of a host's report
REMOTE_GRACE = 1.0  # the grace period of a stop caused by another host (at most the configured one)
LOST_CODE = codes.HOST_LOST_CODE  # a lost host: as if SIGKILLed (see the module's docstring)
LOSS_TIMEOUT = 30.0  # default: a host silent this long is lost (see the module's docstring)
HEARTBEAT = 1.0  # seconds between heartbeats (a third of the loss timeout when that is below 3 s)
SUSPECT_AFTER = 3.0  # silence that makes a host suspect (half the loss timeout when that is below 6 s)
HANDSHAKE_TIMEOUT = 10.0  # a connection that says no hello in this time is not a launcher
ATTEMPT_TIMEOUT = 3.0  # a connection attempt not answered with ``watch`` in this time is abandoned
PAUSED = 1.5  # a loop turn longer than this: this process was paused or starved
RETRY = 0.5  # between a client's connection attempts
MAX_PENDING = 64  # connections without a hello held at once, besides one per node
MAX_OUT = 1 << 20  # bytes queued for a peer that does not read: beyond this its connection is closed
LEAVE_WAIT = 2.0  # how long a client's last message may take to leave

StopRequest = Callable[[float, str], Optional[bool]]  # False: it did not stop the workers (a stop was in force)


class Extension(Protocol):
    """What another part of the launcher adds to the watch (hang detection): fields for every heartbeat,
    and the messages the watch itself does not handle. Both run on the watch's loop thread: no blocking."""

    def beat(self) -> dict: ...

    def on_message(self, node: int, host: str, message: dict) -> None: ...


class Coordination(Protocol):
    """What restarts add to the watch (:mod:`launcher.jobwatch.restarts`): the messages of :attr:`kinds`, what a
    (re)joining peer must hear, and a turn of the loop. Everything but ``end_generation`` runs on the loop thread."""

    kinds: frozenset[str]
    decisions: dict[int, dict]
    policy: Optional[Callable[[int, list[dict], Optional[float]], dict]]

    def end_generation(self, end: dict, timeout: float) -> Optional[dict]: ...

    def attached(self, request: StopRequest) -> None: ...

    def on_message(self, node: int, message: dict) -> None: ...

    def rejoined(self) -> list[dict]: ...

    def joined(self) -> list[dict]: ...

    def tick(self) -> list[dict]: ...


class Event(NamedTuple):
    """A host that ended badly: it failed (``failed``) or went silent (``lost``)."""

    kind: str
    node: int
    host: str
    code: int
    report: str  # the first lines of its report; for a loss "algo-2 lost: no heartbeat for 30 s"
    primary: bool
    at: float = 0.0  # this host's clock (monotonic): when the event was heard; for a loss, when the host was last heard


class _Junk(Exception):
    """A line that is not a valid message of this job (its text says why)."""


def report_head(report: str) -> str:
    """The first lines of a failure report: who failed, how, and the exception line."""
    return "\n".join(report.splitlines()[:REPORT_LINES])[:REPORT_CHARS]


def _text(value: object, limit: int = REPORT_CHARS) -> str:
    return str(value)[:limit]


def _nonce() -> str:
    return os.urandom(12).hex()


class _Conn:
    """One connection: its buffers, who is at the other end, its nonces and message numbers."""

    def __init__(self, sock: socket.socket, now: float, addr: str = "", port: int = 0) -> None:
        self.sock, self.addr, self.port = sock, addr, port
        self.inbuf = b""
        self.out = bytearray()
        self.opened = now
        self.node: Optional[int] = None  # the peer's node, once handshaken
        self.host = ""
        self.hub_nonce = ""
        self.client_nonce = ""
        self.sent = self.received = 0  # message numbers (tagged messages)
        self.connecting = False  # a client's non-blocking connect in progress
        self.hello_sent = False
        self.ended = False  # the peer said done or failed: its closing or silence is no loss
        self.complained = False  # a dropped message of this peer was logged
        self.mask = selectors.EVENT_READ


def stamp(message: dict, key: str) -> Optional[float]:
    """A finite number of seconds at ``message[key]`` (a clock's stamp, ``w`` or ``a``); None when absent or bad."""
    value = message.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class Watch:
    """What hub and client share: the loop thread, framing, events, the stop hook. Use :func:`start`."""

    role = ""

    def __init__(self, node: int, host: str, nnodes: int, timeout: float, log: Callable[[str], None],
                 job: str = "", secret: Optional[bytes] = None) -> None:
        self.node, self.host, self.nnodes, self.timeout, self.log = node, host, nnodes, timeout, log
        self.job, self.secret = job, secret
        self.interval = min(HEARTBEAT, timeout / 3)
        self.suspect_after = min(SUSPECT_AFTER, timeout / 2)
        self.events: list[Event] = []
        self.cond = threading.Condition()
        self.selector = selectors.DefaultSelector()
        self.conns: dict[socket.socket, _Conn] = {}
        self.closing = False
        self.stopped_job = False  # this watch asked supervise to stop the workers
        self.off = ""  # why this host runs without the watch (a client that never found its hub)
        self._request: Optional[StopRequest] = None
        self._sent = 0.0
        self.training: Optional[frozenset[int]] = None  # the nodes that train, when not all do
        self.training_ended = False  # this host was told the training world has ended (``end``)
        self._said: set[str] = set()
        self._wake_r, self._wake_w = socket.socketpair()  # the main thread wakes the loop with a byte
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.extension: Optional[Extension] = None  # hang detection's messages (launcher/hangwatch.py)
        self._outbox: list[dict] = []
        self.stop_at: Optional[float] = None  # when this host was ordered to stop its workers (monotonic)
        self.coordination: Optional[Coordination] = None  # restarts (launcher/jobwatch/restarts.py)
        self.thread = threading.Thread(target=self._loop, name="job-watch", daemon=True)

    # -- the main thread's side --
    def post(self, message: dict) -> None:
        """Send a message from any thread: the hub to every client, a client to the hub (see :class:`Extension`)."""
        with self.cond:
            self._outbox.append(message)
        self.wake()

    def wake(self) -> None:
        """Make the loop take a turn now (it reads what the main thread left for it)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def attach(self, request: Optional[StopRequest]) -> None:
        """Called by supervise with its stop hook (None when it returns); stops at once if a cause is known."""
        with self.cond:
            self._request = request
            pending = bool(self.events) and request is not None
        if pending:
            self._stop()
        if request is not None and self.coordination is not None and not pending:
            self.coordination.attached(request)
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

    def end_generation(self, end: dict, timeout: float) -> Optional[dict]:
        """Tell node 0 how this host's generation ended (``end``: :meth:`launcher.restart.End.message`) and
        wait (at most ``timeout``) for its decision, the same on every host; None when a loss or a final
        failure came first, no decision in time, or this watch carries no restarts. A restart moves this watch
        to the next generation (:mod:`launcher.jobwatch.restarts`)."""
        return None if self.coordination is None else self.coordination.end_generation(end, timeout)

    @property
    def decisions(self) -> dict[int, dict]:
        """Node 0's decision at the end of each generation (empty without restarts)."""
        return {} if self.coordination is None else self.coordination.decisions

    @property
    def policy(self) -> Optional[Callable[[int, list[dict], Optional[float]], dict]]:
        """Node 0's rules for restarts (:mod:`launcher.restart`); None: no decision is made."""
        return None if self.coordination is None else self.coordination.policy

    def set_policy(self, rules: Optional[Callable[[int, list[dict], Optional[float]], dict]]) -> None:
        """Give node 0 its rules for restarts (:attr:`policy`)."""
        if self.coordination is not None:
            self.coordination.policy = rules

    def new_generation(self) -> None:
        """A restart starts the next generation: this watch has stopped none of its workers yet."""
        self.stopped_job = False
        self.stop_at = None

    def add_extension(self, extension: Extension) -> None:
        """Carry ``extension``'s messages and heartbeat fields (hang detection: :mod:`launcher.hangwatch`)."""
        self.extension = extension

    @property
    def stop_hook(self) -> Optional[StopRequest]:
        """Supervise's stop hook while it runs (:meth:`attach`)."""
        return self._request

    def members(self) -> int:
        """The nodes whose ends node 0 waits for: every node (the hub: itself and every node that joined it; a
        host whose launcher never reached the hub runs without the watch)."""
        return self.nnodes

    def _clock(self) -> dict:
        """What a beat carries for node 0's :meth:`clock_offset`: this clock (``w``)."""
        return {"w": round(time.time(), 6)}

    def clock_offset(self, node: int) -> float:
        """What to add to ``node``'s ``time.time()`` to place it on this host's clock (node 0 measures it:
        :meth:`launcher.jobwatch.hub.Hub.clock_offset`; a client compares no clocks)."""
        return 0.0

    def connected(self) -> bool:
        """True while a handshaken peer is connected."""
        return any(c.node is not None for c in list(self.conns.values()))

    def finish(self, code: int, head: str, primary: bool) -> Optional[Event]:
        """Tell the others how this host ended (``head``: the first lines of its report, empty on success);
        returns the job's root cause seen by then (the verdict is :mod:`launcher.report`'s).

        ``primary`` False when this host's failure is not the root cause (:func:`launcher.report.is_primary`):
        then the watch waits (at most the loss timeout + 1 s) for that cause.
        """
        if code != 0 and not primary:
            self.wait_for_cause(self.timeout + 1.0)
        cause = self.cause()
        if code == 0:
            self._leave(messages.Done(self.node, self.host).encode(), code)
            return cause
        mine = Event("failed", self.node, self.host, code, report_head(head), primary)
        self._leave(_as_message(mine), code)
        return cause

    def close(self) -> None:
        """End the loop thread and close every socket."""
        with self.cond:
            self.closing = True
        self.wake()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        for sock in list(self.conns):
            sock.close()
        self.conns.clear()
        self.selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the loop thread --
    def _once(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.log(line)

    def _stop(self) -> None:
        cause = self.cause()
        with self.cond:
            request = self._request
        if request is None or cause is None:
            return
        self.stop_workers(request, f"job watch: {cause.report.splitlines()[0]}: stopping the workers here "
                                   f"(grace period at most {REMOTE_GRACE:g} s)")

    def stop_workers(self, request: StopRequest, why: str) -> None:
        """Stop this host's workers through ``request`` (supervise's), as this watch's doing (``stopped_job``:
        the host's failure is then a consequence of another's). Marked before the signal goes, so that the verdict
        never misses it; taken back when the request stopped nothing: a stop in force already (the platform's
        SIGTERM came first, and another host failed because of it) or torchrun ended stays this host's own."""
        before = (self.stopped_job, self.stop_at)
        self.stopped_job, self.stop_at = True, time.monotonic()
        if request(REMOTE_GRACE, why) is False and not before[0]:
            self.stopped_job, self.stop_at = before

    def _record(self, event: Event) -> None:
        with self.cond:
            if any(e.node == event.node for e in self.events):
                return
            self.events.append(event)
            self.cond.notify_all()
        self.log(f"job watch: {event.report.splitlines()[0]}")
        self._stop()

    def _context(self, conn: _Conn, role: str) -> bytes:
        return f"{self.job}\n{conn.hub_nonce}\n{conn.client_nonce}\n{role}\n".encode()

    def _tag(self, conn: _Conn, role: str, body: bytes) -> str:
        assert self.secret is not None
        return hmac.new(self.secret, self._context(conn, role) + body, hashlib.sha256).hexdigest()

    def _send(self, conn: _Conn, message: dict, tagged: bool = True) -> None:
        """Queue a message (tagged when a secret is set) and write what the socket takes now."""
        if self.secret is not None and tagged:
            conn.sent += 1
            body = json.dumps({**message, "n": conn.sent}, separators=(",", ":")).encode()
            line = self._tag(conn, self.role, body).encode() + b" " + body + b"\n"
        else:
            line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        conn.out += line
        if len(conn.out) > MAX_OUT:
            self._drop(conn)  # it has not read for a very long time: its silence decides
            return
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.connecting or conn.sock not in self.conns:
            return
        try:
            while conn.out:
                sent = conn.sock.send(conn.out)
                del conn.out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            conn.out.clear()  # the read side sees the end
        self._want(conn, selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0))

    def _want(self, conn: _Conn, mask: int) -> None:
        if mask != conn.mask and conn.sock in self.conns:
            conn.mask = mask
            self.selector.modify(conn.sock, mask, conn)

    def _register(self, conn: _Conn) -> None:
        self.conns[conn.sock] = conn
        self.selector.register(conn.sock, conn.mask, conn)

    def _drop(self, conn: _Conn) -> None:
        self.conns.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(conn.sock)
        conn.sock.close()

    def _parse(self, conn: _Conn, line: bytes, sender: str) -> dict:
        """One line as a message; raises _Junk. With a secret, the tag and the number are checked."""
        tagged = self.secret is not None and not (sender == "hub" and not conn.hub_nonce)
        tag, body = line.split(b" ", 1) if tagged and b" " in line else (b"", line)
        try:
            message = json.loads(body)
        except (ValueError, RecursionError):
            raise _Junk("garbage") from None
        if not isinstance(message, dict) or not isinstance(message.get("t"), str):
            raise _Junk("garbage")
        if not tagged:
            return message
        if sender == "client" and conn.node is None and message.get("job") != self.job:
            return message  # another job's hello (its tag is no concern of ours): refused as such
        if sender == "client" and conn.node is None:  # a hello: its nonce is part of what it signs
            conn.client_nonce = _text(message.get("nonce", ""), 64)
        if not hmac.compare_digest(tag, self._tag(conn, sender, body).encode()):
            raise _Junk("no valid tag")
        number = message.get("n")
        if not isinstance(number, int) or number <= conn.received:
            raise _Junk("a replayed message")
        conn.received = number
        return message

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._closed(conn, f"connection {'reset' if exc.errno == errno.ECONNRESET else 'closed'}")
            return
        if not data:
            self._closed(conn, "connection closed")
            return
        conn.inbuf += data
        *complete, conn.inbuf = conn.inbuf.split(b"\n")
        if len(conn.inbuf) > MAX_LINE:
            self._junk(conn, "a line over the size limit", fatal=True)
            return
        sender = "client" if self.role == "hub" else "hub"
        for line in complete:
            if conn.sock not in self.conns:
                return
            if not line.strip():
                continue
            try:
                if len(line) > MAX_LINE:
                    raise _Junk("a line over the size limit")
                message = self._parse(conn, line, sender)
                self._on_message(conn, message)
            except _Junk as exc:
                self._junk(conn, str(exc), fatal=conn.node is None)
            except (KeyError, TypeError, ValueError, ArithmeticError):
                self._junk(conn, "a malformed message", fatal=conn.node is None)

    def _junk(self, conn: _Conn, why: str, fatal: bool) -> None:
        """A bad line: before the handshake the connection is refused; after it the line is dropped."""
        if conn.node is None:
            self._refused(conn, why)
            return
        if not conn.complained:
            conn.complained = True
            self.log(f"job watch: dropped a message from {conn.host} ({why}); the job goes on")
        if fatal:
            self._drop(conn)

    def _loop(self) -> None:
        last = time.monotonic()
        while True:
            with self.cond:
                if self.closing:
                    return
            # Taken before reading: a process paused between a read and this check (SIGSTOP) reads
            # what came meanwhile before it can judge anyone silent.
            now = time.monotonic()
            try:
                ready = self.selector.select(timeout=0.1)
            except (OSError, ValueError):
                ready = []
            for key, mask in ready:
                if key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                if key.data is None:
                    self._accept()
                    continue
                conn = key.data
                if mask & selectors.EVENT_WRITE:
                    self._writable(conn)
                if mask & selectors.EVENT_READ and conn.sock in self.conns and not conn.connecting:
                    self._read(conn)
            if now - last > PAUSED:  # this process was paused or starved: no evidence against anyone
                self._credit(now)
            last = now
            self._judge(now)
            with self.cond:
                outbox, self._outbox = self._outbox, []
            for message in outbox:
                self._post(message)
            if now - self._sent >= self.interval:
                self._sent = now
                beat = {"t": "hb", **(self.extension.beat() if self.extension is not None else {}),
                        **self._clock()}
                for conn in list(self.conns.values()):
                    if conn.node is not None:
                        self._send(conn, beat)
            self._tick(now)

    def _writable(self, conn: _Conn) -> None:
        self._flush(conn)

    def _accept(self) -> None:
        raise NotImplementedError

    def _on_message(self, conn: _Conn, message: dict) -> None:
        raise NotImplementedError

    def _closed(self, conn: _Conn, why: str) -> None:
        raise NotImplementedError

    def _refused(self, conn: _Conn, why: str) -> None:
        raise NotImplementedError

    def _credit(self, now: float) -> None:
        raise NotImplementedError

    def _judge(self, now: float) -> None:
        raise NotImplementedError

    def _tick(self, now: float) -> None:
        """Once per loop turn: what a role does besides reading and heartbeats."""

    def _post(self, message: dict) -> None:
        raise NotImplementedError

    def post_now(self, message: dict, skip: Optional[int] = None) -> None:
        """Send from the loop thread: the hub to every client but ``skip``, a client to the hub."""
        self._post(message)

    def _leave(self, message: dict, code: int) -> None:
        raise NotImplementedError


def _event(message: dict, nnodes: int) -> Event:
    """A ``failed`` or ``lost`` message as an Event; raises on a malformed one."""
    node = int(message["node"])
    if not 0 <= node < nnodes:
        raise ValueError("node out of range")
    if message["t"] == "lost":
        host = _text(message["host"], 100)
        return Event("lost", node, host, LOST_CODE, f"{host} lost: {_text(message['why'], 100)}", False,
                     time.monotonic())
    code = int(message["code"])
    return Event("failed", node, _text(message["host"], 100), code if 0 < code < 256 else 1,
                 _text(message["report"]), bool(message["primary"]), time.monotonic())


def _as_message(event: Event) -> dict:
    if event.kind == "lost":
        return messages.Lost(event.node, event.host, event.report.split(" lost: ", 1)[-1]).encode()
    return messages.Failed(event.node, event.host, event.code, event.report, event.primary).encode()

