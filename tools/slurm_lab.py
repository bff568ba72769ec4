"""A private 2-node SLURM cluster on this machine, for a person to try the launcher on (root needed).

    python tools/slurm_lab.py up                 # start it; prints its directory; stays until Ctrl-C or 'down'
    python tools/slurm_lab.py run DIR CMD...     # a command on the controller: sbatch, srun, squeue, scontrol
    python tools/slurm_lab.py run DIR --node 2 CMD...   # a command on node 2 (its network and host name)
    python tools/slurm_lab.py down DIR           # end it: every daemon and job process, namespace and file

Example, from the repository (the job's output lands in DIR/jobs/<id>.out):

    python tools/slurm_lab.py up &
    python tools/slurm_lab.py run /tmp/slurmlab-XXXX sbatch -N2 examples/slurm_train.sbatch
    python tools/slurm_lab.py run /tmp/slurmlab-XXXX squeue

``up`` keeps the lab while it runs: the lab's processes live in a PID namespace whose first process
exits with it (see launcher/simulate/slurm_lab.py), so even a killed ``up`` leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the repository's launcher package, also when it is not installed

from launcher.simulate.slurm_lab import SlurmLab, missing_requirement  # noqa: E402


def _state_file(root: str) -> str:
    return os.path.join(root, "lab.json")


def up(nodes: int = 2) -> int:
    """Start a lab and hold it until SIGINT/SIGTERM or ``down``."""
    lab = SlurmLab(nodes=nodes)
    lab.up()
    with open(_state_file(lab.root), "w") as fh:
        json.dump({"up_pid": os.getpid(), "anchor": lab.anchor_pid(), "info": lab.info}, fh)
    print(f"SLURM lab with {nodes} nodes in {lab.root} (jobs' output: {lab.root}/jobs); "
          f"'{sys.argv[0]} down {lab.root}' ends it", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        lab.anchor.wait()
    except KeyboardInterrupt:
        pass
    finally:
        lab.down()
    return 0


def attach(root: str) -> SlurmLab:
    """The lab ``up`` started in ``root``."""
    with open(_state_file(root)) as fh:
        state = json.load(fh)
    return SlurmLab.attach(root, state["info"], state["anchor"])


def main(argv: list[str]) -> int:
    """The command line (see the module's docstring)."""
    reason = missing_requirement()
    if reason:
        print(f"slurm_lab: {reason}", file=sys.stderr)
        return 2
    if argv[:1] == ["up"]:
        return up(int(argv[1]) if len(argv) > 1 else 2)
    if argv[:1] == ["run"] and len(argv) >= 3:
        node = None
        rest = argv[2:]
        if rest[0] == "--node":
            node, rest = int(rest[1]), rest[2:]
        lab = attach(argv[1])
        return subprocess.run(lab.command(rest, node), env=lab.env()).returncode
    if argv[:1] == ["down"] and len(argv) == 2:
        with open(_state_file(argv[1])) as fh:
            os.kill(json.load(fh)["up_pid"], signal.SIGTERM)  # 'up' takes the lab down and removes DIR
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
