"""A DDP job (gloo) with neither progress beats nor step lines, for the tests of what counts as progress.

Nothing here helps the launcher: no beat, no line per step (the launcher's bootstrap samples the main
thread). ``--mode``:

- ``printer``: every rank runs a thread that prints a status line twice a second, for ever; at step
  ``--at-step`` rank ``--rank`` deadlocks on a lock it already holds, the others wait in the all-reduce;
- ``healthy``: a start that holds one frame for ``--slow-start`` s (a checkpoint read), then steps, then three
  phases of ``--quiet-phase`` s each without a line: a silent computation, a checkpoint written in pieces, an
  evaluation; then more steps and the end (exit 0).

Each rank writes ``$SM_OUTPUT_DATA_DIR/rank<R>.json`` as tests/scripts/hang_worker.py does (pid, ancestors,
rank, steps, ``hung_at``). The lines the tests expect in a stack carry a ``# at:<name>`` comment.
"""

import argparse
import json
import os
import threading
import time

import torch
import torch.distributed as dist


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
    with open(path + ".tmp", "w") as fh:
        json.dump(facts, fh)
    os.replace(path + ".tmp", path)


def status_printer():
    count = 0
    while True:
        count += 1
        print(f"status: still here ({count})", flush=True)
        time.sleep(0.5)


def deadlock(lock):
    lock.acquire()
    lock.acquire()  # at:deadlock


def step(model, data):
    loss = model(data).square().mean()
    loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)  # at:all_reduce
        param.grad = None


def for_a_while(seconds, work):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        work()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=["printer", "healthy"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--at-step", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--slow-start", type=float, default=0.0)
    parser.add_argument("--quiet-phase", type=float, default=0.0)
    args, _unknown = parser.parse_known_args()
    rank = int(os.environ["RANK"])
    out = os.path.join(os.environ.get("SM_OUTPUT_DATA_DIR") or os.environ["HANG_RECORD_DIR"], f"rank{rank}.json")
    facts = {"pid": os.getpid(), "ancestors": ancestors(os.getpid()), "rank": rank, "steps": 0, "hung_at": None}
    record(out, **facts)
    time.sleep(args.slow_start)  # one frame, as a long checkpoint read
    dist.init_process_group("gloo")
    if args.mode == "printer":
        threading.Thread(target=status_printer, daemon=True).start()
    model, data, lock = torch.nn.Linear(64, 64), torch.randn(32, 64), threading.Lock()
    for number in range(1, args.steps + 1 if args.mode == "healthy" else 10**9):
        if args.mode == "printer" and number == args.at_step and rank == args.rank:
            record(out, **{**facts, "hung_at": time.time()})
            deadlock(lock)
        step(model, data)
        facts["steps"] = number
        record(out, **facts)
        time.sleep(0.05)
        if args.mode == "healthy" and number == args.steps // 2:
            facts["hung_at"] = time.time()  # the silent phases begin (the job goes on)
            record(out, **facts)
            for_a_while(args.quiet_phase, lambda: sum(i * i for i in range(10000)))  # silent computation
            with open(out + ".ckpt", "wb") as fh:  # a checkpoint written in pieces
                for_a_while(args.quiet_phase, lambda: torch.save(model.state_dict(), fh))
            os.unlink(out + ".ckpt")
            with torch.no_grad():  # an evaluation
                for_a_while(args.quiet_phase, lambda: model(data).sum().item())
    dist.destroy_process_group()
    print(f"done: {facts['steps']} steps", flush=True)


if __name__ == "__main__":
    main()
