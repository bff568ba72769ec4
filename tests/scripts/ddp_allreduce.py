"""A tiny DDP job for simulate's tests and benchmark: gloo from torchrun's variables, all-reduces.

Each rank writes ``$SM_OUTPUT_DATA_DIR/rank<R>.json`` at once and again at the end: its pid, its
ancestors' pids (torchrun, the launcher, ...), ranks, world size, its argv, its ``SM_*`` and related
variables, the steps done, the all-reduced sum, and whether it received SIGTERM. Rank 0 writes
``$SM_MODEL_DIR/model.json``.

Options (others are accepted and only recorded): ``--steps N`` (default 3; 0 = until stopped),
``--step-sleep S`` (default 0.05), ``--fail-rank R --exit-code C`` (rank R exits C after step 1, at once),
``--abort-at-exit`` (rank R then aborts in interpreter teardown, as torch's threads can: an atexit
handler prints libstdc++'s words and calls ``os.abort()``).
Every rank prints ``step=N`` after each step. SIGTERM is recorded by a thread at once, even while
the main thread waits in a collective; the loop then ends with exit code 143.
"""

import argparse
import atexit
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

RECORDED_PREFIXES = ("SM_", "SAGEMAKER_", "LAUNCHER_")
RECORDED_NAMES = ("CURRENT_HOST", "TRAINING_JOB_NAME", "PYTHONPATH", "NCCL_SOCKET_IFNAME")


def ancestors(pid):
    """``[parent, grandparent, ...]`` up to pid 1, from /proc."""
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


class Record:
    """The rank's facts, rewritten atomically whenever they change."""

    def __init__(self, path, facts):
        self.path, self.facts, self.lock = path, facts, threading.Lock()
        self.save()

    def save(self, **changes):
        with self.lock:
            self.facts.update(changes)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(self.facts, fh)
            os.replace(tmp, self.path)


def watch_sigterm(record, stop):
    """Record SIGTERM at once, even while the main thread waits in a collective.

    Python runs a signal handler in the main thread only, so a wake-up pipe is used: the C-level
    handler writes the signal number to it in whichever thread takes the signal, and a helper
    thread reading the pipe records it.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    signal.set_wakeup_fd(write_fd)

    def wait():
        while os.read(read_fd, 1) != bytes([signal.SIGTERM]):
            pass
        record.save(sigterm=True, sigterm_at=time.time())
        stop.set()

    threading.Thread(target=wait, daemon=True).start()


def abort_in_teardown():
    sys.stderr.write("terminate called without an active exception\n")
    sys.stderr.flush()
    os.abort()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--abort-at-exit", action="store_true")
    args, _unknown = parser.parse_known_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.abort_at_exit and args.fail_rank == rank:
        atexit.register(abort_in_teardown)
    out_dir = os.environ.get("SM_OUTPUT_DATA_DIR", ".")
    env = {k: v for k, v in os.environ.items() if k.startswith(RECORDED_PREFIXES) or k in RECORDED_NAMES}
    record = Record(os.path.join(out_dir, f"rank{rank}.json"), {
        "pid": os.getpid(), "ancestors": ancestors(os.getpid()), "rank": rank, "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]), "argv": sys.argv[1:], "env": env,
        "sigterm": False, "steps": 0, "sum": None})
    stop = threading.Event()
    watch_sigterm(record, stop)
    dist.init_process_group("gloo")
    step, total = 0, None
    while (args.steps == 0 or step < args.steps) and not stop.is_set():
        tensor = torch.tensor([float(rank + 1)])
        dist.all_reduce(tensor)
        total, step = tensor.item(), step + 1
        print(f"step={step} sum={total:g}", flush=True)
        record.save(steps=step, sum=total)
        if args.fail_rank == rank and step == 1:
            sys.stdout.flush()
            if args.abort_at_exit:  # the script asks for its code, then teardown aborts (the atexit handler)
                sys.exit(args.exit_code)
            os._exit(args.exit_code)  # no teardown: with the process group alive, gloo's threads made it
            # abort now and then (SIGABRT, "terminate called ...")
        stop.wait(args.step_sleep)  # a stop request ends the pause at once
    if stop.is_set():  # only SIGTERM sets it
        record.save(sigterm=True)
        os._exit(143)  # peers may be gone: no collective teardown
    if rank == 0:
        with open(os.path.join(os.environ.get("SM_MODEL_DIR", "."), "model.json"), "w") as fh:
            json.dump({"sum": total, "world_size": world}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
