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


def test_node_0_names_the_root_cause_only_where_every_host_trains(tmp_path):
    """Where every host trains, the run goes through node 0's decision (with or without restarts): the same root
    cause on every host, by time; with one host, no watch, or only some hosts training, each host judges its own."""
    from test_hetero import JOB, write_job

    on = plan(tmp_path, TWO_HOSTS)
    assert on.verdict.on and not on.restarts.on
    assert f"cause:     {on.verdict.why}" in cli.describe(on, False).splitlines()
    assert json.loads(cli.describe(on, True))["root_cause"] == {"on": True, "why": on.verdict.why}
    assert "first failure in time" in on.verdict.why
    assert not plan(tmp_path, TWO_HOSTS, "--no-job-watch").verdict.on
    one = plan(tmp_path, ONE_HOST)
    assert not one.verdict.on and not any(line.startswith("cause:") for line in cli.describe(one, False).splitlines())
    for host in ("algo-1", "algo-3"):  # a training host and the data host of a heterogeneous job
        environ = write_job(str(tmp_path / host), JOB, host, {"sagemaker_distribution_instance_groups": ["train"]})
        some = plan(tmp_path, environ)
        assert some.watch.on and not some.verdict.on and "only some hosts train" in some.verdict.why
