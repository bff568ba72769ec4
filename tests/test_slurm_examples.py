"""The project's SLURM examples, submitted as they are with ``sbatch`` to the real lab (launcher/simulate/slurm_lab.py).

``examples/slurm_train.sbatch`` and ``examples/slurm_requeue.sbatch`` are submitted unedited: only what the lab
forces differs from a user's ``sbatch examples/...``, each through a variable or an sbatch option (:func:`submit`):

- ``PYTHON``: the project's virtualenv (torch); ``LAUNCHER``: the bundle ``make dist`` builds, built here by the
  same command (``python -m launcher zipapp``) in the test's directory instead of ``dist/``; ``RUN``: the test's
  directory instead of ``runs/`` in the checkout; no ``PYTHONPATH``: the bundle alone is the launcher;
- ``--chdir`` the checkout: the examples' relative paths, as when a user submits from the repository;
- ``--output`` the lab's ``jobs/<id>.out`` instead of ``%x-%j.out`` in the checkout, and ``--open-mode=append``
  so that a requeued job's output keeps its first run's.

No partition (the lab's is the default), no GPUs (the train example's ``--gpus-per-node`` line is commented out
as shipped: one process per node, on the CPU). Job ids (48213377 on) and node names (``gpu-[0007-0008]``) are a
real site's. Needs root; skipped with the reason elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
from conftest import PYTHON, REPO
from test_slurm_cluster import KILL_WAIT, SLOW, job_pids, running_lab

from launcher.simulate.slurm_lab import SlurmLab, missing_requirement

pytestmark = pytest.mark.skipif(missing_requirement() is not None, reason=missing_requirement() or "")
EXAMPLES = os.path.join(REPO, "examples")
EPOCHS = 10  # what both examples promise: train_digits.py --epochs 10


@pytest.fixture(scope="module")
def lab() -> Iterator[SlurmLab]:
    yield from running_lab()


@pytest.fixture(scope="module")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> str:
    """dist/ddp-launcher.pyz as ``make dist`` builds it, in a directory of its own."""
    path = str(tmp_path_factory.mktemp("dist") / "ddp-launcher.pyz")
    subprocess.run([PYTHON, "-m", "launcher", "zipapp", "--out", path], cwd=REPO, check=True, timeout=120,
                   capture_output=True)
    return path


def submit(lab: SlurmLab, name: str, pyz: str, run: str, python: str = PYTHON) -> int:
    """``sbatch examples/<name>`` with the lab's substitutions only (the module's docstring); returns the job id."""
    tmp = os.path.join(lab.root, "tmp")
    os.makedirs(tmp, exist_ok=True)
    env = {"PYTHON": python, "LAUNCHER": pyz, "RUN": run, "PYTHONPATH": "", "TMPDIR": tmp, "OMP_NUM_THREADS": "1"}
    job = lab.submit(os.path.join(EXAMPLES, name), f"--chdir={REPO}", "--open-mode=append", env=env)
    assert job > 10_000_000, job  # a real site's job id reaches the launcher (port, rendezvous id)
    return job


def assert_nodes_idle(lab: SlurmLab) -> None:
    """No process of any job is left on a node (slurmstepd included), within KillWait."""
    deadline = time.monotonic() + KILL_WAIT
    while job_pids(lab):
        assert time.monotonic() < deadline, "processes left on a node after the job ended: " + "; ".join(
            f"{pid} {_command(pid)[:200]}" for pid in job_pids(lab))
        time.sleep(0.1)


def outcomes(run: str, job: int, restart: int) -> dict[str, dict]:
    """The requeue example's outcome files of one run of the job, by node id."""
    directory = os.path.join(run, "outcomes", f"{job}-{restart}")
    result = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name)) as fh:
            result[name.removesuffix(".json")] = json.load(fh)
    return result


