"""A DDP job (gloo) in the shapes real hangs take, and the shapes that must not be taken for one.

No progress beat, no line per step (the launcher's bootstrap samples the main thread), except where a mode
says so. Every rank all-reduces once per step, and a step is one blocking call at the sampler's own period
(``--step-sleep``, 0.1 s by default). ``--mode``:

- ``early``: at step ``--at-step`` (4) rank ``--rank`` waits for a message that never comes, the others wait
  in the all-reduce (a deadlock before the sampler may have seen any step);
- ``timer``: a status logger on a ``threading.Timer`` chain prints twice a second on every rank; at step
  ``--at-step`` (30) rank ``--rank`` waits for a lock that another thread took and never gave back;
- ``loader``: batches come from a ``DataLoader`` with one worker process; on rank ``--rank`` the worker blocks
  for ever on item ``--at-step`` (the rank's main thread polls the loader's queue inside torch meanwhile);
- ``livelock``: at step ``--at-step`` rank ``--rank`` retries a call that fails, for ever, while the others
  wait in the all-reduce;
- ``chatty``: a thread of every rank prints and logs ten lines a second; at step ``--at-step`` rank
  ``--rank`` blocks on a read nobody answers;
- ``healthy``: no hang, exit 0: steps of one blocking call at 0.1 s, 0.2 s and 1 s, each for ``--phase``
  seconds; a data loader that takes 5 s per batch (3 batches); then rank 0 writes a checkpoint in shards for
  ``--phase`` seconds while the others wait in a barrier, beating once per shard (docs/hangs.md).

Each rank writes ``$SM_OUTPUT_DATA_DIR/rank<R>.json`` as tests/scripts/hang_worker.py does (pid, ancestors,
rank, steps, ``hung_at``). The lines the tests expect in a stack carry a ``# at:<name>`` comment.
"""

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
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


class Record:
    def __init__(self):
        self.rank = int(os.environ["RANK"])
        directory = os.environ.get("SM_OUTPUT_DATA_DIR") or os.environ["HANG_RECORD_DIR"]
        self.path = os.path.join(directory, f"rank{self.rank}.json")
        self.facts = {"pid": os.getpid(), "ancestors": ancestors(os.getpid()), "rank": self.rank, "steps": 0,
                      "hung_at": None}
        self.write()

    def write(self, **changes):
        self.facts.update(changes)
        with open(self.path + ".tmp", "w") as fh:
            json.dump(self.facts, fh)
        os.replace(self.path + ".tmp", self.path)


def beat():
    """The progress beat of docs/hangs.md: one datagram, never blocks."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    with contextlib.suppress(OSError, KeyError):
        address = os.environ["DDP_LAUNCHER_PROGRESS"]
        sock.sendto(os.environ["RANK"].encode(), "\0" + address[1:] if address.startswith("@") else address)
    sock.close()


def wait_for_peer(rank, world):
    peer = torch.zeros(1)
    dist.recv(peer, src=(rank + 1) % world)  # at:early


LOGGER_LOCK = threading.Lock()


def status_timer(count=0):
    """A status logger on a Timer chain: each call prints and starts the next Timer (a new thread)."""
    print(f"status: still here ({count})", flush=True)
    timer = threading.Timer(0.5, status_timer, args=(count + 1,))
    timer.daemon = True
    timer.start()


def stuck_logger_call():
    LOGGER_LOCK.acquire()  # a logger call that never gives its lock back


def log_status():
    LOGGER_LOCK.acquire()  # at:timer


class Items(torch.utils.data.Dataset):
    def __init__(self, block_at, seconds=0.0):
        self.block_at, self.seconds = block_at, seconds

    def __len__(self):
        return 10**6

    def __getitem__(self, index):
        if index == self.block_at:
            time.sleep(10**6)  # at:item
        time.sleep(self.seconds)
        return torch.ones(1)


def call_the_service(port):
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


def retry_for_ever():
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]  # bound, never listening: every connection is refused
    while True:
        try:
            call_the_service(port)  # at:livelock
        except OSError:
            time.sleep(0.05)


def chatter():
    log = logging.getLogger("chatty")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    count = 0
    while True:
        count += 1
        print(f"chat {count}", flush=True)
        log.info("chat %d", count)
        time.sleep(0.1)


def read_input():
    read_end, write_end = os.pipe()
    return os.read(read_end, 1), write_end  # at:chatty


def steps(record, count, step_sleep, hang=None):
    """``count`` steps of an all-reduce and one blocking call of ``step_sleep`` s; ``hang`` at its step."""
    tensor = torch.ones(1)
    for number in range(1, count + 1):
        if hang is not None and number == hang[0]:
            record.write(hung_at=time.time())
            hang[1]()
        dist.all_reduce(tensor)  # at:all_reduce
        time.sleep(step_sleep)
        record.write(steps=record.facts["steps"] + 1)


def loader_steps(record, loader, count, hang_at=None):
    tensor = torch.ones(1)
    for number, batch in enumerate(loader, 1):  # at:loader
        dist.all_reduce(tensor + batch.sum())
        record.write(steps=record.facts["steps"] + 1)
        if hang_at is not None and number == hang_at - 1:
            record.write(hung_at=time.time())  # the next item never comes
        if number >= count:
            return


def healthy(record, phase):
    for step_sleep in (0.1, 0.2, 1.0):
        steps(record, max(3, round(phase / (step_sleep + 0.005))), step_sleep)
    record.write(hung_at=time.time())  # the slow loader and the checkpoint: long calls, the job goes on
    slow = torch.utils.data.DataLoader(Items(-1, seconds=5.0), batch_size=1, num_workers=1)
    loader_steps(record, slow, 3)
    model = torch.nn.Linear(256, 256)
    if record.rank == 0:  # a checkpoint in shards while the others wait, one beat per shard
        end = time.monotonic() + phase
        while time.monotonic() < end:
            torch.save(model.state_dict(), record.path + ".ckpt")
            beat()
            time.sleep(0.2)
        os.unlink(record.path + ".ckpt")
    dist.barrier()  # at:barrier
    steps(record, 5, 0.1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=["early", "timer", "loader", "livelock", "chatty", "healthy"])
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--at-step", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--phase", type=float, default=12.0)
    args, _unknown = parser.parse_known_args()
    record = Record()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    culprit = rank == args.rank
    forever = 10**9
    if args.mode == "early":
        at = args.at_step or 4
        steps(record, forever, args.step_sleep, (at, lambda: wait_for_peer(rank, world)) if culprit else None)
    elif args.mode == "timer":
        status_timer()
        at = args.at_step or 30
        hang = (at, lambda: (threading.Thread(target=stuck_logger_call).start(), time.sleep(0.2), log_status()))
        steps(record, forever, args.step_sleep, hang if culprit else None)
    elif args.mode == "loader":
        at = args.at_step or 20
        loader = torch.utils.data.DataLoader(Items(at - 1 if culprit else -1), batch_size=1, num_workers=1)
        loader_steps(record, loader, forever, at if culprit else None)
    elif args.mode == "livelock":
        steps(record, forever, args.step_sleep, (args.at_step or 10, retry_for_ever) if culprit else None)
    elif args.mode == "chatty":
        threading.Thread(target=chatter, daemon=True).start()
        steps(record, forever, args.step_sleep, (args.at_step or 10, read_input) if culprit else None)
    else:
        healthy(record, args.phase)
    dist.destroy_process_group()
    print(f"done: {record.facts['steps']} steps", flush=True)


if __name__ == "__main__":
    main()
