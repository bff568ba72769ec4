"""The launchers of one job watch each other: a failed or lost host stops the job everywhere.

Roles. Node 0's launcher runs a hub, bound on every interface; every other launcher connects to the
master address, retrying while its job runs (at most the rendezvous timeout), and reconnects with the
same identity when its connection breaks without a definite end. A failure or loss anywhere is
relayed by the hub to every host: every loss, and of the failures those that can change a host's root
cause (the first, the first primary one); the ends that follow, each host stopped because of the
first, are the hub's to log, not N-1 more messages to each of N-1 hosts.

Ports. By default the watch listens on the first free port of a short list derived from the job's
identity, in 61000-65499: above Linux's ephemeral ports (32768-60999) and far from every rendezvous
port rule (SLURM/PBS 20000-29999, torchrun's 29500 and the ``MASTER_PORT=29501`` habit), so it is never
the rendezvous port of a neighbouring job. Clients try the same list in order and accept only a hub
that answers with this job's identity: every host reaches the same hub, or none (then every host logs
that it runs without the watch, and a failure report says so). ``--watch-port`` gives one port.

Protocol: newline-delimited JSON objects, each line at most :data:`MAX_LINE` bytes.

- ``watch`` {nonce}: the hub's first line on every connection (a fresh random nonce);
- ``hello`` {job, node, host, nnodes, nonce}: a client's first line; ``job`` is the job's identity
  (:func:`launcher.command.job_identity`: the platform's job name, the rendezvous endpoint and the node count, which
  every host knows). The hub answers a hello of this job with its own ``hello``, then every event it
  has relayed so far; a hello of another job gets ``refused`` and the connection is closed (logged
  once; neither job is affected). The newest accepted hello of a node replaces its older connection
  (which is told ``replaced``): a reconnection, no loss;
- ``hb``: a heartbeat, every second both ways;
- ``failed`` {node, host, code, report, primary}: that host's workers failed; ``report`` is the first
  lines of its failure report, ``primary`` False when its failure looks caused by another host (a
  collective whose peer went away, a broken rendezvous);
- ``done`` {node, host}: that host's workers all succeeded (it may leave);
- ``lost`` {node, host, why}: the hub lost that host (also sent to the lost host, best effort);
- ``gen_end`` {gen, node, host, code, klass, key, head, primary, progress, stopped, age, watched, steps}: with
  restarts (:mod:`launcher.restart`), this host's torchrun of generation ``gen`` has ended, all its workers
  gone; ``age``: seconds since its first worker failed;
- ``gen_stop`` {gen, report}: the hub's order to stop the workers of generation ``gen`` (the first host that
  failed in it; the ones after it send no second order);
- ``gen`` {generation, restart, why, used, cause, cause_age}: node 0's decision at the end of a generation,
  the same for every host: restart (every host starts generation + 1) or end the job; ``cause_age``: how
  many seconds before the decision the root cause's failure was (node 0 stamps each ``gen_end`` on its own
  clock: arrival less the ``age`` the host sent);
- ``end``: in a job where only some hosts train (:mod:`launcher.groups`), every training host is
  done: the others stop their script with SIGTERM and their configured grace period, which is no failure.
- ``hang`` {phase, ...}: hang detection's own messages (:mod:`launcher.hangwatch`, attached as the
  watch's :class:`Extension`): the hub's ``freeze``, ``dump`` and ``verdict`` {text}, a client's
  ``frozen`` and ``stacks`` {ranks, groups, why}; a client's ``hb`` carries ``age``, how long ago its ranks
  were last heard.

Authentication (optional): with a shared secret (``LAUNCHER_JOB_SECRET``, or ``--job-secret-file``),
every line after ``watch`` is ``<hex HMAC-SHA256> <json>``, the tag over the job's identity, both
nonces of the connection, the sender's role and the message, which carries a number that must grow:
a message from another job, another connection or a replay has no valid tag. A message without a
valid tag is dropped and logged once; it never stops the job. Without a secret, anyone who can reach
the port and knows the job's identity can stop the job, the same exposure as torchrun's TCPStore.

Failure detector. A definite end is a loss at once: a handshaken connection closed or reset without
``done`` or ``failed``. Silence only makes a host suspect (logged once, after :data:`SUSPECT_AFTER`
s); hearing it again clears it (logged); a host silent for the loss timeout (default
:data:`LOSS_TIMEOUT` s) is lost. The default survives a 10 s link outage plus TCP's retransmission
backoff, a 10 s SIGSTOP of a launcher, a 5 s VM pause and 10 s of CPU starvation, and stays below
Kubernetes' 40 s node-lost time; torch's c10d counts 15 s, which TCP backoff after a 10 s outage
exceeds. A launcher that finds itself paused or starved (a turn of its loop took over
:data:`PAUSED` s) restarts every silence clock: its own pause is no evidence against the others.
Junk never stops a job and never grows memory: a connection without a hello in
:data:`HANDSHAKE_TIMEOUT` s is closed, at most ``MAX_PENDING + nnodes`` such connections are held (the
oldest is dropped for a newer one), lines and send buffers are bounded, and a bad message from a
handshaken peer is dropped.

Any failure or loss elsewhere stops this host's workers at once (the stop path of
:mod:`launcher.supervise` with a grace period of at most :data:`REMOTE_GRACE` s: once a peer is gone
no collective-consistent checkpoint is possible, and a worker blocked in a collective never runs its
Python SIGTERM handler, so a longer grace period only delays the end). The job's root cause, which
every host's report starts with and whose exit code every host exits with, is the first failure that
is not a consequence of another (``primary``), else the first loss or failure seen; this module hands
it over as an :class:`Event` and :mod:`launcher.report` makes the verdict. A lost host counts
as killed by SIGKILL (exit code 137): from outside, power loss, a preempted VM and a dead network look
the same, and 137 is what platforms' retry policies already treat as "the machine went away".
After its own workers succeeded the hub relays for the others at most the loss timeout more.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Protocol, Union

from launcher import codes, restart
from launcher.command import address_of, job_identity, master_port, watch_ports
from launcher.groups import training_nodes, watch_place

if TYPE_CHECKING:
    from launcher.cluster import Cluster
    from launcher.options import Options

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

StopRequest = Callable[[float, str], None]


class Extension(Protocol):
    """What another part of the launcher adds to the watch (hang detection): fields for every heartbeat,
    and the messages the watch itself does not handle. Both run on the watch's loop thread: no blocking."""

    def beat(self) -> dict: ...

    def on_message(self, node: int, host: str, message: dict) -> None: ...


