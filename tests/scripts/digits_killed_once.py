"""``train_scripts/train_digits.py`` with one fault at a known point, for the restart test: in generation 0
(``TORCHELASTIC_RESTART_COUNT``) rank 1 SIGKILLs itself as the 3rd epoch's checkpoint begins, so the newest
complete checkpoint is the 2nd epoch's (rank 0 waits in that checkpoint's gather for rank 1 and writes no 3rd).
Every rank also writes ``g<generation>.r<rank>.pid`` into ``DDP_UTILS_PID_DIR`` (the test proves each gone).
"""

import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "train_scripts"))

import ddp_utils  # noqa: E402
import train_digits  # noqa: E402

GENERATION = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
real_rng_state = ddp_utils.rng_state
checkpoints = 0


def rng_state(job):
    """ddp_utils' own, called by every rank at every checkpoint; the fault on the 3rd of generation 0."""
    global checkpoints
    checkpoints += 1
    if checkpoints == 1 and os.environ.get(ddp_utils.PID_DIR_ENV):
        with open(os.path.join(os.environ[ddp_utils.PID_DIR_ENV], f"g{GENERATION}.r{job.rank}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
    if checkpoints == 3 and job.rank == 1 and GENERATION == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rng_state(job)


ddp_utils.rng_state = rng_state

if __name__ == "__main__":
    sys.exit(train_digits.main())
