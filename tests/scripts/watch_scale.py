"""Drive one job watch of NNODES hosts on 127.0.0.1: the hub (watch_node.py) and NNODES-1 clients
(watch_farm.py), all separate processes, no torch. Used by tests/test_jobwatch.py (64 hosts) and
bench/bench_watch_scale.py (512 hosts).

:func:`run` starts them, waits until every client joined, applies one fault and returns the figures:
``join`` (s from the last start until the last client joined), then for ``fault="fail"`` (SIGUSR1 to
one client: it reports code 7) ``spread`` (s from its report until the last host was told to stop),
for ``fault="silent"`` (SIGSTOP of one client) ``lost_after`` (s from the pause until the hub
declared it lost); ``hub_cpu`` (s of CPU of the hub process), ``hub_rss`` (its peak RSS, KiB),
``ends`` (every host's exit code and report) and ``pids`` (every process, to prove none is left).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FAULTY = 5  # the client that fails or goes silent


def _reader(proc: subprocess.Popen, into: list) -> threading.Thread:
    def read() -> None:
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                into.append(json.loads(line))
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def _hub_usage(pid: int) -> tuple[float, int]:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    return cpu, rss


def run(nnodes: int, port: int, timeout: float, fault: str, env: dict, job: str = "scale-job",
        wait: float = 120.0) -> dict:
    python = sys.executable
    hub_said: list[dict] = []
    farm_said: list[dict] = []
    hub = subprocess.Popen([python, os.path.join(HERE, "watch_node.py"), "0", str(nnodes), str(port), str(timeout),
                            job], env=env, stdout=subprocess.PIPE, text=True)
    _reader(hub, hub_said)
    farm = None
    pids = [hub.pid]
    try:
        _until(lambda: any("joined" in s for s in hub_said), wait, "the hub never listened")
        farm = subprocess.Popen([python, os.path.join(HERE, "watch_farm.py"), str(nnodes), str(port), str(timeout),
                                 job], env=env, stdout=subprocess.PIPE, text=True)
        pids.append(farm.pid)
        _reader(farm, farm_said)

        def joined() -> list[dict]:
            return [s for s in list(farm_said) if "joined" in s]

        _until(lambda: len(joined()) == nnodes - 1, wait, "not every client joined")
        started = next(s["started"] for s in list(farm_said) if "started" in s)
        figures: dict = {"join": max(s["joined"] for s in joined()) - started}
        by_node = {s["node"]: s["pid"] for s in joined()}
        pids += list(by_node.values())
        time.sleep(2.0)  # heartbeats flow
        if fault == "fail":
            os.kill(by_node[FAULTY], signal.SIGUSR1)
        else:
            os.kill(by_node[FAULTY], signal.SIGSTOP)
            paused = time.time()

        def stops() -> dict[int, float]:
            """When each host but the faulty one was first asked to stop: a watch asks again for each
            later event (every other host's end), and the hub may say so after the clients it told."""
            first: dict[int, float] = {}
            for said in list(farm_said) + list(hub_said):
                node = said.get("node", 0)  # the hub's lines name no node
                if "stop" in said and node != FAULTY:
                    first[node] = min(said["stop"], first.get(node, said["stop"]))
            return first

        _until(lambda: len(stops()) == nnodes - 1, timeout + wait, "not every host was stopped")
        if fault == "fail":
            failing = next(s["failing"] for s in list(farm_said) if "failing" in s)
            figures["spread"] = max(stops().values()) - failing
        else:
            figures["lost_after"] = stops()[0] - paused
            os.kill(by_node[FAULTY], signal.SIGCONT)  # it hears it was lost, and ends

        def ends() -> list[dict]:
            return [s for s in list(farm_said) + list(hub_said) if "end" in s]

        _until(lambda: len(ends()) == nnodes, timeout + wait, "not every host ended")
        figures["ends"] = {s.get("node", 0): (s["code"], s["report"]) for s in ends()}
        hub_end = next(s for s in list(hub_said) if "end" in s)  # its own figures: it may have exited already
        figures["hub_cpu"], figures["hub_rss"] = hub_end["cpu"], hub_end["maxrss"]
        hub.wait(timeout=wait)
        farm.wait(timeout=wait)
        figures["pids"] = pids
        return figures
    finally:
        for proc in (farm, hub):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
                proc.wait(timeout=30)


def junk_rss(port: int, env: dict, rounds: int = 3, job: str = "junk-job") -> dict:
    """A hub (watch_node.py, 2 nodes, no client) fed junk, ``rounds`` times over: 1,100 connections at
    once, random bytes, endless lines, slow senders, half-open connections. Its peak RSS before and
    after (KiB), whether it is alive and never stopped, and its log."""
    import socket

    said: list[dict] = []
    hub = subprocess.Popen([sys.executable, os.path.join(HERE, "watch_node.py"), "0", "2", str(port), "30", job],
                           env=env, stdout=subprocess.PIPE, text=True)
    _reader(hub, said)
    try:
        _until(lambda: any("joined" in s for s in said), 60, "the hub never listened")
        time.sleep(0.5)
        before = _hub_usage(hub.pid)[1]
        for _ in range(rounds):
            socks = []
            for _ in range(1100):
                sock = socket.socket()
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", port))
                socks.append(sock)
            time.sleep(1.0)
            payloads = (lambda: os.urandom(8192), lambda: b"x" * 65536, lambda: b'{"t":"hello"')
            for i, sock in enumerate(socks[:300]):
                try:
                    sock.send(payloads[i % 3]())
                    if i % 7 == 0:
                        sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            time.sleep(1.0)
            for sock in socks:
                sock.close()
        time.sleep(1.0)
        after = _hub_usage(hub.pid)[1]
        return {"before": before, "after": after, "alive": hub.poll() is None,
                "stopped": any("stop" in s for s in said), "log": [s["log"] for s in said if "log" in s],
                "pid": hub.pid}
    finally:
        hub.terminate()
        hub.wait(timeout=30)
