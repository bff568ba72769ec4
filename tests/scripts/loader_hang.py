"""A DDP job whose rank 1's DataLoader worker blocks for ever on one item (tests/test_simulate_faults.py).

gloo, one batch per step, an all_reduce per step. Each rank writes ``$WORKER_RECORD_DIR/rank<R>.json``
(its pid and its parent's) if that variable is set. Rank ``--victim``'s loader has one worker process;
at item ``--at`` it writes ``loader.json`` there (its pid), then waits for ever. The rank's main thread
polls the loader's queue inside torch; the other ranks wait in all_reduce.
"""

import argparse
import json
import os
import threading

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset


def write(name: str, facts: dict) -> None:
    """``facts`` as ``$WORKER_RECORD_DIR/name``, when that directory is given."""
    directory = os.environ.get("WORKER_RECORD_DIR")
    if directory:
        with open(os.path.join(directory, name + ".tmp"), "w") as fh:
            json.dump(facts, fh)
        os.replace(os.path.join(directory, name + ".tmp"), os.path.join(directory, name))


class Items(Dataset):
    """Item i is a tensor holding i; item ``at`` of the victim's loader never comes."""

    def __init__(self, rank: int, victim: int, at: int) -> None:
        self.rank, self.victim, self.at = rank, victim, at

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.rank == self.victim and index == self.at:
            write("loader.json", {"pid": os.getpid(), "ppid": os.getppid(), "rank": self.rank})
            threading.Event().wait()  # for ever
        return torch.tensor([float(index)])


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--at", type=int, default=3)
    args, _unknown = parser.parse_known_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    write(f"rank{rank}.json", {"pid": os.getpid(), "ppid": os.getppid(), "rank": rank})
    loader = DataLoader(Items(rank, args.victim, args.at), batch_size=1,
                        num_workers=1 if rank == args.victim else 0)
    for batch in loader:
        dist.all_reduce(batch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
