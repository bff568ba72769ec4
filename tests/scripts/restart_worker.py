"""A short gloo DDP job that fails on purpose in chosen generations, for the restart tests and the benchmark.

Usage: ``restart_worker.py --out DIR [--steps N] [--step-sleep T] [--step-work T] [--fail MODE] [--fail-rank R]
[--fail-step S] [--fail-in GENS] [--fail-when PATH] [--beats no]``.

The generation is ``TORCHELASTIC_RESTART_COUNT`` (the launcher sets it). Every rank writes
``DIR/g<gen>.r<rank>.json`` when its process group is up (its pid, the generation, its start and the time) and again
after each step (``steps``, ``first_step_at``). Rank 0 keeps a checkpoint ``DIR/ckpt.json`` (the step
and the running sum), written atomically after each step, and every generation resumes from it; the
final sum is then the same as an uninterrupted run's. Each step all-reduces ``rank + 1`` and beats the
launcher (``DDP_LAUNCHER_PROGRESS``) unless ``--beats no``.

``--fail MODE`` in the generations ``--fail-in`` (comma list, or ``all``), rank ``--fail-rank``, at the
generation's own step ``--fail-step`` (counted from where it resumed; 0: before its first step):
``exit`` (exit 3), ``raise`` (RuntimeError, same line every time; ``--message`` its text), ``oserror`` (OSError,
same line every time), ``kill`` (SIGKILL itself), ``os_exit`` (``os._exit(3)``: no exit record, no teardown),
``segv`` (SIGSEGV itself: as a crash in native code), ``hang`` (stops taking part: the others wait in the
collective). The failing rank first writes ``DIR/fault.json``
(when it failed). ``--fail-when PATH``: it first waits for that file (a test's gate: the others wait in the
collective meanwhile). ``--fail-after T``: it first sleeps T s (the others then wait in the collective, and fail on
the connection it leaves as it dies). ``--pause-torchrun yes``: it then stops its torchrun (SIGSTOP), as a
torchrun busy elsewhere would not look at its workers: no failure table, until the launcher kills it.
``--peer-lost abort``: a rank whose collective fails aborts (SIGABRT, no exception), as NCCL's
error handling ends a rank whose peer went away.

``--window-in GENS``: in those generations every rank prints ``restart window step=99`` before its process
group forms and sleeps ``--window-sleep`` s (a ``simulate --fault HOST:SIGTERM:step=99`` lands inside a
restart, before the new generation's first step). Each rank records ``old_alive``: the pids of the
generation before (their records) that still exist when its own process group is up, and what it was started
with: its environment, ``sys.argv``, ``__main__``'s file, its signal masks and its parent-death signal.
"""

import time

STARTED = time.time()  # the script's own start: before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def save(path, facts):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(facts, fh)
    os.replace(tmp, path)


def beat(rank):
    path = os.environ.get("DDP_LAUNCHER_PROGRESS")
    if not path:
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.sendto(str(rank).encode(), path)
    except OSError:
        pass
    finally:
        sock.close()


def old_alive(out, gen):
    """The pids of generation ``gen - 1`` (from their records) that exist now."""
    alive = []
    for name in sorted(os.listdir(out)):
        if name.startswith(f"g{gen - 1}.r") and name.endswith(".json"):
            with open(os.path.join(out, name)) as fh:
                pid = json.load(fh)["pid"]
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    state = fh.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":  # a zombie has ended: only its exit status is left
                alive.append(pid)
    return alive


def signal_masks():
    """The signals this process blocks, ignores and catches (``/proc/self/status``): what it inherited."""
    with open("/proc/self/status") as fh:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in fh) if k in ("SigBlk", "SigIgn", "SigCgt")}


def parent_death_signal():
    """The signal this process gets when its parent dies (``prctl(PR_GET_PDEATHSIG)``)."""
    import ctypes

    value = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(value), 0, 0, 0)  # 2: PR_GET_PDEATHSIG
    return value.value


