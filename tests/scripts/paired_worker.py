"""A short DDP job that runs at the same time as other jobs: gloo from torchrun's variables, all-reduces.

Usage: ``paired_worker.py --meet DIR --job ID --expect N [--steps S] [--step-sleep T] [--meet-timeout W]``.

After its process group is up (one all_reduce), each rank writes ``DIR/<ID>.rank<R>.json`` with the
time it got there (``met_at``), then waits until ``N`` such files exist (the ranks of every job that
is to overlap, at most ``--meet-timeout`` s: then exit 3 naming the files it saw), runs ``S``
all_reduce steps ``T`` s apart and rewrites its file with ``left_at`` and the all-reduced sum. So every
job's process group, rendezvous and job watch are alive at once, and the files prove it.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def save(path, facts):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(facts, fh)
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--meet", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--expect", type=int, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--meet-timeout", type=float, default=300.0)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    dist.all_reduce(torch.tensor([1.0]))
    path = os.path.join(args.meet, f"{args.job}.rank{rank}.json")
    facts = {"job": args.job, "rank": rank, "world_size": world, "met_at": time.time()}
    save(path, facts)
    deadline = time.monotonic() + args.meet_timeout
    while True:
        seen = sorted(name for name in os.listdir(args.meet) if name.endswith(".json"))
        if len(seen) >= args.expect:
            break
        if time.monotonic() > deadline:
            print(f"rank {rank}: only {seen} after {args.meet_timeout:g} s", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.05)
    total = None
    for step in range(1, args.steps + 1):
        tensor = torch.tensor([float(rank + 1)])
        dist.all_reduce(tensor)
        total = tensor.item()
        print(f"job {args.job} rank {rank} step={step} sum={total:g}", flush=True)
        time.sleep(args.step_sleep)
    save(path, {**facts, "left_at": time.time(), "sum": total})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