class Event(NamedTuple):
    """A host that ended badly: it failed (``failed``) or went silent (``lost``)."""

    kind: str
    node: int
    host: str
    code: int
    report: str  # the first lines of its report; for a loss "algo-2 lost: no heartbeat for 30 s"
    primary: bool


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
        # Restarts (launcher/restart.py): the generation this host runs, what node 0 decided at the end of
        # each, the latest generation whose workers were ordered to stop, and this host's end of the current one.
        self.generation = 0
        self.decisions: dict[int, dict] = {}
        self.stop_gen = -1
        self.stop_at: Optional[float] = None  # when this host was ordered to stop its workers (monotonic)
        self.my_end: Optional[dict] = None
        self.policy: Optional[Callable[[int, list[dict], bool], dict]] = None  # node 0's rules (launcher/restart.py)
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
        if request is not None and self.stop_gen == self.generation and not pending:
            self.stopped_job = True
            self.stop_at = time.monotonic()
            request(REMOTE_GRACE, f"job watch: generation {self.generation} failed on another host: stopping the "
                                  "workers here")
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
        failure came first, or no decision in time. A restart moves this watch to the next generation."""
        with self.cond:
            gen = self.generation
            self.my_end = {"t": "gen_end", "gen": gen, **end}
        self.wake()
        deadline = time.monotonic() + timeout
        with self.cond:
            while gen not in self.decisions and not self.events and time.monotonic() < deadline:
                self.cond.wait(max(0.0, min(0.1, deadline - time.monotonic())))
            return self.decisions.get(gen)

    def _gen_stop(self, gen: int, head: str) -> None:
        """Generation ``gen`` failed somewhere: stop this host's workers of it (now, or when they start)."""
        with self.cond:
            if gen <= self.stop_gen or gen < self.generation:
                return
            self.stop_gen = gen
            request = self._request if gen == self.generation else None
        if request is not None:
            self.stopped_job = True
            self.stop_at = time.monotonic()
            request(REMOTE_GRACE, f"job watch: {head.splitlines()[0] if head else 'another host failed'}: stopping "
                                  f"the workers of generation {gen} here (grace period at most {REMOTE_GRACE:g} s)")

    def _decided(self, message: dict) -> None:
        """Node 0's decision at the end of a generation: remembered; a restart moves on to the next one."""
        gen = int(message["generation"])
        with self.cond:
            if gen in self.decisions or gen != self.generation:
                return
            self.decisions[gen] = {**message, "heard": time.monotonic()}
            if message.get("restart"):
                self.generation, self.my_end = gen + 1, None
            self.cond.notify_all()

    def connected(self) -> bool:
        """True while a handshaken peer is connected."""
        return any(c.node is not None for c in list(self.conns.values()))

    def finish(self, code: int, head: str, primary: bool) -> Optional[Event]:
        """Tell the others how this host ended (``head``: the first lines of its report, empty on success);
        returns the job's root cause seen by then (the verdict is :mod:`launcher.report`'s).

        ``primary`` False when this host's failure looks caused by another host: then the watch waits
        (at most the loss timeout + 1 s) for that cause.
        """
        if code != 0 and not primary:
            self.wait_for_cause(self.timeout + 1.0)
        cause = self.cause()
        if code == 0:
            self._leave({"t": "done", "node": self.node, "host": self.host}, code)
            return cause
        mine = Event("failed", self.node, self.host, code, report_head(head), primary)
        self._leave({"t": "failed", **mine._asdict()}, code)
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
        self.stopped_job = True
        self.stop_at = time.monotonic()
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
                beat = {"t": "hb", **(self.extension.beat() if self.extension is not None else {})}
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