def fail(mode, out, message="the same bug every time"):
    save(os.path.join(out, "fault.json"), {"at": time.time(), "mode": mode})
    if mode == "exit":
        sys.exit(3)
    if mode == "raise":
        raise RuntimeError(message)  # at:raise
    if mode == "oserror":
        raise OSError(5, "Input/output error", "/data/shard-7.bin")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "os_exit":
        os._exit(3)
    if mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "hang":
        while True:
            time.sleep(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--step-sleep", type=float, default=0.3)
    parser.add_argument("--step-work", type=float, default=0.0)
    parser.add_argument("--fail", default="none",
                        choices=["none", "exit", "raise", "oserror", "kill", "os_exit", "segv", "hang"])
    parser.add_argument("--fail-after", type=float, default=0.0)
    parser.add_argument("--fail-when", default="")
    parser.add_argument("--pause-torchrun", default="no", choices=["yes", "no"])
    parser.add_argument("--message", default="the same bug every time")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument("--fail-in", default="0")
    parser.add_argument("--beats", default="yes", choices=["yes", "no"])  # a value: SageMaker's hyperparameters
    parser.add_argument("--window-in", default="")
    parser.add_argument("--window-sleep", type=float, default=60.0)
    parser.add_argument("--peer-lost", default="raise", choices=["raise", "abort"])
    args = parser.parse_args()
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    failing = args.fail != "none" and rank == args.fail_rank and (
        args.fail_in == "all" or str(gen) in args.fail_in.split(","))
    if str(gen) in args.window_in.split(","):
        print(f"generation {gen} rank {rank}: restart window step=99", flush=True)
        time.sleep(args.window_sleep)
    dist.init_process_group("gloo")
    dist.barrier()
    mine = os.path.join(args.out, f"g{gen}.r{rank}.json")
    facts = {"rank": rank, "generation": gen, "pid": os.getpid(), "started": STARTED, "met_at": time.time(), "steps": 0,
             "master_port": os.environ.get("MASTER_PORT"), "old_alive": old_alive(args.out, gen),
             "env": dict(os.environ), "argv": sys.argv, "main": sys.modules["__main__"].__file__,
             "signals": signal_masks(), "pdeathsig": parent_death_signal()}
    save(mine, facts)
    ckpt = os.path.join(args.out, "ckpt.json")
    state = {"step": 0, "sum": 0.0}
    if os.path.exists(ckpt):
        with open(ckpt) as fh:
            state = json.load(fh)
    if failing and args.fail_step == 0:
        fail(args.fail, args.out, args.message)
    resumed = state["step"]
    for step in range(resumed + 1, args.steps + 1):
        if failing and step - resumed == args.fail_step:
            while args.fail_when and not os.path.exists(args.fail_when):
                time.sleep(0.05)
            time.sleep(args.fail_after)  # the others meanwhile wait in the step's collective
            if args.pause_torchrun == "yes":  # torchrun sees nothing of what follows: it is stopped
                os.kill(os.getppid(), signal.SIGSTOP)
            fail(args.fail, args.out, args.message)
        if args.step_work:
            time.sleep(args.step_work)  # the step's work, on a line of its own (what the sampler sees)
        tensor = torch.tensor([float(rank + 1)])
        try:
            dist.all_reduce(tensor)
            state = {"step": step, "sum": state["sum"] + tensor.item()}
            if rank == 0:
                save(ckpt, state)
            dist.barrier()  # the checkpoint of this step is complete before any rank goes on
        except RuntimeError:
            if args.peer_lost == "abort":
                os.abort()
            raise
        if args.beats == "yes":
            beat(rank)
        facts.update(steps=facts["steps"] + 1, sum=state["sum"])
        facts.setdefault("first_step_at", time.time())
        save(mine, facts)
        print(f"generation {gen} rank {rank} step {step} sum {state['sum']:g}", flush=True)
        time.sleep(args.step_sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
