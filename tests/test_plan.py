"""The plan decides once: the job watch, hang detection and job-wide restarts, each on or off with its reason,
and the dry run says all three (``launcher.cli.decide``, ``launcher.cli.describe``)."""

from __future__ import annotations

import json

import pytest

from launcher import cli

TWO_HOSTS = {"SM_HOSTS": '["algo-1","algo-2"]', "SM_CURRENT_HOST": "algo-2"}
ONE_HOST = {"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1"}


def plan(tmp_path, environ, *args):
    script = tmp_path / "train.py"
    script.write_text("")
    return cli.plan(["--dry-run", *args, str(script)], environ, str(tmp_path / "run"))


@pytest.mark.parametrize(("environ", "args", "expected"), [
    (TWO_HOSTS, [], (True, True, False)),
    (TWO_HOSTS, ["--max-restarts", "3"], (True, True, True)),
    (TWO_HOSTS, ["--max-restarts", "3", "--no-job-watch"], (False, False, False)),
    (TWO_HOSTS, ["--max-restarts", "3", "--hang-timeout", "0"], (True, False, True)),
    (ONE_HOST, ["--max-restarts", "1", "--no-job-watch"], (False, True, True)),
    (ONE_HOST, ["--hang-timeout", "0"], (False, False, False)),
], ids=["default", "restarts", "no-watch", "no-hangs", "one-host", "one-host-nothing"])
def test_the_plan_decides_watch_hangs_and_restarts_once(tmp_path, environ, args, expected):
    p = plan(tmp_path, environ, *args)
    assert (p.watch.on, p.hangs.on, p.restarts.on) == expected
    assert (p.hang is not None) == p.hangs.on  # the timeouts exist exactly when hang detection is on
    data = json.loads(cli.describe(p, True))
    assert [data[k]["on"] for k in ("job_watch", "hangs", "restarts")] == list(expected)


def test_the_dry_run_states_the_restarts(tmp_path):
    on = cli.describe(plan(tmp_path, TWO_HOSTS, "--max-restarts", "3", "--restart-on", "worker_exit"), False)
    assert ("restarts:  on: up to 3 job-wide restart(s) in place, after a failure of class worker_exit; "
            "the workers resume from their checkpoint") in on.splitlines()
    assert "restarts:  off (--max-restarts 0)" in cli.describe(plan(tmp_path, TWO_HOSTS), False).splitlines()
    off = cli.describe(plan(tmp_path, TWO_HOSTS, "--max-restarts", "3", "--no-job-watch"), False).splitlines()
    assert "restarts:  off: with several hosts they need the job watch (node 0 decides for every host)" in off
    assert "hangs:     off: with several hosts it needs the job watch (--no-job-watch)" in off
    assert "watch:     off (--no-job-watch): a failed or lost host does not stop the others" in off
