"""Every other node's side of the job watch: finds this job's hub, hears its relays, tells it how this host ended."""

from __future__ import annotations

import errno
import math
import os
import selectors
import socket
import time
from collections.abc import Sequence
from typing import Optional

from launcher.jobwatch.watch import (
    ATTEMPT_TIMEOUT,
    HANDSHAKE_TIMEOUT,
    LEAVE_WAIT,
    LOST_CODE,
    RETRY,
    Event,
    Watch,
    _Conn,
    _event,
    _Junk,
    _nonce,
    _text,
    stamp,
)


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
        self.ahead = float("inf")  # the least (this clock on reading - the hub's ``w``): see Hub.clock_offset
        self.final: Optional[dict] = None
        self.left = False
        self.began = time.monotonic()

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
        for again in self.coordination.joined() if self.coordination is not None else ():
            self._send(conn, again)  # the old connection may have lost it

    def _clock(self) -> dict:
        """This clock (``w``) and the least (this clock on reading - the hub's ``w``) seen (``a``)."""
        return {**super()._clock(), **({"a": round(self.ahead, 6)} if math.isfinite(self.ahead) else {})}

    def _on_message(self, conn: _Conn, message: dict) -> None:
        if conn.node is None:
            self._hub_hello(conn, message)
            return
        if conn is not self.hub:
            return
        self._heard_hub()
        sent = stamp(message, "w")
        if sent is not None:
            self.ahead = min(self.ahead, time.time() - sent)
        kind = message["t"]
        if kind in ("failed", "lost"):
            event = _event(message, self.nnodes)
            if event.node != self.node or event.kind == "lost":
                self._record(event)
        elif kind == "done":
            self.ended = True
        elif self.coordination is not None and kind in self.coordination.kinds:
            self.coordination.on_message(0, message)
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
        self._record(Event("lost", 0, self.hub_host, LOST_CODE, f"{self.hub_host} lost: {why}", False, self.heard))

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
                               f"{self.hub_host} lost: no heartbeat for {self.timeout:g} s", False, self.heard))
        elif silent > self.suspect_after and not self.suspect:
            self.suspect = True
            self.log(f"job watch: the hub on {self.hub_host} silent for {silent:.1f} s: suspect (lost if silent "
                     f"for {self.timeout:g} s); trying a new connection")

    def _tick(self, now: float) -> None:
        for message in self.coordination.tick() if self.coordination is not None else ():
            self._post(message)
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