def _as_message(event: Event) -> dict:
    if event.kind == "lost":
        return {"t": "lost", "node": event.node, "host": event.host, "why": event.report.split(" lost: ", 1)[-1]}
    return {"t": "failed", **event._asdict()}


def _raise_file_limit(need: int) -> None:
    """Raise the soft limit of open files toward the hard one when it is below ``need``."""
    try:
        import resource
    except ImportError:  # not on this system: the default limit it is
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class _Node:
    """What the hub knows of one client node: its state, its current connection, when it was heard."""

    def __init__(self, host: str, now: float) -> None:
        self.host = host
        self.state = "running"  # running, done, failed, lost
        self.conn: Optional[_Conn] = None
        self.heard = now
        self.suspect = False


class Hub(Watch):
    """Node 0: accepts the other launchers, relays failures and losses, outlives the job's end."""

    role = "hub"

    def __init__(self, listener: socket.socket, port: int, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.listener, self.port = listener, port
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.nodes: dict[int, _Node] = {}
        self.own: Optional[dict] = None  # this host's end, to tell the clients (and late joiners)
        self.told = False
        self.end_sent = False  # ``end`` was broadcast: every training node is done
        self.max_pending = MAX_PENDING + self.nnodes
        self.gen_ends: dict[int, dict[int, dict]] = {}  # restarts: every node's end of each generation
        self.relayed: set[str] = set()  # "any", "primary": the kinds of cause the clients have been told

    @property
    def states(self) -> dict[int, str]:
        """node -> running, done, failed or lost: every node that joined."""
        return {node: n.state for node, n in list(self.nodes.items())}

    def close(self) -> None:
        """End the loop thread, close every socket and stop listening."""
        super().close()
        self.listener.close()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: the oldest stranger makes room
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._drop_oldest_pending():
                    continue
                return
            pending = [c for c in self.conns.values() if c.node is None]
            if len(pending) >= self.max_pending:
                self._once("flood", f"job watch: more than {self.max_pending} connections without a hello; "
                                    "dropping the oldest (the job goes on)")
                self._drop_oldest_pending()
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic(), str(addr[0]).removeprefix("::ffff:") if addr else "")
            conn.hub_nonce = _nonce()
            self._register(conn)
            self._send(conn, {"t": "watch", "nonce": conn.hub_nonce}, tagged=False)

    def _drop(self, conn: _Conn) -> None:
        super()._drop(conn)
        known = self.nodes.get(conn.node) if conn.node is not None else None
        if known is not None and known.conn is conn:
            known.conn = None  # no loss: the node may reconnect before its silence decides

    def _drop_oldest_pending(self) -> bool:
        pending = [c for c in self.conns.values() if c.node is None]
        if not pending:
            return False
        self._drop(min(pending, key=lambda c: c.opened))
        return True

    def _broadcast(self, message: dict, skip: Optional[int] = None) -> None:
        for node, known in list(self.nodes.items()):
            if node != skip and known.conn is not None:
                self._send(known.conn, message)

    def _relay(self, message: dict, skip: Optional[int] = None) -> None:
        """Broadcast a host's end (``failed``) if it can change a client's cause (:meth:`Watch.cause`: the first
        primary failure, else the first event): the first end, and the first primary one. After a failure every
        other host ends too, each because of it: relaying all of them would cost N² messages and N lines in
        every host's log for nothing. The hub's own log keeps each; a client joining late hears every one."""
        kinds = {"any", "primary"} if message.get("primary") else {"any"}
        if kinds <= self.relayed:
            return
        self.relayed |= kinds
        self._broadcast(message, skip)

    def _refused(self, conn: _Conn, why: str) -> None:
        self._once(f"refused {why}", f"job watch: refused a connection from {conn.addr or 'somewhere'} ({why}); "
                                     "the job is not affected")
        self._drop(conn)

    def _hello(self, conn: _Conn, message: dict) -> None:
        if message["t"] != "hello":
            raise _Junk("no hello")
        if message.get("job") != self.job:
            with contextlib.suppress(OSError):
                conn.sock.send(b'{"t":"refused","why":"another job"}\n')
            raise _Junk("a launcher of another job")
        node = int(message["node"])
        if not 0 < node < self.nnodes or int(message["nnodes"]) != self.nnodes:
            raise _Junk("not a node of this job")
        now = time.monotonic()
        known = self.nodes.get(node)
        if known is None:
            known = self.nodes[node] = _Node(_text(message["host"], 100), now)
        elif known.conn is not None:
            old = known.conn
            self._send(old, {"t": "replaced"})
            self._flush(old)
            self._drop(old)
            self.log(f"job watch: {known.host} reconnected")
        conn.node, conn.host = node, known.host
        known.conn, known.heard = conn, now
        self._send(conn, {"t": "hello", "job": self.job, "node": 0, "host": self.host, "nnodes": self.nnodes})
        for event in list(self.events):
            if event.node != node or event.kind == "lost":
                self._send(conn, _as_message(event))
        with self.cond:
            own = self.own if self.told else None
        if own is not None:
            self._send(conn, own)
        if self.end_sent and node not in (self.training or ()):
            self._send(conn, {"t": "end"})
        with self.cond:
            latest = self.decisions.get(max(self.decisions)) if self.decisions else None
            stop_gen = self.stop_gen
        if latest is not None:  # a reconnection: what it may have missed of the restarts
            self._send(conn, {"t": "gen", **latest})
        if stop_gen >= 0:
            self._send(conn, {"t": "gen_stop", "gen": stop_gen, "report": ""})

    def _on_message(self, conn: _Conn, message: dict) -> None:
        if conn.node is None:
            self._hello(conn, message)
            return
        known = self.nodes[conn.node]
        if known.conn is not conn:
            return
        self._heard(conn.node, known)
        kind = message["t"]
        if kind == "failed" and known.state == "running":
            event = _event({**message, "node": conn.node, "host": known.host}, self.nnodes)
            conn.ended, known.state = True, "failed"
            self._relay(_as_message(event), skip=conn.node)
            self._record(event)
        elif kind == "done" and known.state == "running":
            conn.ended, known.state = True, "done"
        elif kind == "gen_end" and known.state == "running":
            self._generation_end(conn.node, message)
        elif self.extension is not None:
            self.extension.on_message(conn.node, known.host, message)

    def _post(self, message: dict) -> None:
        self._broadcast(message)

    def _generation_end(self, node: int, message: dict) -> None:
        """A node's generation ended: a failure stops the generation everywhere; the last end decides."""
        gen = int(message["gen"])
        ends = self.gen_ends.setdefault(gen, {})
        if node in ends:
            return
        # raises on a malformed one; ``at``: when its first failure was, on this (node 0's) clock
        end = restart.end_of({**message, "node": node})
        ends[node] = end._replace(at=time.monotonic() - end.age).message()
        if int(message["code"]) != 0 and gen >= self.generation and gen > self.stop_gen:  # the first failure only
            self._broadcast({"t": "gen_stop", "gen": gen, "report": _text(message.get("head", ""))}, skip=node)
            self._gen_stop(gen, _text(message.get("head", "")))
        self._decide()

    def _decide(self) -> None:
        """Once every node's end of the current generation is in (or a host is lost): node 0's decision."""
        with self.cond:
            gen, policy, events = self.generation, self.policy, list(self.events)
            known = gen in self.decisions
        if known or policy is None:
            return
        ends = self.gen_ends.get(gen, {})
        lost = any(e.kind == "lost" for e in events)
        if not lost and len(ends) < self.nnodes:
            return
        decision = {"t": "gen", **policy(gen, [ends[n] for n in sorted(ends)], lost)}
        cause = decision.get("cause")
        if cause is not None:  # how long ago the root cause's failure was: each host places it on its own clock
            decision["cause_age"] = round(max(0.0, time.monotonic() - float(cause["at"])), 3)
        self._broadcast(decision)
        self._decided(decision)

    def _heard(self, node: int, known: _Node) -> None:
        now = time.monotonic()
        if known.suspect:
            known.suspect = False
            self.log(f"job watch: {known.host} heard again after {now - known.heard:.1f} s of silence")
        known.heard = now

    def _lose(self, node: int, known: _Node, why: str) -> None:
        known.state = "lost"
        event = Event("lost", node, known.host, LOST_CODE, f"{known.host} lost: {why}", False)
        self.relayed.add("any")
        self._broadcast(_as_message(event))  # the lost one too: it may hear why, if it still can
        self._record(event)

    def _closed(self, conn: _Conn, why: str) -> None:
        known = self.nodes.get(conn.node) if conn.node is not None else None
        current = known is not None and known.conn is conn
        self._drop(conn)
        if current and known is not None and known.state == "running" and not conn.ended:
            self._lose(conn.node, known, why)  # type: ignore[arg-type]

    def _credit(self, now: float) -> None:
        for known in self.nodes.values():
            known.heard = max(known.heard, now)

    def _judge(self, now: float) -> None:
        for conn in list(self.conns.values()):
            if conn.node is None and now - conn.opened > HANDSHAKE_TIMEOUT:
                self._drop(conn)
        for node, known in list(self.nodes.items()):
            if known.state != "running":
                continue
            silent = now - known.heard
            if silent > self.timeout:
                self._lose(node, known, f"no heartbeat for {self.timeout:g} s")
            elif silent > self.suspect_after and not known.suspect:
                known.suspect = True
                self.log(f"job watch: {known.host} silent for {silent:.1f} s: suspect (lost if silent for "
                         f"{self.timeout:g} s)")

    def _leave(self, message: dict, code: int) -> None:
        """Tell everyone, then keep relaying until every node that joined is done, failed or lost (bounded)."""
        with self.cond:
            self.own = message  # sent by the loop thread, which owns the sockets
        self.wake()
        deadline = time.monotonic() + (self.timeout if code == 0 else self.timeout + REMOTE_GRACE + 10)
        while any(s == "running" for s in self.states.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        if code == 0 and any(s == "running" for s in self.states.values()):
            self.log(f"job watch: the workers here succeeded {self.timeout:g} s ago; not waiting longer for "
                     "the other hosts")

    def _tick(self, now: float) -> None:
        with self.cond:
            end = self.my_end
        if end is not None and 0 not in self.gen_ends.get(int(end["gen"]), {}):
            self._generation_end(0, end)
        self._decide()
        with self.cond:
            own, send = self.own, self.own is not None and not self.told
            self.told = self.told or send
        if send and own is not None:
            if own.get("t") == "failed":
                self.relayed |= {"any", "primary"} if own.get("primary") else {"any"}
            self._broadcast(own)
        if self.training is not None and not self.end_sent and self._trainers_done(own):
            self.end_sent = True
            for node, known in list(self.nodes.items()):
                if node not in self.training and known.conn is not None:
                    self._send(known.conn, {"t": "end"})
            if self.node not in self.training:
                self._training_over()

    def _trainers_done(self, own: Optional[dict]) -> bool:
        """Every training node said ``done`` (this one too, when it trains)."""
        states = self.states
        return all((n == self.node and own is not None and own.get("t") == "done") or states.get(n) == "done"
                   for n in self.training or ())


class Client(Watch):
    """Every other node: connects to the hub, hears its relays, tells it how this host ended."""

    role = "client"

    def __init__(self, address: str, ports: Sequence[int], deadline: float, *args: object,
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.address, self.ports, self.deadline = address, tuple(ports), deadline
        self.hub: Optional[_Conn] = None  # the handshaken connection
        self.attempt: Optional[_Conn] = None  # a connection on its way to a handshake
        self.hub_host = ""
        self.port_index = 0
        self.joined = False
        self.heard = time.monotonic()
        self.suspect = False
        self.ended = False  # the hub said done, or this host left
        self.next_try = 0.0
        self.final: Optional[dict] = None
        self.left = False
        self.began = time.monotonic()
        self.end_sent: Optional[dict] = None  # this host's gen_end last sent to the hub

    def connected(self) -> bool:
        """True while the hub is connected (handshaken)."""
        return self.hub is not None

    def _accept(self) -> None:  # a client listens on nothing
        raise AssertionError

    # connecting
    def _try(self, now: float) -> None:
        port = self.ports[self.port_index % len(self.ports)]
        self.next_try = now + RETRY
        try:
            family, kind, proto, _name, addr = socket.getaddrinfo(self.address, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
        except OSError:
            return
        sock.setblocking(False)
        result = sock.connect_ex(addr)
        if result not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            self._next_port("connection refused" if result == errno.ECONNREFUSED else os.strerror(result))
            return
        conn = _Conn(sock, now, self.address, port)
        conn.connecting, conn.client_nonce = True, _nonce()
        conn.mask = selectors.EVENT_WRITE
        self.attempt = conn
        self._register(conn)

    def _next_port(self, why: str) -> None:
        """This port holds no hub of this job (yet): the next candidate, before the handshake."""
        if self.joined:
            return
        port = self.ports[self.port_index % len(self.ports)]
        if why != "connection refused":
            then = "trying the next port" if len(self.ports) > 1 else "retrying"
            self._once(f"not hub {port}", f"job watch: {self.address}:{port} is not this job's hub ({why}); {then}")
        self.port_index += 1

    def _writable(self, conn: _Conn) -> None:
        if not conn.connecting:
            self._flush(conn)
            return
        error = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            self._abandon(conn, "connection refused" if error == errno.ECONNREFUSED else os.strerror(error))
            return
        conn.connecting = False
        self._want(conn, selectors.EVENT_READ)

    def _abandon(self, conn: _Conn, why: str) -> None:
        was_attempt = conn is self.attempt
        self._drop(conn)
        if was_attempt:
            self._next_port(why)

    def _refused(self, conn: _Conn, why: str) -> None:
        self._abandon(conn, why)

    def _hub_hello(self, conn: _Conn, message: dict) -> None:
        kind = message["t"]
        if kind == "watch" and not conn.hub_nonce:
            conn.hub_nonce = _text(message["nonce"], 64)
            self._send(conn, {"t": "hello", "job": self.job, "node": self.node, "host": self.host,
                              "nnodes": self.nnodes, "nonce": conn.client_nonce})
            conn.hello_sent = True
            return
        if kind == "refused":
            raise _Junk(f"it refused: {_text(message.get('why'), 60)}")
        if kind != "hello" or message.get("job") != self.job or int(message["node"]) != 0 or \
                int(message["nnodes"]) != self.nnodes:
            raise _Junk("not this job's hub")
        conn.node, conn.host = 0, _text(message["host"], 100)
        old, self.hub, self.attempt = self.hub, conn, None
        if old is not None and old is not conn:
            super()._drop(old)
        self.hub_host = conn.host
        self._heard_hub()
        if not self.joined:
            self.joined = True
            self.log(f"job watch: connected to the hub on {conn.host} ({self.address}:{conn.port})")
        else:
            self.log(f"job watch: reconnected to the hub on {conn.host}")
        with self.cond:
            end = self.my_end
        if end is not None:  # sent again: the old connection may have lost it
            self._send(conn, end)

    def _on_message(self, conn: _Conn, message: dict) -> None:
        if conn.node is None:
            self._hub_hello(conn, message)
            return
        if conn is not self.hub:
            return
        self._heard_hub()
        kind = message["t"]
        if kind in ("failed", "lost"):
            event = _event(message, self.nnodes)
            if event.node != self.node or event.kind == "lost":
                self._record(event)
        elif kind == "done":
            self.ended = True
        elif kind == "gen_stop":
            self._gen_stop(int(message["gen"]), _text(message["report"]))
        elif kind == "gen":
            self._decided(message)
        elif kind == "end" and self.node not in (self.training or ()):
            self._training_over()
        elif kind == "replaced":  # a newer connection of this node took over (or someone claims to be it)
            self._drop(conn)
            self.next_try = 0.0
        elif self.extension is not None:
            self.extension.on_message(0, self.hub_host, message)

    def _post(self, message: dict) -> None:
        if self.hub is not None:
            self._send(self.hub, message)

    def _heard_hub(self) -> None:
        now = time.monotonic()
        if self.suspect:
            self.suspect = False
            self.log(f"job watch: the hub on {self.hub_host} heard again after {now - self.heard:.1f} s of silence")
        self.heard = now

    def _drop(self, conn: _Conn) -> None:
        super()._drop(conn)
        if conn is self.hub:
            self.hub = None
        if conn is self.attempt:
            self.attempt = None

    def _closed(self, conn: _Conn, why: str) -> None:
        was_attempt, was_hub = conn is self.attempt, conn is self.hub
        self._drop(conn)
        if was_attempt:
            if not conn.hello_sent or not self.joined:
                self._next_port(why)
            return
        if not was_hub:
            return
        if self.ended or self.left or self.events:
            return
        if self.attempt is not None and self.attempt.hello_sent:
            return  # the hub may have taken the new connection: it closes the old one
        self._record(Event("lost", 0, self.hub_host, LOST_CODE, f"{self.hub_host} lost: {why}", False))

    def _credit(self, now: float) -> None:
        self.heard = max(self.heard, now)

    def _judge(self, now: float) -> None:
        attempt = self.attempt
        if attempt is not None and not attempt.hello_sent and now - attempt.opened > ATTEMPT_TIMEOUT:
            self._abandon(attempt, "no answer")
        if not self.joined or self.ended or self.final is not None or self.events:
            return
        silent = now - self.heard
        if silent > self.timeout:
            self.ended = True
            self._record(Event("lost", 0, self.hub_host, LOST_CODE,
                               f"{self.hub_host} lost: no heartbeat for {self.timeout:g} s", False))
        elif silent > self.suspect_after and not self.suspect:
            self.suspect = True
            self.log(f"job watch: the hub on {self.hub_host} silent for {silent:.1f} s: suspect (lost if silent "
                     f"for {self.timeout:g} s); trying a new connection")

    def _tick(self, now: float) -> None:
        with self.cond:
            end = self.my_end
        if end is not None and end is not self.end_sent and self.hub is not None:
            self.end_sent = end
            self._send(self.hub, end)
        self._say_final()
        if self.attempt is not None or self.ended or self.events or now < self.next_try:
            return
        if self.final is not None and (self.hub is not None or not self.joined):
            return
        if not self.joined and now - self.began > HANDSHAKE_TIMEOUT:
            self._once("no hub yet", f"job watch: no hub of this job on {self.address} port(s) "
                                     f"{', '.join(map(str, self.ports))} yet; still looking (until the rendezvous "
                                     "timeout)")
        if not self.joined and now > self.deadline:
            if not self.off:
                self.off = (f"no hub of this job answered on {self.address} port(s) "
                            f"{', '.join(map(str, self.ports))}")
                self.log(f"job watch off: {self.off}; this host runs without the watch")
            return
        if self.hub is None or self.suspect:
            self._try(now)

    def _say_final(self) -> None:
        with self.cond:
            final = self.final
        if final is None or self.left:
            return
        hub = self.hub
        if hub is not None and final.get("sent") is None:
            final["sent"] = True
            hub.ended = True
            self._send(hub, {k: v for k, v in final.items() if k != "sent"})
        if (hub is None and not self.joined) or (hub is not None and not hub.out and final.get("sent")):
            with self.cond:
                self.left = True
                self.cond.notify_all()

    def _leave(self, message: dict, code: int) -> None:
        """Send how this host ended (bounded: :data:`LEAVE_WAIT` s); then the hub may forget it."""
        with self.cond:
            self.final = dict(message)
        self.wake()
        with self.cond:
            self.cond.wait_for(lambda: self.left or not self.thread.is_alive(), timeout=LEAVE_WAIT)
            self.left = True
        if not self.joined and not self.off:
            self.off = f"it never reached this job's hub on {self.address} port(s) {', '.join(map(str, self.ports))}"


class Off(Watch):
    """Node 0 when no candidate port was free: no watch (the clients find no hub either); a failure
    report says so."""

    def _leave(self, message: dict, code: int) -> None:
        """Nobody to tell."""


def start(node: int, host: str, nnodes: int, master: str, port: Union[int, Sequence[int]], timeout: float,
          connect_for: float, log: Callable[[str], None], job: str = "",
          secret: Optional[bytes] = None, training: Optional[frozenset[int]] = None) -> Watch:
    """Start this host's watch (hub on node 0, else client); :class:`Off` if the hub cannot listen (logged).

    ``training``: the nodes that train, when not all do (the hub sends ``end`` when they are all done).

    ``port`` is the watch port, or the candidate ports in order (the hub listens on the first free
    one, clients look for this job's hub on each); ``job`` the job's identity (:func:`launcher.command.job_identity`),
    ``secret`` the shared secret that tags every message (None: none).
    """
    ports = (port,) if isinstance(port, int) else tuple(port)
    watch: Watch
    if node == 0:
        _raise_file_limit(2 * nnodes + MAX_PENDING + 64)
        problems = []
        for candidate in ports:
            try:
                listener = _listen(candidate, nnodes + MAX_PENDING)
            except OSError as exc:
                problems.append(f"{candidate}: {os.strerror(exc.errno) if exc.errno else exc}")
                continue
            watch = Hub(listener, candidate, node, host, nnodes, timeout, log, job=job, secret=secret)
            taken = f" (taken: {'; '.join(problems)})" if problems else ""
            log(f"job watch: hub on port {candidate}{taken}")
            break
        else:
            off = Off(node, host, nnodes, timeout, log)
            off.off = f"the hub could not listen on port {'; '.join(problems)}"
            log(f"job watch off: {off.off}; the other hosts find no hub and run without the watch too")
            return off
    else:
        watch = Client(master, ports, time.monotonic() + connect_for, node, host, nnodes, timeout, log,
                       job=job, secret=secret)
    watch.training = training
    watch.thread.start()
    return watch


def _listen(port: int, backlog: int) -> socket.socket:
    backlog = max(128, backlog)
    if socket.has_dualstack_ipv6():  # every interface: the master address is one of them
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=backlog)
    return socket.create_server(("", port), backlog=backlog)


def for_cluster(cluster: Cluster, options: Options, log: Callable[[str], None],
                secret: Optional[bytes] = None) -> Watch:
    """The watch of this host's launcher (several nodes); :class:`Off` if the hub cannot listen (logged).

    Where only some hosts train, every host of the job is a node (:func:`launcher.groups.watch_place`)."""
    job = job_identity(cluster.job_name or "", cluster.master_addr or "", master_port(cluster, options),
                       cluster.nnodes)
    node, nnodes, hub = watch_place(cluster)
    return start(node, cluster.current_host, nnodes, address_of(hub, options.resolve),
                 watch_ports(cluster, options, job), options.loss_timeout, float(options.rdzv_timeout), log,
                 job=job, secret=secret, training=training_nodes(cluster))
