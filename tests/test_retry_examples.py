"""The retry policies under examples/ retry the infrastructure's classes and never a user's failure.

SkyPilot's ``recover_on_exit_codes`` and the JobSet's ``podFailurePolicy`` are parsed and compared with
:mod:`launcher.codes`; the SLURM requeue script is run with ``srun`` and ``scontrol`` stand-ins that
write real outcome files and record the requeue.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess

import pytest
import yaml
from conftest import PYTHON, REPO, resolve_cluster

from launcher import codes, report
from launcher.options import parse_invocation

EXAMPLES = os.path.join(REPO, "examples")
# The infrastructure classes' codes: host_lost, rendezvous, and stopped by the platform's SIGTERM.
RETRIED = {codes.HOST_LOST_CODE, codes.RENDEZVOUS_CODE, 128 + signal.SIGTERM}
NEVER = {codes.BAD_INPUT_CODE, codes.INTERNAL_CODE, codes.HANG_CODE, codes.NO_PROGRESS_CODE, 1}


def load(name):
    with open(os.path.join(EXAMPLES, name)) as fh:
        return yaml.safe_load(fh)


def test_the_infrastructure_classes_are_the_retried_codes():
    assert {codes.HOST_LOST, codes.RENDEZVOUS, codes.STOPPED} == codes.INFRASTRUCTURE
    assert {report.code_of(k, 128 + signal.SIGTERM) for k in codes.INFRASTRUCTURE} == RETRIED


def test_skypilot_recovers_on_the_infrastructure_codes_only():
    recovery = load("skypilot-retry.yaml")["resources"]["job_recovery"]
    assert set(recovery["recover_on_exit_codes"]) == RETRIED and not NEVER & set(recovery["recover_on_exit_codes"])
    assert recovery["max_restarts_on_errors"] >= 1
    assert "--max-restarts 2" in load("skypilot-retry.yaml")["run"]  # in place first, new machines after


def test_the_jobset_fails_at_once_on_any_other_code(tmp_path):
    jobset = load("jobset-retry.yaml")
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    fail, ignore = job["podFailurePolicy"]["rules"]
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["operator"] == "NotIn"
    assert set(fail["onExitCodes"]["values"]) == RETRIED
    container = job["template"]["spec"]["containers"][0]
    assert fail["onExitCodes"]["containerName"] == container["name"]
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    # what each pod's launcher reads: the env platform, node ranks 0 and 1 of 2
    plain = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    ranks = []
    for index in range(job["completions"]):
        env = {**plain, "NODE_RANK": str(index)}
        words = shlex.split(container["command"][2].rsplit("exec ", 1)[1])  # bash -c "pip install ... && exec ..."
        assert words[:2] == ["python", "/opt/ddp/ddp-launcher.pyz"]
        options = parse_invocation(words[2:], {}).options
        assert options.max_restarts >= 1  # in place first (docs/recovery.md)
        ranks.append(resolve_cluster(env, options).node_rank)
    assert ranks == [0, 1]


STUB_SRUN = """#!/bin/bash
# srun for the test: every node's launcher ends as STUB_CLASSES says (class:code per node)
i=0
code=0
for item in $STUB_CLASSES; do
    "$STUB_PYTHON" "$STUB_WRITER" "$STUB_DIR/$i.json" "${item%%:*}" "${item##*:}"
    [ "${item##*:}" -gt "$code" ] && code=${item##*:}
    i=$((i + 1))
done
exit $code
"""
WRITER = """import sys, time
from launcher import report
path, klass, code = sys.argv[1], sys.argv[2], int(sys.argv[3])
verdict = report.Verdict(klass, code, root_cause="" if code == 0 else "algo-2 lost: no heartbeat for 3 s")
report.write_outcome(path, report.outcome_data(verdict, report.Clock(time.time()), "node", 0, 2, "slurm"))
"""


@pytest.mark.parametrize(("classes", "restarts", "requeued", "code"), [
    ("host_lost:137 host_lost:137", 0, True, 0),
    ("worker_exit:7 host_lost:137", 0, True, 0),  # one node lost: the job is the infrastructure's
    ("worker_exit:7 worker_exit:7", 0, False, 7),
    ("worker_signal:137 worker_signal:137", 0, False, 137),  # a SIGKILL: 137, not retried
    ("out_of_memory:137 out_of_memory:137", 0, False, 137),  # the OOM killer: not retried either
    ("success:0 success:0", 0, False, 0),
    ("no_progress:93 no_progress:93", 0, False, 93),  # restarting in place did not help: never requeued
    ("rendezvous:75 rendezvous:75", 3, False, 75),  # the requeues are used up
])
def test_the_slurm_script_requeues_infrastructure_failures_only(tmp_path, classes, restarts, requeued, code):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(STUB_SRUN)
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.log\n')
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    (tmp_path / "writer.py").write_text(WRITER)
    run = tmp_path / "run"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": PYTHON,
           "RUN": str(run), "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": str(restarts), "STUB_CLASSES": classes,
           "STUB_DIR": str(run / "outcomes" / f"42-{restarts}"), "STUB_PYTHON": PYTHON,
           "STUB_WRITER": str(tmp_path / "writer.py"), "PYTHONPATH": REPO}
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, "slurm_requeue.sbatch")], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stdout + proc.stderr
    log = tmp_path / "scontrol.log"
    assert (log.read_text() == "requeue 42\n") if requeued else not log.exists(), proc.stdout
    outcomes = [json.loads(p.read_text()) for p in (run / "outcomes" / f"42-{restarts}").iterdir()]
    assert len(outcomes) == 2
