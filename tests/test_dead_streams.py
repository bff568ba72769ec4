"""Every output path survives a dead stream: no traceback, the right exit code (issue 18, section 4).

The class: every subcommand and output path (``--help`` of each command, the dry run as text and as
JSON, ``bundle``, a bad-input line, the failure report at the end of a real run, ``simulate``'s
summary) times every state of the standard streams (stdout closed, stderr closed, stdout a pipe
whose reader has gone, stderr the same: ``ddp-launcher --help | head -1``).
"""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import PYTHON, REPO, assert_gone, free_port, launcher_env

FAIL_7 = "import sys\nprint('worker output', flush=True)\nsys.exit(7)\n"

COMMANDS = {  # name -> (argv after `python -m launcher`, the exit code it must give)
    "help": (["--help"], 0),
    "simulate help": (["simulate", "--help"], 0),
    "bundle help": (["bundle", "--help"], 0),
    "dry run": (["--platform", "local", "--dry-run", "fail7.py"], 0),
    "dry run json": (["--platform", "local", "--dry-run", "--json", "fail7.py"], 0),
    "bundle": (["bundle", "fail7.py", "--out", "bundle-out"], 0),
    "bad input": (["--nproc-per-node", "0", "fail7.py"], 2),
    "failure report": (["--platform", "local", "--nproc-per-node", "1", "fail7.py"], 7),
    "simulate summary": (["simulate", "--hosts", "1", "--network", "loopback", "--workdir", "sim", "--",
                          "fail7.py"], 7),
}
JOBS = {"failure report", "simulate summary"}  # these start torchrun: the job tier
STATES = ["stdout closed", "stderr closed", "stdout reader gone", "stderr reader gone"]


def run(tmp_path, argv, state):
    """Run ``python -m launcher argv`` with its standard streams in ``state``; (exit code, stderr seen)."""
    (tmp_path / "fail7.py").write_text(FAIL_7)
    env = launcher_env(LAUNCHER_MASTER_PORT=str(free_port()), TMPDIR=str(tmp_path))
    command = [PYTHON, "-m", "launcher", *argv]
    if state.endswith("closed"):
        fd = 1 if state.startswith("stdout") else 2
        command = ["sh", "-c", f'exec "$@" {fd}>&-', "sh", *command]
    proc = subprocess.Popen(command, cwd=str(tmp_path), env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    dead = {"stdout reader gone": proc.stdout, "stderr reader gone": proc.stderr}.get(state)
    if dead is not None:
        dead.close()  # the reader exits at once, before the launcher writes a byte
    alive = proc.stderr if dead is not proc.stderr else proc.stdout
    seen = alive.read().decode("utf-8", "replace")
    code = proc.wait(timeout=240)
    assert_gone([proc.pid])
    return code, seen


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.job) if n in JOBS else n for n in COMMANDS])
def test_every_output_path_survives_a_dead_stream(tmp_path, name, state):
    argv, expected = COMMANDS[name]
    code, seen = run(tmp_path, argv, state)
    # torchrun prints its own traceback of the worker's failure; none may come from the launcher
    assert f'File "{os.path.join(REPO, "launcher")}' not in seen and "Exception ignored" not in seen, seen[-3000:]
    assert code == expected, seen[-3000:]
    if name == "bundle":
        assert os.path.isfile(tmp_path / "bundle-out" / "fail7.py")
    if name == "failure report" and state.startswith("stdout"):  # the report still ends stderr
        assert seen.rstrip().splitlines()[-1].startswith("SystemExit: 7") or "exited with code 7" in seen, seen
