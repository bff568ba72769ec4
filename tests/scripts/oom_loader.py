"""A DDP job whose rank 1's DataLoader worker runs out of memory (tests/test_oom.py).

gloo, any number of ranks, one batch per step, an all_reduce per step. Each rank writes
``$WORKER_RECORD_DIR/rank<R>.json`` (its pid and its parent's). Rank ``--victim``'s loader has one
worker process; when it loads item ``--at``, it writes ``loader.json`` there (its pid, parent and
rank), makes itself the OOM killer's first choice (``oom_score_adj`` 1000) and touches memory in 16 MiB
blocks until the kernel kills it. The rank then fails with PyTorch's own "DataLoader worker (pid ...)"
error; the others wait in all_reduce until torchrun stops them.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset

BLOCK = 16 << 20
PAGE = 4096


class Items(Dataset):
    """Item i is a tensor holding i; item ``at`` of the victim's loader allocates until killed."""

    def __init__(self, rank: int, victim: int, at: int) -> None:
        self.rank, self.victim, self.at = rank, victim, at

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.rank == self.victim and index == self.at:
            path = os.path.join(os.environ["WORKER_RECORD_DIR"], "loader.json")
            with open(path + ".tmp", "w") as fh:
                json.dump({"pid": os.getpid(), "ppid": os.getppid(), "rank": self.rank}, fh)
            os.replace(path + ".tmp", path)
            with open("/proc/self/oom_score_adj", "w") as fh:
                fh.write("1000")
            blocks = []
            while True:  # until the kernel's OOM killer ends this process
                block = bytearray(BLOCK)
                for i in range(0, BLOCK, PAGE):
                    block[i] = 1
                blocks.append(block)
        return torch.tensor([float(index)])


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--at", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(os.environ["WORKER_RECORD_DIR"], f"rank{rank}.json"), "w") as fh:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "rank": rank}, fh)
    loader = DataLoader(Items(rank, args.victim, args.at), batch_size=1,
                        num_workers=1 if rank == args.victim else 0)
    for batch in loader:
        dist.all_reduce(batch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
