"""The job watch: the launchers of one job watch each other (launcher/jobwatch/).

Protocol tests run a real hub and real clients on 127.0.0.1 (threads in this process, or a client in a
subprocess paused with SIGSTOP: a silent peer). Job tests run two real launchers with torchrun (gloo,
CPU) on SageMaker trees and fault one host. Every test that starts a process proves by PID that none is
left; the in-process ones prove that their watch threads ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import threading
import time
from typing import Optional

import pytest
from conftest import PYTHON, REPO, assert_gone, free_port, is_alive, launcher_env, validate_outcome
from hypothesis import given, settings
from hypothesis import strategies as st
from test_launcher_processes import make_host, records, wait_for_records

from launcher import jobwatch, proctree, report


def finish(watch, code, text, primary):
    """How the launcher ends a watch: the wire protocol's finish, then the verdict (launcher.report)."""
    return report.job_result(watch.finish(code, text, primary), code, text, primary, watch.off)

WORKER = os.path.join(REPO, "tests", "scripts", "launcher_worker.py")
TIMEOUT = 1.5  # loss timeout of the protocol tests (heartbeats every 0.5 s, suspect after 0.75 s)
JOB = jobwatch.job_identity("job-a", "algo-1", 29500, 3)


class Recorder:
    """A log and a stop hook that remember what they were given (the watch's two outputs)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.stops: list[tuple[float, str]] = []

    def log(self, line: str) -> None:
        self.lines.append(line)

    def stop(self, grace: float, why: str) -> None:
        self.stops.append((grace, why))


def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


@pytest.fixture
def watches():
    """Start watches on one port; close every one at the end and prove their threads ended."""
    started: list[jobwatch.Watch] = []
    port = free_port()

    def make(node: int, nnodes: int = 3, connect_for: float = 30.0, timeout: float = TIMEOUT, job: str = JOB,
             secret=None) -> tuple[jobwatch.Watch, Recorder]:
        rec = Recorder()
        watch = jobwatch.start(node, f"algo-{node + 1}", nnodes, "127.0.0.1", port, timeout, connect_for, rec.log,
                               job=job, secret=secret)
        assert watch is not None, rec.lines
        watch.attach(rec.stop)
        started.append(watch)
        return watch, rec

    make.port = port
    yield make
    for watch in started:
        watch.close()
        assert not watch.thread.is_alive()
    socket.create_server(("", port)).close()  # the hub no longer listens


def joined(watch: jobwatch.Watch) -> bool:
    return watch.connected()


def test_a_failure_is_relayed_to_every_host_and_stops_it(watches):
    hub, hub_rec = watches(0)
    one, one_rec = watches(1)
    two, two_rec = watches(2)
    until(lambda: joined(one) and joined(two) and len(hub.states) == 2)
    report = "algo-3: rank 4 (local rank 0) exited with code 7\nValueError: bad batch\n  File x.py, line 3"
    code, text = finish(two, 7, report, primary=True)
    assert (code, text) == (7, report)  # the cause itself reports only itself
    for watch, rec in ((hub, hub_rec), (one, one_rec)):
        until(lambda w=watch: w.cause() is not None)
        cause = watch.cause()
        assert (cause.kind, cause.node, cause.host, cause.code) == ("failed", 2, "algo-3", 7)
        assert cause.report == "algo-3: rank 4 (local rank 0) exited with code 7\nValueError: bad batch"
        assert rec.stops and rec.stops[0][0] == jobwatch.REMOTE_GRACE
        assert "algo-3: rank 4 (local rank 0) exited with code 7" in rec.stops[0][1]
    # host 2's own workers failed because of it (a collective lost its peer): the job's cause comes first
    code, text = finish(one, 1, "algo-2: rank 2 (local rank 0) exited with code 1\nRuntimeError: Connection "
                            "closed by peer [127.0.0.1]:5", primary=False)
    assert code == 7
    assert text.splitlines()[:3] == ["algo-3: rank 4 (local rank 0) exited with code 7", "ValueError: bad batch",
                                     "then algo-2: rank 2 (local rank 0) exited with code 1"]
    code, text = finish(hub, 0, "", primary=True)  # the hub's workers had finished: it waited for the others
    assert code == 0 and hub.states == {1: "failed", 2: "failed"}


@pytest.mark.parametrize("first", ["primary", "consequence"])
def test_only_an_end_that_can_change_the_cause_is_relayed(watches, first):
    """After a failure every other host ends too, each because of it: the hub relays only the first end and
    the first primary one (a client's cause), not N-1 consequences to N-1 clients; its own log keeps each."""
    hub, hub_rec = watches(0, nnodes=5)
    clients = [watches(node, nnodes=5) for node in (1, 2, 3, 4)]
    until(lambda: all(joined(w) for w, _ in clients) and len(hub.states) == 4)

    def stopped(node: int) -> str:
        return f"algo-{node + 1}: its workers were stopped because of that"

    primary = "algo-4: rank 3 (local rank 0) exited with code 7"
    order = [(3, primary, True), (1, stopped(1), False)]
    if first == "consequence":  # a host stopped by a peer's broken collective reports before the peer
        order.reverse()
    for node, text, is_primary in [*order, (2, stopped(2), False), (4, stopped(4), False)]:
        finish(clients[node - 1][0], 7 if is_primary else 1, text, is_primary)
        until(lambda n=node: hub.states.get(n) == "failed")  # in this order at the hub too
    last, last_rec = clients[3]
    finish(hub, 1, stopped(0), False)  # always sent, after every relay before it (one TCP stream)
    until(lambda: f"job watch: {stopped(0)}" in last_rec.lines)
    cause = last.cause()
    assert (cause.node, cause.report) == (3, primary)  # the first primary failure, in either order
    heard = [line for line in last_rec.lines if line.startswith("job watch: algo-")]
    expected = [f"job watch: {text}" for i, (_, text, is_primary) in enumerate(order) if i == 0 or is_primary]
    assert heard == [*expected, f"job watch: {stopped(0)}"], last_rec.lines  # not algo-3's end, nor algo-2's
    assert {line for line in hub_rec.lines if line.startswith("job watch: algo-")} == \
        {f"job watch: {t}" for t in (primary, stopped(1), stopped(2), stopped(4))}



def test_a_generation_is_stopped_once_however_many_hosts_fail_in_it(watches):
    """Restarts: the first failing end of a generation stops it on every host; the others that fail in it
    (each because of the first) send the clients no second stop."""
    from launcher import restart

    hub, _ = watches(0, nnodes=4)
    policy = restart.Policy(1, ["worker"])
    hub.set_policy(lambda gen, ends, lost_at: policy.decide(gen, [restart.end_of(e) for e in ends], lost_at is not None,
                                                           lost_at).message())
    clients = [watches(node, nnodes=4) for node in (1, 2, 3)]
    until(lambda: all(joined(w) for w, _ in clients) and len(hub.states) == 3)
    last = clients[2][0]
    told = []
    heard = last.coordination._gen_stop  # restarts: launcher/jobwatch/restarts.py
    last.coordination._gen_stop = lambda gen, head: (told.append(gen), heard(gen, head))  # each gen_stop it gets

    def end(watch: jobwatch.Watch, node: int, code: int, primary: bool) -> threading.Thread:
        message = restart.End(node, f"algo-{node + 1}", code, "worker" if code else "success",
                              "ValueError at x.py:3" if primary else "", f"algo-{node + 1}: code {code}", primary,
                              True).message()
        thread = threading.Thread(target=watch.end_generation, args=(message, 30.0))
        thread.start()
        return thread

    threads = [end(clients[0][0], 1, 7, True)]
    until(lambda: told == [0])
    threads += [end(clients[1][0], 2, 1, False), end(last, 3, 1, False), end(hub, 0, 1, False)]
    for thread in threads:
        thread.join(timeout=30)
    assert all(0 in w.decisions and w.decisions[0]["restart"] for w in (hub, *(c for c, _ in clients)))
    assert told == [0]  # the decision came after the others' ends, on the same stream: no second stop


def read_ahead(sock: socket.socket, skew: float = 0.0) -> float:
    """Read the hub's lines until a beat: how far ahead of its ``w`` (the hub's clock when it sent it) a clock
    ``skew`` ahead of this one reads it (what a client sends as ``a``)."""
    while True:
        message = json.loads(readline(sock))
        if message.get("t") == "hb" and "w" in message:
            return time.time() + skew - float(message["w"])


def test_node_0_orders_failures_by_its_own_clock_whatever_the_hosts_clocks_say(watches):
    """Restarts: algo-2's clock runs 5 s ahead of node 0's, algo-3's 3 s behind. algo-2's worker was killed (a
    death, no record) 50 ms before algo-3's worker raised. Each host stamps its beats and its end with its own
    clock (``w``) and says how far ahead of node 0's beats it read them (``a``); node 0 bounds each clock's
    difference from both sides, corrects by it and names algo-2. Taken as they are, the clocks would name algo-3."""
    from launcher import restart

    hub, _ = watches(0, nnodes=3)
    policy = restart.Policy(0, ["worker"])
    hub.set_policy(lambda gen, ends, lost_at: policy.decide(gen, [restart.end_of(e) for e in ends], lost_at is not None,
                                                           lost_at).message())
    skews = {1: 5.0, 2: -3.0}
    clients = {node: raw_client(watches.port, node=node, nnodes=3) for node in skews}
    ahead = {node: read_ahead(sock, skews[node]) for node, sock in clients.items()}

    def send(node: int, message: dict) -> None:
        stamped = {**message, "w": time.time() + skews[node], "a": ahead[node]}
        clients[node].sendall(json.dumps(stamped).encode() + b"\n")

    for node in skews:
        send(node, {"t": "hb"})
    until(lambda: all(abs(hub.clock_offset(node) + skew) < 0.5 for node, skew in skews.items()))
    killed = time.time() - 1.0
    for node, (record, death) in ((2, (killed + 0.05, killed + 0.5)), (1, (None, killed))):
        end = restart.End(node, f"algo-{node + 1}", 1, "worker", "SIGKILL" if record is None else "OSError@x.py:3",
                          f"algo-{node + 1}: failed", True, False, age=0.5,
                          record_at=None if record is None else record + skews[node], death_at=death + skews[node])
        send(node, {"t": "gen_end", "gen": 0, **end.message()})
    ours = restart.End(0, "algo-1", 0, "success", "", "", True, True).message()
    decision = hub.end_generation(ours, 30.0)
    assert decision is not None and decision["cause"]["host"] == "algo-2", decision
    for sock in clients.values():
        sock.close()


def test_a_starved_host_on_the_same_clock_is_not_corrected(watches):
    """One clock, but algo-2's launcher was starved: every stamp it sends left 0.3 s after it was taken. The
    bounds still hold 0, so node 0 takes its times as they are and names its kill, 50 ms before node 0's own
    worker raised (a one-way guess would place the kill 0.3 s later, after node 0's worker had died)."""
    from launcher import restart

    hub, _ = watches(0, nnodes=2)
    policy = restart.Policy(0, ["worker"])
    hub.set_policy(lambda gen, ends, lost_at: policy.decide(gen, [restart.end_of(e) for e in ends], lost_at is not None,
                                                           lost_at).message())
    sock = raw_client(watches.port, node=1, nnodes=2)
    ahead = read_ahead(sock)

    def send(message: dict) -> None:
        sock.sendall(json.dumps({**message, "w": time.time() - 0.3, "a": ahead}).encode() + b"\n")

    send({"t": "hb"})
    until(lambda: hub.nodes[1].behind < 10)
    assert hub.nodes[1].behind >= 0.3 and hub.nodes[1].ahead >= 0.0 and hub.clock_offset(1) == 0.0
    killed = time.time() - 1.0
    send({"t": "gen_end", "gen": 0, **restart.End(1, "algo-2", 1, "worker", "SIGKILL", "algo-2: killed", True, False,
                                                  age=0.5, death_at=killed).message()})
    ours = restart.End(0, "algo-1", 1, "worker", "OSError@x.py:3", "algo-1: failed", True, False, age=0.5,
                       record_at=killed + 0.05, death_at=killed + 0.3).message()
    decision = hub.end_generation(ours, 30.0)
    assert decision is not None and decision["cause"]["host"] == "algo-2", decision
    sock.close()


def test_clocks_that_agree_are_taken_as_they_are(watches):
    """On one machine node 0 corrects nothing: the bounds from both directions hold 0 whatever the load."""
    hub, _ = watches(0, nnodes=2)
    client, _ = watches(1, nnodes=2)
    until(lambda: joined(client) and len(hub.states) == 1)
    until(lambda: hub.nodes[1].behind < 10 and hub.nodes[1].ahead < 10)  # a beat each way was heard
    assert hub.nodes[1].behind >= 0.0 and hub.nodes[1].ahead >= 0.0 and hub.clock_offset(1) == 0.0


NODE = os.path.join(REPO, "tests", "scripts", "watch_node.py")


def raw_client(port: int, hello: bool = True, node: int = 1, nnodes: int = 2, job: str = JOB) -> socket.socket:
    """A hand-made client: reads the hub's ``watch`` line; with ``hello`` says it (no secret)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert json.loads(readline(sock))["t"] == "watch"
    if hello:
        sock.sendall(json.dumps({"t": "hello", "job": job, "node": node, "host": f"algo-{node + 1}",
                                 "nnodes": nnodes, "nonce": "n"}).encode() + b"\n")
        assert json.loads(readline(sock))["t"] == "hello"
    return sock


def readline(sock: socket.socket) -> bytes:
    """One line, read a byte at a time (what follows stays in the socket)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            break
        line += byte
    return line


class Node:
    """One watch in a process of its own (tests/scripts/watch_node.py), its stdout read as it comes."""

    def __init__(self, node: int, nnodes: int, port: int, timeout: float, job: str = JOB, *extra: str,
                 env: Optional[dict] = None) -> None:
        self.proc = subprocess.Popen([PYTHON, NODE, str(node), str(nnodes), str(port), str(timeout), job, *extra],
                                     env=launcher_env(**(env or {})), stdout=subprocess.PIPE, text=True)
        self.said: list[dict] = []
        threading.Thread(target=lambda: self.said.extend(json.loads(line) for line in self.proc.stdout),
                         daemon=True).start()

    def first(self, key: str) -> Optional[dict]:
        return next((item for item in list(self.said) if key in item), None)

    def logs(self) -> str:
        return "\n".join(item["log"] for item in list(self.said) if "log" in item)

    def end(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(timeout=30)
        assert_gone([self.proc.pid])


@pytest.fixture
def nodes():
    started: list[Node] = []

    def make(*args, **kwargs) -> Node:
        node = Node(*args, **kwargs)
        started.append(node)
        return node

    yield make
    for node in started:
        node.end()


def test_a_paused_peer_is_suspect_then_cleared_and_a_silent_one_lost(watches, nodes):
    """A client process paused (SIGSTOP) longer than the old 3 s timeout but shorter than the loss
    timeout is only suspect; paused longer than the loss timeout it is lost, named, with 137."""
    timeout = 8.0
    hub, rec = watches(0, nnodes=2, timeout=timeout)
    client = nodes(1, 2, watches.port, timeout)
    until(lambda: hub.states == {1: "running"} and client.first("joined"), timeout=30)
    client.proc.send_signal(signal.SIGSTOP)
    time.sleep(4.0)
    client.proc.send_signal(signal.SIGCONT)
    until(lambda: any("algo-2 heard again" in line for line in rec.lines), timeout=30)
    assert hub.cause() is None and not rec.stops and client.first("stop") is None
    assert any("algo-2 silent for" in line and "suspect" in line for line in rec.lines), rec.lines
    assert "suspect" in client.logs() or client.logs() == "" or "lost" not in client.logs()
    client.proc.send_signal(signal.SIGSTOP)
    paused = time.monotonic()
    until(lambda: hub.cause() is not None, timeout=60)
    waited = time.monotonic() - paused
    assert hub.cause().report == f"algo-2 lost: no heartbeat for {timeout:g} s"
    assert hub.cause().code == jobwatch.LOST_CODE and hub.states == {1: "lost"}
    assert timeout - 1.5 <= waited <= timeout + 10, waited  # the upper margin: a loaded machine
    print(f"a silent client lost {waited:.2f} s after its pause (loss timeout {timeout:g} s)")
    client.proc.send_signal(signal.SIGCONT)  # it wakes up to hear it was lost, and stops
    until(lambda: client.first("end") is not None, timeout=30)
    assert client.first("end")["code"] == jobwatch.LOST_CODE
    assert client.first("end")["report"].startswith(f"algo-2 lost: no heartbeat for {timeout:g} s\nthen algo-2")


def test_a_killed_peer_is_lost_at_once(watches, nodes):
    hub, rec = watches(0, nnodes=2, timeout=30.0)
    client = nodes(1, 2, watches.port, 30.0)
    until(lambda: hub.states == {1: "running"}, timeout=30)
    client.proc.kill()
    killed = time.monotonic()
    until(lambda: hub.cause() is not None, timeout=30)
    waited = time.monotonic() - killed
    assert hub.cause().report in ("algo-2 lost: connection closed", "algo-2 lost: connection reset")
    assert hub.cause().code == jobwatch.LOST_CODE and rec.stops
    assert waited < 10, waited  # a definite end: not the 30 s loss timeout
    print(f"a SIGKILLed client lost {waited:.2f} s after")


def test_a_host_paused_longer_than_its_loss_timeout_does_not_lose_the_others_when_it_resumes(watches, nodes):
    """A client process paused (SIGSTOP) for longer than its own loss timeout: on waking it reads what
    came meanwhile and restarts its silence clocks instead of declaring the hub lost; the hub (a longer
    timeout) only suspected it."""
    hub, rec = watches(0, nnodes=2, timeout=30.0)
    client = nodes(1, 2, watches.port, 3.0)
    until(lambda: client.first("joined") is not None and hub.states == {1: "running"}, timeout=30)
    client.proc.send_signal(signal.SIGSTOP)
    time.sleep(6.0)
    client.proc.send_signal(signal.SIGCONT)
    until(lambda: any("algo-2 heard again" in line for line in rec.lines), timeout=30)
    time.sleep(2.0)
    assert client.first("stop") is None and "lost" not in client.logs(), client.logs()
    assert hub.cause() is None and not rec.stops


@pytest.mark.parametrize("garbage", [b"not json\n", b"[1, 2]\n", b'{"t": "failed", "code": "x"}\n',
                                     b"[" * 3000 + b"\n", b'{"t":"failed","code":1e400,"report":"","primary":true}\n',
                                     bytes(range(256)) * 3 + b"\n"])
def test_a_bad_message_from_a_peer_is_dropped_and_the_job_goes_on(watches, garbage):
    hub, rec = watches(0, nnodes=2, timeout=30.0)
    with raw_client(watches.port) as sock:
        sock.sendall(garbage + b'{"t":"hb"}\n')
        until(lambda: any("dropped a message from algo-2" in line for line in rec.lines))
        time.sleep(0.3)
        assert hub.cause() is None and not rec.stops and hub.states == {1: "running"} and hub.thread.is_alive()
        sock.sendall(b'{"t":"done","node":1,"host":"algo-2"}\n')
        until(lambda: hub.states == {1: "done"})
    assert sum("dropped a message" in line for line in rec.lines) == 1


def test_an_endless_line_closes_that_connection_without_a_loss(watches):
    hub, rec = watches(0, nnodes=2, timeout=30.0)
    with raw_client(watches.port) as sock:
        with contextlib.suppress(OSError):
            for _ in range(100):
                sock.sendall(b"x" * 4096)
        until(lambda: not hub.connected())
    time.sleep(0.3)
    assert hub.cause() is None and hub.states == {1: "running"} and hub.thread.is_alive()


def test_strangers_before_the_handshake_are_refused_and_no_loss(watches):
    hub, rec = watches(0, nnodes=2)
    other = jobwatch.job_identity("job-b", "algo-1", 29501, 2)
    for junk in (b"GET / HTTP/1.0\r\n\r\n", b'{"t":"hello","node":5,"host":"x","nnodes":2,"job":"%s"}\n' % JOB.encode(),
                 b'{"t":"hello","node":1,"host":"x","nnodes":9,"job":"%s"}\n' % JOB.encode(),
                 b'{"t":"hello","node":1,"host":"x","nnodes":2}\n', os.urandom(2000) + b"\n",
                 b'{"t":"hello","node":1,"host":"x","nnodes":2,"job":"%s"}\n' % other.encode()):
        with raw_client(watches.port, hello=False) as sock:
            sock.sendall(junk)
            until(lambda s=sock: s.recv(100) in (b"", b'{"t":"refused","why":"another job"}\n'))
    with raw_client(watches.port, hello=False):
        pass  # connects and leaves
    time.sleep(0.3)
    assert hub.cause() is None and hub.states == {} and hub.thread.is_alive()
    assert any("a launcher of another job" in line and "not affected" in line for line in rec.lines), rec.lines


def test_a_launcher_of_another_job_is_refused_and_neither_job_is_affected(watches):
    """Job B's client finds job A's hub first on a shared candidate port: refused, it goes on to its own."""
    job_b = jobwatch.job_identity("job-b", "algo-1", 29501, 3)
    hub_a, rec_a = watches(0, job=JOB)
    port_b = free_port()
    rec_b = Recorder()
    hub_b = jobwatch.start(0, "algo-1", 3, "127.0.0.1", port_b, TIMEOUT, 30.0, rec_b.log, job=job_b)
    client_b = jobwatch.start(1, "algo-2", 3, "127.0.0.1", (watches.port, port_b), TIMEOUT, 30.0, rec_b.log,
                              job=job_b)
    try:
        client_a, _ = watches(1, job=JOB)
        until(lambda: client_b.connected() and client_a.connected())
        assert sorted(hub_b.states) == [1] and sorted(hub_a.states) == [1]
        time.sleep(3 * TIMEOUT)
        assert hub_a.cause() is None and hub_b.cause() is None and client_b.cause() is None
        assert any("refused a connection" in line and "another job" in line for line in rec_a.lines), rec_a.lines
        assert any(f"127.0.0.1:{watches.port} is not this job's hub (it refused: another job)" in line
                   for line in rec_b.lines), rec_b.lines
    finally:
        client_b.close()
        hub_b.close()


def test_a_client_whose_port_holds_another_program_keeps_going(watches):
    """The watch port taken by something that is not a hub: the client logs it once, no loss, no crash."""
    stranger = socket.create_server(("127.0.0.1", watches.port))
    served = []

    def serve() -> None:
        for _ in range(2):
            conn, _addr = stranger.accept()
            served.append(conn)
            conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client, rec = watches(1, nnodes=2)
    until(lambda: len(served) == 2)
    stranger.close()
    assert sum("is not this job's hub (garbage)" in line for line in rec.lines) == 1, rec.lines
    assert client.cause() is None and not rec.stops and client.thread.is_alive()
    for conn in served:
        conn.close()


def test_a_squatter_that_claims_a_node_first_is_replaced_by_the_real_one(watches):
    """Something connects first as node 1 without the job's identity: refused. With the identity (no
    secret: anyone who knows it), the real node 1 replaces it; the squatter's silence is no loss."""
    hub, rec = watches(0, nnodes=2, timeout=30.0)
    with raw_client(watches.port, hello=False) as squatter:
        squatter.sendall(b'{"t":"hello","node":1,"host":"algo-2","nnodes":2}\n')
        assert readline(squatter) == b'{"t":"refused","why":"another job"}\n' and readline(squatter) == b""
    squatter = raw_client(watches.port)  # knows the identity: accepted for now
    client, _ = watches(1, nnodes=2, timeout=30.0)
    until(lambda: client.connected())
    heard = b""
    while b'"t":"replaced"' not in heard:
        line = readline(squatter)
        assert line, heard
        heard += line
    squatter.close()
    time.sleep(0.5)
    assert hub.cause() is None and hub.states == {1: "running"}
    assert any("algo-2 reconnected" in line for line in rec.lines)
    assert finish(client, 0, "", True) == (0, "")
    assert finish(hub, 0, "", True) == (0, "")


def test_the_hub_waits_for_others_after_success_at_most_the_loss_timeout(watches):
    """A peer that never ends (heartbeats for ever) keeps the hub at most the loss timeout after success."""
    hub, rec = watches(0, nnodes=2, timeout=2.0)
    with raw_client(watches.port) as sock:
        stop = threading.Event()

        def beat() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    sock.sendall(b'{"t":"hb"}\n')
                time.sleep(0.2)

        threading.Thread(target=beat, daemon=True).start()
        began = time.monotonic()
        assert finish(hub, 0, "", True) == (0, "")
        waited = time.monotonic() - began
        stop.set()
    assert 2.0 <= waited <= 10, waited
    assert any("not waiting longer" in line for line in rec.lines)


def test_hundreds_of_idle_connections_and_a_flood_of_1100_never_stop_the_job(watches):
    """Connections that never say hello: the oldest are dropped beyond the cap; no error, no loss."""
    hub, rec = watches(0, nnodes=2, timeout=30.0)
    client, _ = watches(1, nnodes=2, timeout=30.0)
    until(lambda: client.connected())
    flood = []
    try:
        for _ in range(1100):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", watches.port))
            flood.append(sock)
        time.sleep(2.0)
        assert hub.thread.is_alive() and client.thread.is_alive()
        held = sum(1 for c in list(hub.conns.values()) if c.node is None)
        assert held <= jobwatch.MAX_PENDING + 2, held
        assert any("connections without a hello" in line for line in rec.lines), rec.lines
    finally:
        for sock in flood:
            sock.close()
    time.sleep(0.5)
    assert hub.cause() is None and client.cause() is None and hub.states == {1: "running"}
    assert finish(client, 7, "algo-2: rank 2 (local rank 0) exited with code 7", True)[0] == 7
    until(lambda: hub.cause() is not None)  # the watch still works
    assert hub.cause().code == 7


def test_a_slow_sender_and_a_half_open_connection_are_dropped(watches, monkeypatch):
    monkeypatch.setattr(jobwatch.hub, "HANDSHAKE_TIMEOUT", 1.0)  # the hub drops strangers
    hub, rec = watches(0, nnodes=2, timeout=30.0)
    slow = raw_client(watches.port, hello=False)
    half = raw_client(watches.port, hello=False)
    half.shutdown(socket.SHUT_WR)
    try:
        with contextlib.suppress(OSError):  # dropped half-way: what should happen
            for byte in b'{"t":"hello"':
                slow.sendall(bytes([byte]))
                time.sleep(0.1)
        until(lambda: not hub.conns)
        assert hub.cause() is None and hub.thread.is_alive()
    finally:
        slow.close()
        half.close()


@pytest.mark.parametrize("client_secret, accepted", [(b"s3cret", True), (b"other", False), (None, False)])
def test_with_a_secret_only_tagged_messages_count(watches, client_secret, accepted):
    hub, rec = watches(0, nnodes=2, secret=b"s3cret")
    client, crec = watches(1, nnodes=2, secret=client_secret, connect_for=3.0)
    if accepted:
        until(lambda: client.connected() and hub.states == {1: "running"})
        finish(client, 7, "algo-2: rank 2 (local rank 0) exited with code 7", True)
        until(lambda: hub.cause() is not None)
        assert hub.cause().code == 7
        return
    until(lambda: any("job watch off" in line for line in crec.lines), timeout=15)
    assert hub.states == {} and hub.cause() is None and client.cause() is None
    assert any("refused a connection" in line and ("no valid tag" in line or "garbage" in line)
               for line in rec.lines), rec.lines


def test_with_a_secret_a_forged_or_replayed_message_is_dropped(watches):
    """A handshaken peer's untagged, badly tagged or replayed lines are dropped (logged once)."""
    import hashlib
    import hmac
    secret = b"s3cret"
    hub, rec = watches(0, nnodes=2, secret=secret, timeout=30.0)
    sock = socket.create_connection(("127.0.0.1", watches.port), timeout=5)
    try:
        nonce = json.loads(readline(sock))["nonce"]

        def tagged(message: dict) -> bytes:
            body = json.dumps(message).encode()
            context = f"{JOB}\n{nonce}\ncn\nclient\n".encode()
            return hmac.new(secret, context + body, hashlib.sha256).hexdigest().encode() + b" " + body + b"\n"

        sock.sendall(tagged({"t": "hello", "job": JOB, "node": 1, "host": "algo-2", "nnodes": 2, "nonce": "cn",
                             "n": 1}))
        assert b'"t":"hello"' in readline(sock)
        forged = b'{"t":"failed","node":1,"host":"algo-2","code":42,"report":"forged","primary":true,"n":2}\n'
        replayed = tagged({"t": "hb", "n": 1})
        sock.sendall(forged + b"00" * 32 + b" " + forged + replayed)
        until(lambda: any("dropped a message from algo-2" in line for line in rec.lines))
        time.sleep(0.3)
        assert hub.cause() is None and hub.states == {1: "running"}
        sock.sendall(tagged({"t": "failed", "node": 1, "host": "algo-2", "code": 5, "report": "real",
                             "primary": True, "n": 2}))
        until(lambda: hub.cause() is not None)
        assert hub.cause().code == 5 and hub.cause().report == "real"
    finally:
        sock.close()


def test_clients_find_the_hub_on_the_next_candidate_port_when_the_first_is_taken(watches):
    """Every host reaches the same decision: the hub takes the first free candidate, clients find it there."""
    with socket.create_server(("", 0)) as taken:
        ports = (taken.getsockname()[1], free_port())
        lines: list[str] = []
        hub = jobwatch.start(0, "algo-1", 2, "127.0.0.1", ports, TIMEOUT, 30.0, lines.append, job=JOB)
        client = jobwatch.start(1, "algo-2", 2, "127.0.0.1", ports, TIMEOUT, 30.0, lines.append, job=JOB)
        try:
            until(lambda: client.connected())
            assert hub.port == ports[1]
            assert any(f"hub on port {ports[1]} (taken: {ports[0]}: Address already in use)" in line for line in lines)
        finally:
            client.close()
            hub.close()


def test_a_platform_stop_that_came_first_stays_this_hosts_own_when_another_host_fails_after_it(watches):
    """CI: a spot interruption (SIGTERM) stopped algo-1's workers; algo-2 failed because of it, and its failure
    reached algo-1's watch before algo-1's verdict: the watch marked the stop as its own (``stopped_job``) and the
    host reported "stopped because of algo-2" with exit code 1, not 143. A watch's stop counts only when its
    request stopped the workers (supervise's real stop, a real process standing for the workers)."""
    from launcher.supervise import _StopSignals

    for platform_first in (True, False):
        ports = (free_port(),)
        lines: list[str] = []
        hub = jobwatch.start(0, "algo-1", 2, "127.0.0.1", ports, TIMEOUT, 30.0, lines.append, job=JOB)
        client = jobwatch.start(1, "algo-2", 2, "127.0.0.1", ports, TIMEOUT, 30.0, lines.append, job=JOB)
        worker = subprocess.Popen(["sleep", "60"])
        stop = _StopSignals(5.0, lines.append, direct=True)
        stop.proc = worker
        try:
            until(client.connected)
            hub.attach(stop.request)  # algo-1, node 0: the host the platform stops
            if platform_first:
                stop(signal.SIGTERM)  # the platform's, as the launcher's handler gets it
                assert worker.wait(timeout=30) == -signal.SIGTERM
            client.finish(1, "algo-2: rank 1 (local rank 0) exited with code 1", True)
            until(lambda hub=hub: hub.cause() is not None)
            if not platform_first:
                assert worker.wait(timeout=30) == -signal.SIGTERM
            assert hub.stopped_job is not platform_first and stop.signal == signal.SIGTERM, lines
            assert (hub.stop_at is None) is platform_first
            assert stop.request(1.0, "again") is False  # a stop in force: a later request stops nothing
            assert hub.stopped_job is not platform_first
        finally:
            hub.attach(None)
            client.close()
            hub.close()
            if worker.poll() is None:
                worker.kill()
            worker.wait()
            assert_gone([worker.pid])


def test_a_stop_held_while_the_stacks_are_taken_reaches_the_workers_at_the_holds_end_or_at_its_bound():
    """Hang detection holds a stop while it takes this host's stacks: a SIGTERM beside the stack signal ended a
    worker in the middle of its dump. The stop is decided at once (signal, deadline from its arrival) and reaches
    the workers (a real process) only when the hold ends, or at the hold's bound; a hold with no stop ends
    silently; outside a hold a stop goes at once (supervise's real stop)."""
    from launcher.supervise import _StopSignals

    for how in ("released", "request", "bound", "nothing", "unheld"):
        lines: list[str] = []
        worker = subprocess.Popen(["sleep", "60"])
        stop = _StopSignals(30.0, lines.append, direct=True)
        stop.proc = worker
        try:
            if how != "unheld":
                stop.hold(0.3 if how == "bound" else 60.0)
            arrived = time.monotonic()
            if how == "request":
                assert stop.request(5.0, "job watch: algo-2 failed: stopping the workers here") is True
            elif how != "nothing":
                stop(signal.SIGTERM)  # the platform's, as the launcher's handler gets it
            if how == "unheld":
                assert worker.wait(timeout=30) == -signal.SIGTERM
                assert "once their stacks are taken" not in "\n".join(lines)
                continue
            time.sleep(0.5)
            assert worker.poll() is None, lines  # held: the worker still runs (its dump would go on)
            if how != "nothing":
                assert stop.signal == signal.SIGTERM and stop.deadline is not None
                assert stop.deadline <= arrived + (5.0 if how == "request" else 30.0) + 0.5  # from its arrival
                assert any("once their stacks are taken" in line for line in lines), lines
            if how == "bound":
                stop.overdue()  # the supervisor's wait, at its next tick
                assert lines[-1] == "the workers' stacks were not taken within the hold: passing the stop on now"
            else:
                stop.overdue()  # within the bound: nothing happens
                assert worker.poll() is None
                stop.hold(None)
            if how == "nothing":
                time.sleep(0.3)
                assert worker.poll() is None and stop.signal is None and len(lines) == 0, lines
            else:
                assert worker.wait(timeout=30) == -signal.SIGTERM
                assert stop.request(1.0, "again") is False  # the stop is in force
        finally:
            if worker.poll() is None:
                worker.kill()
            worker.wait()
            assert_gone([worker.pid])


# -- real jobs: two launchers, torchrun, gloo workers; one host faulted --

HOSTS = ["algo-1", "algo-2"]
LONG_RUN = ["--steps", "100000", "--step-sleep", "0.05"]
JOB_BOUND = 30.0  # s from the fault until every process exited: ~1.5 s quiet, ~8 s of torchrun shutdown at load 40
# (unstopped, the job would run for minutes)


class TwoHosts:
    """Two launchers of one job on 127.0.0.1, each on its own SageMaker tree; stderr read as it comes."""

    def __init__(self, tmp_path, script_args, launcher_args=(), port: Optional[int] = None,
                 watch: Optional[int] = -1, prefix: tuple = ()) -> None:
        """``port`` the rendezvous port (default a free one), ``watch`` the watch port (-1: a free one;
        None: the default rule), ``prefix`` what runs the launchers (e.g. ``ip netns exec NAME``)."""
        self.bases = [make_host(tmp_path, h, HOSTS) for h in HOSTS]
        port = port or free_port()
        ports = {"LAUNCHER_MASTER_PORT": str(port)}
        if watch is not None:
            ports["LAUNCHER_WATCH_PORT"] = str(free_port() if watch == -1 else watch)
        self.procs = []
        self.err: list[list[str]] = [[], []]
        self.readers: list[threading.Thread] = []
        for base, err in zip(self.bases, self.err):
            env = launcher_env(SAGEMAKER_BASE_DIR=str(base), WORKER_RECORD_DIR=str(base / "records"), **ports,
                               LAUNCHER_RESOLVE=",".join(f"{h}=127.0.0.1" for h in HOSTS))
            proc = subprocess.Popen([*prefix, PYTHON, "-m", "launcher", "--nproc-per-node", "2", *launcher_args,
                                     *script_args], env=env, cwd=str(base), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
            self.procs.append(proc)
            self.readers.append(threading.Thread(target=lambda p=proc, e=err: e.extend(p.stderr), daemon=True))
            self.readers[-1].start()

    def pids(self, host: int) -> set[int]:
        """That host's launcher, torchrun and workers."""
        found = {self.procs[host].pid}
        for data in records(self.bases[host]).values():
            found.update({data["pid"], data["ppid"]})
        return found

    def failure(self, host: int) -> str:
        return (self.bases[host] / "output" / "failure").read_text()

    def outcome(self, host: int) -> dict:
        """That host's outcome file (SageMaker's place), checked against the schema."""
        return validate_outcome(str(self.bases[host] / "output" / "data" / "outcome.json"))

    def stderr(self, host: int) -> str:
        """What that host's launcher wrote on stderr so far; all of it once the launcher has exited (our
        reader may lag behind the pipe under load: it is waited for, so the report is not cut off)."""
        if self.procs[host].poll() is not None:
            self.readers[host].join(timeout=60)
        return "".join(self.err[host])

    def end(self) -> None:
        """Kill what is left (a test that failed half-way), by PID, and prove nothing is."""
        everything = self.pids(0) | self.pids(1)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proctree.kill_tree([proc.pid])
            proc.wait(timeout=30)
        assert_gone(everything)


@pytest.fixture
def jobs():
    started: list[TwoHosts] = []

    def make(tmp_path, script_args, launcher_args=(), **kwargs) -> TwoHosts:
        job = TwoHosts(tmp_path, script_args, launcher_args, **kwargs)
        started.append(job)
        return job

    yield make
    for job in started:
        job.end()


def wait_dead(pid: int, timeout: float = 120.0) -> float:
    """When ``pid`` is gone (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while is_alive(pid):
        assert time.monotonic() < deadline, f"{pid} still alive"
        time.sleep(0.01)
    return time.monotonic()


def worker_pid(job: TwoHosts, host: int, rank: int) -> int:
    return wait_for_records(job.bases[host], 2, timeout=120, steps=1)[rank]["pid"]


@pytest.mark.job
@pytest.mark.parametrize("fault, head, code", [
    (["--exit-code", "7"], "algo-2: rank 2 (local rank 0) exited with code 7", 7),
    (["--exit-code", "7", "--abort-at-exit"], "algo-2: rank 2 (local rank 0) exited with code 7 (then aborted in "
     "interpreter teardown: terminate called without an active exception)", 7),
    (["--self-signal", "SIGKILL"], "algo-2: rank 2 (local rank 0) was killed by SIGKILL (exit code 137)", 137)])
def test_a_worker_failure_stops_both_hosts_with_its_root_cause(jobs, tmp_path, fault, head, code):
    job = jobs(tmp_path, [WORKER, *LONG_RUN, *fault, "--fail-rank", "2", "--fail-at-step", "10"])
    faulted = wait_dead(worker_pid(job, 1, 2))
    pids = job.pids(0) | job.pids(1)
    for proc in job.procs:
        proc.wait(timeout=60)
    waited = assert_gone(pids) + time.monotonic() - faulted
    print(f"{fault[-1]} on algo-2: every process exited {waited:.2f} s after the worker died")
    for host in (0, 1):
        assert job.procs[host].returncode == code, job.stderr(host)[-3000:]
        assert job.failure(host).startswith(head + "\n" if host == 0 else head), job.failure(host)
        assert job.stderr(host).rstrip().endswith(job.failure(host).rstrip().splitlines()[-1])
        if code == 137:  # a worker SIGKILLed (as the OOM killer does): 137 like a lost host, not its class
            data = job.outcome(host)
            assert (data["class"], data["signal"], data["root_cause_host"]) == ("worker_signal", "SIGKILL", "algo-2")
    assert "\nthen algo-1: " in job.failure(0)  # and then what happened there
    assert waited <= JOB_BOUND


@pytest.mark.job
def test_a_silent_launcher_is_lost_after_the_loss_timeout(jobs, tmp_path):
    """algo-2's launcher paused (SIGSTOP) for longer than the loss timeout: its workers run on, its
    heartbeats stop."""
    job = jobs(tmp_path, [WORKER, *LONG_RUN], ["--loss-timeout", "4"])
    worker_pid(job, 1, 2)
    worker_pid(job, 0, 0)
    survivors = job.pids(0)
    job.procs[1].send_signal(signal.SIGSTOP)
    paused = time.monotonic()
    job.procs[0].wait(timeout=60)
    waited = assert_gone(survivors) + time.monotonic() - paused
    print(f"algo-2's launcher stopped: algo-1 all exited {waited:.2f} s later (loss timeout 4 s)")
    assert job.procs[0].returncode == jobwatch.LOST_CODE, job.stderr(0)[-3000:]
    assert job.failure(0).startswith("algo-2 lost: no heartbeat for 4 s\nthen algo-1: ")
    assert "algo-2 silent for" in job.stderr(0)  # suspect first
    assert waited <= 4 + JOB_BOUND
    job.procs[1].send_signal(signal.SIGCONT)  # it wakes up to a job that is over, and is told why
    job.procs[1].wait(timeout=60)
    assert job.procs[1].returncode == jobwatch.LOST_CODE, job.stderr(1)[-3000:]
    assert job.failure(1).startswith("algo-2 lost: no heartbeat for 4 s\nthen algo-2: ")


@pytest.mark.job
def test_a_launcher_paused_for_less_than_the_loss_timeout_is_no_loss(jobs, tmp_path):
    """algo-2's launcher paused for 5 s (longer than the old 3 s timeout): suspect, then heard again;
    the job finishes with 0 on both hosts."""
    job = jobs(tmp_path, [WORKER, "--steps", "300", "--step-sleep", "0.05"])
    worker_pid(job, 1, 2)
    job.procs[1].send_signal(signal.SIGSTOP)
    time.sleep(5)
    job.procs[1].send_signal(signal.SIGCONT)
    for proc in job.procs:
        proc.wait(timeout=180)
    for host in (0, 1):
        assert job.procs[host].returncode == 0, job.stderr(host)[-3000:]
    assert "algo-2 heard again after" in job.stderr(0), job.stderr(0)[-3000:]


@pytest.mark.job
@pytest.mark.parametrize("lost", [1, 0])
def test_a_host_that_loses_power_is_lost(jobs, tmp_path, lost):
    """Every process of one host SIGKILLed at once: the other names it and exits 137."""
    job = jobs(tmp_path, [WORKER, *LONG_RUN])
    worker_pid(job, 1, 2)
    worker_pid(job, 0, 0)
    other = 1 - lost
    survivors = job.pids(other)
    proctree.kill_tree([job.procs[lost].pid])
    killed = time.monotonic()
    job.procs[other].wait(timeout=60)
    waited = assert_gone(survivors) + time.monotonic() - killed
    print(f"{HOSTS[lost]} powered off: {HOSTS[other]} all exited {waited:.2f} s later")
    assert job.procs[other].returncode == jobwatch.LOST_CODE, job.stderr(other)[-3000:]
    assert job.failure(other).startswith(f"{HOSTS[lost]} lost: connection closed\nthen {HOSTS[other]}: ")
    data = job.outcome(other)  # 137 like a SIGKILLed worker, but its own class
    assert (data["class"], data["signal"], data["root_cause_host"]) == ("host_lost", None, HOSTS[lost])
    assert data["infrastructure"] and data["root_cause"].startswith(f"{HOSTS[lost]} lost: ")
    assert waited <= JOB_BOUND


EARLY_AND_LATE = """import json, os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
if os.environ["GROUP_RANK"] == "1":  # algo-2
    time.sleep(8)  # longer than the heartbeat timeout: algo-1's workers are long done
rank = int(os.environ["RANK"])
with open(os.path.join(os.environ["WORKER_RECORD_DIR"], f"rank{rank}.json"), "w") as fh:
    json.dump({"rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "sum": t.item(), "steps_done": 1}, fh)
"""


@pytest.mark.job
def test_a_host_that_finishes_early_is_no_loss(jobs, tmp_path):
    script = tmp_path / "early_and_late.py"
    script.write_text(EARLY_AND_LATE)
    job = jobs(tmp_path, [str(script)])
    for proc in job.procs:
        proc.wait(timeout=180)
    for host in (0, 1):
        assert job.procs[host].returncode == 0, job.stderr(host)[-3000:]
        assert "lost" not in job.stderr(host) and not (job.bases[host] / "output" / "failure").exists()
    assert {r["sum"] for h in (0, 1) for r in records(job.bases[h]).values()} == {4.0}


@pytest.fixture
def loopback():
    """A network namespace of this test's own with only its loopback up: ports 29500 and 29501 are free
    there whatever else runs on the machine. Yields the prefix that runs a command in it."""
    name = f"watchjobs-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        yield ("ip", "netns", "exec", name)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


@pytest.mark.job
def test_two_jobs_on_the_same_hosts_at_neighbouring_ports_both_finish(jobs, tmp_path, loopback):
    """Two 2-host jobs at the same time on the same hosts, MASTER_PORT 29500 and 29501 (the common habit),
    default watch ports: neither job's watch takes the other's rendezvous port or hears the other job."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    run = [WORKER, "--steps", "60", "--step-sleep", "0.05"]
    a = jobs(first, run, port=29500, watch=None, prefix=loopback)
    b = jobs(second, run, port=29501, watch=None, prefix=loopback)
    for job in (a, b):
        for proc in job.procs:
            proc.wait(timeout=240)
    for job in (a, b):
        for host in (0, 1):
            assert job.procs[host].returncode == 0, job.stderr(host)[-3000:]
            assert "lost" not in job.stderr(host) and "job watch off" not in job.stderr(host)
        assert "job watch: connected to the hub" in job.stderr(1)
        hub_port = int(re.search(r"job watch: hub on port (\d+)", job.stderr(0)).group(1))
        assert 61000 <= hub_port < 65500


@pytest.mark.job
def test_no_job_watch_starts_none(jobs, tmp_path):
    job = jobs(tmp_path, [WORKER, "--steps", "3"], ["--no-job-watch"])
    for proc in job.procs:
        proc.wait(timeout=180)
    for host in (0, 1):
        assert job.procs[host].returncode == 0, job.stderr(host)[-3000:]
        mentions = [line for line in job.stderr(host).splitlines() if "job watch" in line]
        off = "[ddp-launcher] hang detection off: with several hosts it needs the job watch (--no-job-watch)"
        assert mentions == [off], mentions


@pytest.mark.parametrize("args, needle", [
    (["--watch-port", "29500"], "error: --watch-port 29500 is the rendezvous port (--master-port)"),
    (["--master-port", "20345", "--watch-port", "20345"], "error: --watch-port 20345 is the rendezvous port"),
    (["--job-secret-file", "/nonexistent/secret"], "error: cannot read --job-secret-file '/nonexistent/secret'"),
])
def test_bad_watch_settings_exit_2_with_one_line(tmp_path, args, needle):
    script = tmp_path / "train.py"
    script.write_text("")
    env = launcher_env(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", NNODES="2", NODE_RANK="1")
    result = subprocess.run([PYTHON, "-m", "launcher", "--platform", "env", *args, str(script)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and needle in result.stderr, result.stderr


def test_the_old_option_name_is_an_alias_and_the_default_ports_leave_the_rendezvous_ranges(tmp_path):
    from launcher.command import WATCH_BASE, WATCH_SPAN, watch_ports
    from launcher.options import parse_invocation

    assert parse_invocation(["--heartbeat-timeout", "7", "t.py"], {}).options.loss_timeout == 7.0
    assert parse_invocation(["t.py"], {"LAUNCHER_HEARTBEAT_TIMEOUT": "9"}).options.loss_timeout == 9.0
    assert parse_invocation(["t.py"], {}).options.loss_timeout == jobwatch.LOSS_TIMEOUT
    options = parse_invocation(["t.py"], {}).options
    from launcher.cluster import Cluster
    for job_id in range(12340, 12350):  # SLURM neighbours: rendezvous 20000 + id % 10000
        cluster = Cluster("slurm", 2, 0, 1, "n1", "n1", 20000 + job_id % 10000, job_name=f"slurm-{job_id}")
        ports = watch_ports(cluster, options, jobwatch.job_identity(f"slurm-{job_id}", "n1", cluster.master_port, 2))
        assert len(set(ports)) == 4 and all(WATCH_BASE <= p < WATCH_BASE + WATCH_SPAN for p in ports)


# -- the watch alone at scale: hub and clients as separate processes (tests/scripts/watch_scale.py) --

SCALE = 64


def scale_run(fault: str, timeout: float) -> dict:
    import sys
    sys.path.insert(0, os.path.join(REPO, "tests", "scripts"))
    import watch_scale

    figures = watch_scale.run(SCALE, free_port(), timeout, fault, launcher_env())
    assert_gone(figures["pids"])
    return figures


def test_64_hosts_join_and_one_failure_reaches_every_host():
    figures = scale_run("fail", 30.0)
    print(f"64 hosts: joined {figures['join']:.2f} s after the last start; the failure reached every host "
          f"{figures['spread']:.2f} s after it was sent; hub CPU {figures['hub_cpu']:.2f} s, RSS "
          f"{figures['hub_rss'] / 1024:.1f} MiB")
    assert figures["join"] <= 10 and figures["spread"] <= 5  # the 2 s and 1 s, with a loaded machine's margin
    head = "algo-6: rank 5 (local rank 0) exited with code 7"
    assert len(figures["ends"]) == SCALE
    assert all(code == 7 and report.startswith(head) for code, report in figures["ends"].values()), figures["ends"]


def test_64_hosts_one_silent_host_is_lost_on_every_host():
    timeout = 5.0
    figures = scale_run("silent", timeout)
    print(f"64 hosts: the silent host lost {figures['lost_after']:.2f} s after its pause (loss timeout "
          f"{timeout:g} s)")
    assert timeout - 1.5 <= figures["lost_after"] <= timeout + 5
    head = f"algo-6 lost: no heartbeat for {timeout:g} s"
    assert all(code == jobwatch.LOST_CODE and report.startswith(head) for code, report in figures["ends"].values())


def test_the_hubs_memory_stays_bounded_under_junk():
    import sys
    sys.path.insert(0, os.path.join(REPO, "tests", "scripts"))
    import watch_scale

    result = watch_scale.junk_rss(free_port(), launcher_env())
    assert_gone([result["pid"]])
    print(f"hub peak RSS {result['before'] / 1024:.1f} MiB before 3 x 1,100 junk connections, "
          f"{result['after'] / 1024:.1f} MiB after")
    assert result["alive"] and not result["stopped"], result["log"]
    assert result["after"] - result["before"] < 16 * 1024, result
    assert not any("Traceback" in line or "Too many open files" in line for line in result["log"])


class FreezingProxy:
    """A TCP relay between clients and the hub whose existing connections can be frozen: their bytes
    stop flowing both ways and nothing is closed (a link blip as TCP sees it), while new connections
    flow. Real sockets on 127.0.0.1."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.frozen: list[threading.Event] = []
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inner, _ = self.server.accept()
            except OSError:
                return
            outer = socket.create_connection(("127.0.0.1", self.target))
            frozen = threading.Event()
            self.frozen.append(frozen)
            self.socks += [inner, outer]
            for a, b in ((inner, outer), (outer, inner)):
                threading.Thread(target=self._pump, args=(a, b, frozen), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, frozen: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = source.recv(65536)
                while frozen.is_set():
                    time.sleep(0.05)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                sink.sendall(data)

    def freeze(self) -> None:
        for event in list(self.frozen):
            event.set()

    def close(self) -> None:
        self.server.close()
        for sock in self.socks:
            sock.close()


def test_a_client_cut_off_without_a_definite_end_reconnects_and_nothing_is_lost(watches):
    """The client's connection goes silent (frozen, not closed) for 6 s: the hub suspects the client, the
    client suspects the hub and opens a new connection with the same identity, which replaces the old."""
    timeout = 10.0
    hub, rec = watches(0, nnodes=2, timeout=timeout)
    proxy = FreezingProxy(watches.port)
    crec = Recorder()
    client = jobwatch.start(1, "algo-2", 2, "127.0.0.1", proxy.port, timeout, 30.0, crec.log, job=JOB)
    try:
        client.attach(crec.stop)
        until(lambda: client.connected() and hub.states == {1: "running"})
        proxy.freeze()
        until(lambda: any("reconnected to the hub" in line for line in crec.lines), timeout=30)
        until(lambda: any("algo-2 reconnected" in line for line in rec.lines), timeout=30)
        time.sleep(1.0)
        assert hub.cause() is None and client.cause() is None and not rec.stops and not crec.stops
        assert any("silent for" in line and "trying a new connection" in line for line in crec.lines), crec.lines
        assert finish(client, 0, "", True) == (0, "")
        until(lambda: hub.states == {1: "done"})
    finally:
        client.close()
        proxy.close()
    assert hub.cause() is None


def test_a_slow_reader_loses_nothing_and_blocks_nothing():
    """Messages to a peer whose socket takes only part of them wait in its buffer (EVENT_WRITE) and
    arrive whole and in order as it reads, a little at a time; the loop meanwhile goes on."""
    listener = socket.create_server(("127.0.0.1", 0))
    rec = Recorder()
    hub = jobwatch.Hub(listener, listener.getsockname()[1], 0, "algo-1", 2, 30.0, rec.log, job=JOB)
    near, far = socket.socketpair()
    try:
        near.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        far.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        near.setblocking(False)
        conn = jobwatch._Conn(near, time.monotonic())
        conn.node, conn.host = 1, "algo-2"
        hub._register(conn)
        hub.nodes[1] = jobwatch._Node("algo-2", time.monotonic())
        hub.nodes[1].conn = conn
        sent = [{"t": "lost", "node": 1, "host": "algo-2", "why": f"message {i} " + "x" * 500} for i in range(200)]
        for message in sent:
            hub._send(conn, message)  # before the loop runs: this thread owns the sockets
        assert conn.out and conn.mask & selectors.EVENT_WRITE  # the rest waits; nothing blocked
        hub.thread.start()
        received = b""
        while received.count(b'"t":"lost"') < len(sent):
            received += far.recv(1000)
            time.sleep(0.002)
        lines = [json.loads(line) for line in received.splitlines() if b'"t":"lost"' in line]
        assert lines == sent
        assert hub.thread.is_alive() and hub.cause() is None
    finally:
        hub.close()
        far.close()
    assert not hub.thread.is_alive()


def _hub_with_peer(secret=None):
    """A hub whose loop does not run (this thread drives it) and a handshaken node 1 on a socketpair."""
    listener = socket.create_server(("127.0.0.1", 0))
    hub = jobwatch.Hub(listener, listener.getsockname()[1], 0, "algo-1", 2, 30.0, Recorder().log, job=JOB,
                       secret=secret)
    near, far = socket.socketpair()
    near.setblocking(False)
    conn = jobwatch._Conn(near, time.monotonic())
    conn.node, conn.host, conn.hub_nonce, conn.client_nonce = 1, "algo-2", "hn", "cn"
    hub._register(conn)
    hub.nodes[1] = jobwatch._Node("algo-2", time.monotonic())
    hub.nodes[1].conn = conn
    return hub, conn, far


@settings(max_examples=150, deadline=None)
@given(chunks=st.lists(st.one_of(st.binary(max_size=600),
                                 st.builds(lambda d: json.dumps(d).encode() + b"\n",
                                           st.dictionaries(st.sampled_from(["t", "node", "host", "code", "report",
                                                                            "primary", "why", "n", "job"]),
                                                           st.one_of(st.integers(), st.text(max_size=20),
                                                                     st.booleans(), st.none(), st.floats()),
                                                           max_size=6))),
                       max_size=5),
       secret=st.sampled_from([None, b"s3cret"]))
def test_no_bytes_from_a_peer_raise_out_of_the_loop_or_grow_its_buffer(chunks, secret):
    """Whatever a handshaken peer sends, reading it raises nothing and keeps at most one line's bytes;
    nothing it sends without a valid tag (with a secret) counts."""
    hub, conn, far = _hub_with_peer(secret)
    try:
        for chunk in chunks:
            if not chunk:
                continue
            far.sendall(chunk)
            hub._read(conn)
            assert len(conn.inbuf) <= jobwatch.MAX_LINE
        if secret is not None:
            assert hub.cause() is None and hub.states == {1: "running"}
    finally:
        hub.close()
        far.close()