@pytest.mark.job
@pytest.mark.lab
def test_the_train_example_trains_10_epochs_on_both_nodes(lab: SlurmLab, pyz: str, tmp_path) -> None:
    run = str(tmp_path / "run")
    job = submit(lab, "slurm_train.sbatch", pyz, run)
    fields = lab.wait_job(job, timeout=SLOW)
    out = lab.output(job)
    assert (fields["JobState"], fields["ExitCode"], fields["NodeList"]) == ("COMPLETED", "0:0", "gpu-[0007-0008]"), out
    port = 20000 + job % 10000
    for rank, name in enumerate(lab.names):  # each node's launcher: the job's id, its node of gpu-[0007-0008]
        assert (f"slurm host {name}: node {rank} of 2, 1 process(es) per node; " in out
                and f"--master-addr gpu-0007 --master-port {port} --rdzv-backend static --rdzv-id slurm-{job}.0 "
                in out), out
    assert f"METRIC epoch={EPOCHS} " in out and f"METRIC epoch={EPOCHS + 1} " not in out, out
    assert os.path.exists(os.path.join(run, "model.pt")), out
    assert_nodes_idle(lab)


@pytest.mark.job
@pytest.mark.lab
def test_the_requeue_example_requeues_a_lost_node_once_and_the_rerun_resumes_to_the_end(
        lab: SlurmLab, pyz: str, tmp_path) -> None:
    run = str(tmp_path / "run")
    checkpoints = os.path.join(run, "checkpoints")
    job = submit(lab, "slurm_requeue.sbatch", pyz, run)
    deadline = time.monotonic() + SLOW
    while not (os.path.isdir(checkpoints) and os.listdir(checkpoints)):  # epoch 1 is saved: there is work to keep
        assert time.monotonic() < deadline and lab.job(job)["JobState"] in ("PENDING", "RUNNING"), lab.output(job)
        time.sleep(0.2)
    # The second node is lost: every process of its step (launcher, torchrun, worker) dies at once, SIGKILL.
    node2 = set(lab.node_pids(2))
    lost = [pid for pid in job_pids(lab) if pid in node2 and _command(pid)  # "": it has ended since
            and not _command(pid).startswith("slurmstepd")]  # SLURM's own part of the node stays
    assert lost, "no process of the step on the second node"
    for pid in lost:
        with contextlib.suppress(ProcessLookupError):  # it ended since it was listed (torchrun after its worker)
            os.kill(pid, signal.SIGKILL)
    fields = lab.wait_job(job, timeout=SLOW)
    out = lab.output(job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    first, second = outcomes(run, job, 0), outcomes(run, job, 1)
    assert [(n, o["class"], o["infrastructure"]) for n, o in first.items()] == [("0", "host_lost", True)], first
    assert [(n, o["class"], o["infrastructure"]) for n, o in second.items()] == [
        ("0", "success", False), ("1", "success", False)], second
    assert f"infrastructure failure (exit code 137): requeueing job {job}" in out, out
    assert "resuming from " in out and f"METRIC epoch={EPOCHS} " in out, out
    assert os.path.exists(os.path.join(run, "model.pt")), out
    assert_nodes_idle(lab)


@pytest.mark.lab
def test_the_requeue_example_ends_a_users_mistake_with_the_launchers_code_and_no_requeue(
        lab: SlurmLab, pyz: str, tmp_path) -> None:
    # The user's mistake: PYTHON is a Python without torch. Every node's launcher refuses it (bad_input, 2)
    # before anything starts; the script reads both outcome files and ends with 2, never requeued.
    python = shutil.which("python3", path="/usr/bin:/bin")
    probe = subprocess.run([python or "python3", "-c", "import torch"], capture_output=True)
    if python is None or probe.returncode == 0:
        pytest.skip("no Python without torch on this machine")
    run = str(tmp_path / "run")
    job = submit(lab, "slurm_requeue.sbatch", pyz, run, python=python)
    fields = lab.wait_job(job, timeout=SLOW)
    out = lab.output(job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "2:0", "0"), out
    found = outcomes(run, job, 0)
    assert [(n, o["class"], o["infrastructure"]) for n, o in found.items()] == [
        ("0", "bad_input", False), ("1", "bad_input", False)], found
    assert "torch is not installed in the Python that would run torchrun" in out and "requeue" not in out, out
    assert not os.path.exists(os.path.join(run, "checkpoints")), out
    assert_nodes_idle(lab)


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
