"""A DDP job (gloo) that hangs on purpose, for the hang tests and benchmark.

Every rank all-reduces once per step and prints ``step=N``. At step ``--at-step`` one of these happens
(``--mode``):

- ``skip``: rank ``--rank`` skips the all-reduce and waits for a message from its neighbour that never
  comes (the others wait in the all-reduce: a deadlock);
- ``loop``: rank ``--rank`` loops for ever in Python;
- ``read``: rank ``--rank`` blocks reading a pipe nobody writes to;
- ``sleep``: every rank sleeps for ever (no rank stands out);
- ``silent``: every rank is silent for ``--silent`` seconds, then the job goes on and ends;
- ``beat``: like ``silent``, but every rank sends a progress beat every second meanwhile, the one-liner
  docs/hangs.md documents;
- ``preinit``: rank ``--rank`` blocks on a read before ``init_process_group`` while the others wait inside it
  (no step is ever done; ``--at-step`` is not used);
- ``noabort``: rank ``--rank`` ignores SIGABRT (the launcher's stack signal), then sleeps for ever instead of
  all-reducing: it gives no stack while the others wait in the all-reduce.

Each rank writes ``$SM_OUTPUT_DATA_DIR/rank<R>.json`` (else ``$HANG_RECORD_DIR``): its pid, its ancestors'
pids, its rank, the steps done, and ``hung_at`` (wall clock) once it stops progressing. The lines the
tests expect in a stack carry a ``# at:<name>`` comment. Until it has joined the process group, a thread
sends a progress beat every second (a slow start is not a hang).
"""

import argparse
import contextlib
import json
import os
import signal
import socket
import threading
import time


def beat_until(done):
    """A progress beat every second until ``done``: a loaded machine may take longer than the tests' short
    hang timeout to import torch and join the process group, and none of that prints anything."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    while not done.wait(1.0):
        with contextlib.suppress(OSError, KeyError):
            sock.sendto(os.environ["RANK"].encode(), os.environ["DDP_LAUNCHER_PROGRESS"])


print("starting", flush=True)
STARTED = threading.Event()
threading.Thread(target=beat_until, args=(STARTED,), daemon=True).start()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def ancestors(pid):
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            break
        pid = int(stat[stat.rfind(b")") + 2:].split()[1])
        chain.append(pid)
    return chain


def record(path, **facts):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(facts, fh)
    os.replace(tmp, path)


def wait_for_peer(rank, world):
    peer = torch.zeros(1)
    dist.recv(peer, src=(rank + 1) % world)  # at:skip


def spin():
    count = 0  # one line for the loop: its backward jump carries the `while` line, and a stack may be taken there
    while count >= 0: count += 1  # noqa: E701  # at:loop


def read_input():
    read_end, write_end = os.pipe()
    return os.read(read_end, 1), write_end  # at:read


def wait_forever():
    time.sleep(10**6)  # at:sleep


def ignore_abort_and_sleep():
    signal.signal(signal.SIGABRT, signal.SIG_IGN)  # faulthandler's handler gone: SIGABRT does nothing
    time.sleep(10**6)  # at:noabort


def quiet_phase(seconds, beats):
    end = time.monotonic() + seconds
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    while time.monotonic() < end:
        if beats:  # the one-liner of docs/hangs.md
            with contextlib.suppress(OSError, KeyError):
                sock.sendto(os.environ["RANK"].encode(), os.environ["DDP_LAUNCHER_PROGRESS"])
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True,
                        choices=["skip", "loop", "read", "sleep", "silent", "beat", "preinit", "noabort"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--at-step", type=int, default=3)
    parser.add_argument("--hang-file", default="", help="hang at the first step at which this file exists")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--silent", type=float, default=5.0)
    args, _unknown = parser.parse_known_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = os.path.join(os.environ.get("SM_OUTPUT_DATA_DIR") or os.environ["HANG_RECORD_DIR"], f"rank{rank}.json")
    facts = {"pid": os.getpid(), "ancestors": ancestors(os.getpid()), "rank": rank, "steps": 0, "hung_at": None}
    record(out, **facts)
    if args.mode == "preinit":
        STARTED.set()  # no beat from here on: the hang is the join itself
        record(out, **{**facts, "hung_at": time.time()})
        if rank == args.rank:
            read_input()
    dist.init_process_group("gloo")  # at:init
    STARTED.set()
    print("joined", flush=True)
    for step in range(1, args.steps + 1 if args.mode in ("silent", "beat") else 10**9):
        tensor = torch.ones(1)
        if args.hang_file and step < args.at_step and os.path.exists(args.hang_file):
            args.at_step = step  # the test saw what it waited for (the launcher's log): the hang comes now
        if step == args.at_step:
            if args.mode in ("silent", "beat"):
                facts["hung_at"] = time.time()  # kept: the job goes on
                record(out, **{**facts, "steps": step - 1})
                quiet_phase(args.silent, args.mode == "beat")
            elif args.mode == "sleep":
                record(out, **{**facts, "steps": step - 1, "hung_at": time.time()})
                wait_forever()
            elif rank == args.rank:
                record(out, **{**facts, "steps": step - 1, "hung_at": time.time()})
                {"skip": lambda: wait_for_peer(rank, world), "loop": spin, "read": read_input,
                 "noabort": ignore_abort_and_sleep}[args.mode]()
        dist.all_reduce(tensor)  # at:all_reduce
        print(f"step={step}", flush=True)
        facts["steps"] = step
        record(out, **facts)
        time.sleep(args.step_sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
