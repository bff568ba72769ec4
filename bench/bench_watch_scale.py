"""The job watch alone at scale: a hub and N-1 clients, all separate processes on 127.0.0.1, no torch
(tests/scripts/watch_scale.py drives them; the clients are forked from one process, copy on write).

Per size and round: how long after the last client started every client had joined; how long after
one client reported a failure every host had been told to stop; how long after one client was paused
(SIGSTOP) the hub declared it lost (target: the loss timeout + 1 s); the hub's CPU time and peak RSS.
Then the hub's peak RSS before and after 3 x 1,100 junk connections (random bytes, endless lines,
slow and half-open senders).

Usage: ``.venv/bin/python bench/bench_watch_scale.py [--hosts 64 512] [--rounds 3] [--loss-timeout 10]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "scripts"))

import watch_scale  # noqa: E402  (after the path is set)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loss-timeout", type=float, default=10.0)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAUNCHER_")}
    env["PYTHONPATH"] = REPO
    timeout = args.loss_timeout
    print(f"| hosts | all joined after the last start | a failure reached every host | silent host lost "
          f"(loss timeout {timeout:g} s) | hub CPU (fail / silent run) | hub peak RSS |")
    print("|---|---|---|---|---|---|")
    for hosts in args.hosts:
        joins, spreads, losts, cpus, rss = [], [], [], [], []
        for _ in range(args.rounds):
            for fault in ("fail", "silent"):
                figures = watch_scale.run(hosts, free_port(), timeout, fault, env)
                joins.append(figures["join"])
                cpus.append(figures["hub_cpu"])
                rss.append(figures["hub_rss"])
                codes = {code for code, _ in figures["ends"].values()}
                expected = 7 if fault == "fail" else 137
                assert codes == {expected} and len(figures["ends"]) == hosts, (fault, codes)
                (spreads if fault == "fail" else losts).append(figures.get("spread", figures.get("lost_after")))
        print(f"| {hosts} | {statistics.median(joins):.2f} s (max {max(joins):.2f}) | "
              f"{statistics.median(spreads):.2f} s (max {max(spreads):.2f}) | {statistics.median(losts):.2f} s "
              f"(max {max(losts):.2f}) | {statistics.median(cpus[0::2]):.2f} s / {statistics.median(cpus[1::2]):.2f} s"
              f" | {max(rss) / 1024:.1f} MiB |", flush=True)
    junk = watch_scale.junk_rss(free_port(), env)
    print(f"\nhub under junk (3 x 1,100 connections): peak RSS {junk['before'] / 1024:.1f} MiB before, "
          f"{junk['after'] / 1024:.1f} MiB after; alive {junk['alive']}, stopped the job {junk['stopped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
