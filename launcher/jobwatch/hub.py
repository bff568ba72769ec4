"""Node 0's side of the job watch: accepts the other launchers, relays failures and losses, decides restarts."""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import time
from typing import Optional

from launcher.jobwatch import messages
from launcher.jobwatch.watch import (
    HANDSHAKE_TIMEOUT,
    LOST_CODE,
    MAX_PENDING,
    REMOTE_GRACE,
    Event,
    Watch,
    _as_message,
    _Conn,
    _event,
    _Junk,
    _nonce,
    _text,
    stamp,
)


class _Node:
    """What the hub knows of one client node: its state, its current connection, when it was heard."""

    def __init__(self, host: str, now: float) -> None:
        self.host = host
        self.state = "running"  # running, done, failed, lost
        self.conn: Optional[_Conn] = None
        self.heard = now
        self.suspect = False
        self.behind = float("inf")  # the least (this clock's time.time() on reading - the client's ``w``) seen
        self.ahead = float("inf")  # the least (the client's time.time() on reading - this clock's ``w``) it saw


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
        self.relayed: set[str] = set()  # "any", "primary": the kinds of cause the clients have been told

    @property
    def states(self) -> dict[int, str]:
        """node -> running, done, failed or lost: every node that joined."""
        return {node: n.state for node, n in list(self.nodes.items())}

    def clock_offset(self, node: int) -> float:
        """What to add to ``node``'s ``time.time()`` to place it on this clock.

        Both sides stamp their beats with their clock (``w``); a client also sends ``a``, the least (its clock
        on reading - node 0's ``w``) it has seen. No message arrives before it was sent, so the client's clock
        is ahead of this one by at least ``-behind`` and at most ``ahead`` (``behind``: the least (this clock on
        reading - its ``w``)), whatever the load: a starved sender or reader only widens the interval. When the
        interval holds 0 (one machine, NTP-synchronised hosts) the clocks are taken as the same: one clock
        orders failures milliseconds apart exactly, and a guess would not. Otherwise the clocks certainly
        differ, by at least the interval's end nearest 0, and that is the correction."""
        known = self.nodes.get(node)
        if known is None:
            return 0.0
        if known.behind < 0.0:  # its clock is ahead by more than -behind
            return known.behind
        if known.ahead < 0.0:  # its clock is behind by more than -ahead
            return -known.ahead
        return 0.0

    def members(self) -> int:
        """Itself and every node that joined (see :meth:`launcher.jobwatch.Watch.members`)."""
        return 1 + len(self.nodes)

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
            self._send(conn, messages.Greeting(conn.hub_nonce).encode(), tagged=False)

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
                conn.sock.send(messages.encode(messages.Refused("another job")) + b"\n")
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
        for missed in self.coordination.rejoined() if self.coordination is not None else ():
            self._send(conn, missed)  # a reconnection: what it may have missed of the restarts

    def _on_message(self, conn: _Conn, message: dict) -> None:
        if conn.node is None:
            self._hello(conn, message)
            return
        known = self.nodes[conn.node]
        if known.conn is not conn:
            return
        self._heard(conn.node, known)
        sent, seen = stamp(message, "w"), stamp(message, "a")
        if sent is not None:
            known.behind = min(known.behind, time.time() - sent)
        if seen is not None:
            known.ahead = min(known.ahead, seen)
        kind = message["t"]
        if kind == "failed" and known.state == "running":
            event = _event({**message, "node": conn.node, "host": known.host}, self.nnodes)
            conn.ended, known.state = True, "failed"
            self._relay(_as_message(event), skip=conn.node)
            self._record(event)
        elif kind == "done" and known.state == "running":
            conn.ended, known.state = True, "done"
        elif self.coordination is not None and kind in self.coordination.kinds:
            if known.state == "running":
                self.coordination.on_message(conn.node, message)
        elif self.extension is not None:
            self.extension.on_message(conn.node, known.host, message)

    def _post(self, message: dict) -> None:
        self._broadcast(message)

    def post_now(self, message: dict, skip: Optional[int] = None) -> None:
        """Send from the loop thread to every client but ``skip``."""
        self._broadcast(message, skip)

    def _heard(self, node: int, known: _Node) -> None:
        now = time.monotonic()
        if known.suspect:
            known.suspect = False
            self.log(f"job watch: {known.host} heard again after {now - known.heard:.1f} s of silence")
        known.heard = now

    def _lose(self, node: int, known: _Node, why: str) -> None:
        known.state = "lost"
        event = Event("lost", node, known.host, LOST_CODE, f"{known.host} lost: {why}", False, known.heard)
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
        if self.coordination is not None:
            self.coordination.tick()
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

