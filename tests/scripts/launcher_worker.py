"""A small DDP job for the launcher's tests: trains a linear model with gloo and records facts.

Each rank writes ``<record dir>/rank<R>.json`` (pid, parent pid, ranks, world size, argv, the final
parameters) to ``$WORKER_RECORD_DIR``. Options make it fail on purpose:
``--exit-code N --fail-rank R`` exits N on rank R; ``--raise-on R`` raises ValueError on rank R;
``--self-signal SIG --fail-rank R`` kills rank R with a signal; ``--steps N --step-sleep S`` makes it
run long enough to be stopped; SIGTERM is recorded in the record file and, with ``--clean-stop``,
ends the loop at the same step on every rank (a MIN all_reduce: once all have it) with exit 0 (the
default re-raises it: the process dies of SIGTERM). ``--note-usr1`` records SIGUSR1 and goes on.
``--abort-at-exit`` reproduces torch's teardown crash: an atexit handler prints libstdc++'s words and
calls ``os.abort()`` on rank R (it dies of SIGABRT after the script asked for its code).
"""

import argparse
import atexit
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

STOP = {"signal": None}
WRITES = [0]  # a counter: the name of each write's temporary file


def write_record(path, data):
    """Whole or not at all. A signal handler may write while the loop is writing: each write has its own
    temporary file, and the loop writes again after it sees the signal, so the last record is the newest."""
    WRITES[0] += 1
    tmp = f"{path}.{WRITES[0]}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def abort_in_teardown():
    sys.stderr.write("terminate called without an active exception\n")
    sys.stderr.flush()
    os.abort()


@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--raise-on", type=int, default=None)
    parser.add_argument("--self-signal", default=None)
    parser.add_argument("--fail-rank", type=int, default=0)
    parser.add_argument("--fail-at-step", type=int, default=0)
    parser.add_argument("--clean-stop", action="store_true")
    parser.add_argument("--abort-at-exit", action="store_true", help="SIGABRT in interpreter teardown")
    parser.add_argument("--note-usr1", action="store_true", help="record SIGUSR1 and go on (SLURM's --signal)")
    args, unknown = parser.parse_known_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.abort_at_exit and rank == args.fail_rank:
        atexit.register(abort_in_teardown)
    out = os.path.join(os.environ["WORKER_RECORD_DIR"], f"rank{rank}.json")
    facts = {"pid": os.getpid(), "ppid": os.getppid(), "rank": rank, "world_size": world,
             "local_rank": int(os.environ["LOCAL_RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
             "host": os.environ.get("SM_CURRENT_HOST", socket.gethostname()), "argv": sys.argv[1:],
             "signals": [], "steps_done": 0}
    write_record(out, facts)

    def on_term(signum, _frame):
        facts["signals"].append(signal.Signals(signum).name)
        write_record(out, facts)
        STOP["signal"] = signum

    def on_note(signum, _frame):
        facts["signals"].append(signal.Signals(signum).name)
        write_record(out, facts)

    signal.signal(signal.SIGTERM, on_term)
    if args.note_usr1:
        signal.signal(signal.SIGUSR1, on_note)
    dist.init_process_group("gloo")
    torch.manual_seed(rank)  # different data per rank; DDP keeps the parameters identical
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stopped = torch.zeros(1)
    for step in range(args.steps):
        if args.clean_stop:  # stop at the same step on every rank, once every rank has the signal
            stopped = torch.tensor([0.0 if STOP["signal"] is None else 1.0])
            dist.all_reduce(stopped, op=dist.ReduceOp.MIN)
            if stopped.item():
                break
        elif STOP["signal"] is not None:
            write_record(out, facts)  # the handler's own write may have been replaced by the loop's older one
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        if rank == args.fail_rank and step == args.fail_at_step:
            if args.exit_code is not None:
                sys.exit(args.exit_code)
            if args.self_signal:
                os.kill(os.getpid(), getattr(signal, args.self_signal))
        if args.raise_on == rank and step == args.fail_at_step:
            raise ValueError(f"bad batch on rank {rank} at step {step}")
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        facts["steps_done"] = step + 1
        write_record(out, facts)
        time.sleep(args.step_sleep)
    facts["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    write_record(out, facts)
    print(f"rank {rank} of {world} done after {facts['steps_done']} steps", flush=True)
    while stopped._use_count() > 1:  # gloo's thread still holds it: exiting now can abort (see ddp_utils)
        time.sleep(0.001)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
