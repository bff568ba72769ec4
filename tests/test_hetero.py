"""SageMaker heterogeneous clusters: which instance groups train, what the other hosts run, the watch.

Unit level: the platform reading ``resourceconfig.json`` files of generated heterogeneous jobs
(hypothesis: every host of a job agrees on the training world, its ranks and master, and the watch's
node numbers), the precedence of the training groups' sources, the bad configurations (exit 2, one
line, real ``python -m launcher``), the dry run of every host, the launch of a host outside the
training world, the job watch's ``end``, and simulate's trees checked against AWS's own toolkit.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Optional

import pytest
from conftest import PYTHON, free_port, launcher_env, resolve_cluster
from hypothesis import given, settings
from hypothesis import strategies as st
from test_jobwatch import Recorder, until

from launcher import groups, jobwatch
from launcher.errors import ConfigError
from launcher.options import parse_invocation, parse_names
from launcher.outcome import Outcome
from launcher.platforms.sagemaker import argv as aws_argv
from launcher.simulate.hosts.sagemaker_files import resource_config
from launcher.simulate.hosts.sagemaker_groups import assign_hosts, parse_instance_groups


def write_job(base: str, groups_: list[tuple[str, str, list[str]]], current: str,
              hyperparameters: Optional[dict[str, Any]] = None, shuffle: bool = True) -> dict[str, str]:
    """One host's SageMaker tree (config files only) as SageMaker writes it; returns the environment."""
    hosts = [h for _n, _t, members in groups_ for h in members]
    config = resource_config(hosts, current, "ml.m5.xlarge", "eth0", groups_) if current in hosts else {
        **resource_config(hosts, hosts[0], "ml.m5.xlarge", "eth0", groups_), "current_host": current}
    if shuffle:  # a group's host list is not sorted
        for group in config["instance_groups"]:
            group["hosts"] = list(reversed(group["hosts"]))
    os.makedirs(os.path.join(base, "input", "config"), exist_ok=True)
    with open(os.path.join(base, "input", "config", "resourceconfig.json"), "w") as fh:
        json.dump(config, fh)
    if hyperparameters is not None:
        with open(os.path.join(base, "input", "config", "hyperparameters.json"), "w") as fh:
            json.dump({k: json.dumps(v) for k, v in hyperparameters.items()}, fh)
    return {"SAGEMAKER_BASE_DIR": base}


def options_for(*argv: str) -> Any:
    return parse_invocation([*argv, "train.py"], {}).options


JOB = [("train", "ml.g5.xlarge", ["algo-1", "algo-2"]), ("data", "ml.c5.xlarge", ["algo-3"])]


# ------------------------------------------------------------------------------------------------
# The training world, on every host of generated jobs
# ------------------------------------------------------------------------------------------------

@st.composite
def jobs(draw: Any) -> tuple[list[tuple[str, str, list[str]]], list[str]]:
    """1-5 groups of 1-4 hosts (names that sort differently as text and as numbers), and the training groups."""
    count = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 4), min_size=count, max_size=count))
    numbers = draw(st.permutations(list(range(1, sum(sizes) + 1))))
    made, start = [], 0
    for i, size in enumerate(sizes):
        made.append((f"g{i}", f"ml.c5.{i}xlarge", [f"algo-{n}" for n in numbers[start:start + size]]))
        start += size
    training = draw(st.lists(st.sampled_from([g[0] for g in made]), min_size=1, unique=True))
    return made, training


@settings(max_examples=30, deadline=None)
@given(jobs())
def test_every_host_agrees_on_the_training_world_and_the_watch(tmp_path_factory: Any, job: Any) -> None:
    made, training = job
    every = sorted(h for _n, _t, members in made for h in members)
    train = sorted(h for name, _t, members in made if name in training for h in members)
    base = str(tmp_path_factory.mktemp("job"))
    places = []
    for host in every:
        env = write_job(os.path.join(base, host), made, host)
        cluster = resolve_cluster(env, options_for("--instance-groups", ",".join(training)))
        assert list(cluster.hosts) == train and cluster.nnodes == len(train)
        assert cluster.master_addr == train[0]
        assert cluster.node_rank == (train.index(host) if host in train else -1)
        if len(made) == 1:
            assert cluster.role is None
            continue
        role = cluster.role
        assert role is not None and role.trains == (host in train) and list(role.job_hosts) == every
        assert role.group == next(name for name, _t, members in made if host in members)
        env_vars = dict(role.env)
        if role.trains:
            assert env_vars == {}
        else:
            assert env_vars["MASTER_ADDR"] == train[0] and env_vars["SM_CURRENT_INSTANCE_GROUP"] == role.group
            assert not groups.RANK_VARIABLES & set(env_vars)
        places.append(groups.watch_place(cluster))
    if len(made) > 1:
        assert sorted(node for node, _n, _hub in places) == list(range(len(every)))
        assert {(nnodes, hub) for _node, nnodes, hub in places} == {(len(every), every[0])}


def test_the_training_groups_come_from_the_option_else_sdk2_else_every_group(tmp_path: Any) -> None:
    env = write_job(str(tmp_path), JOB, "algo-3", {"sagemaker_distribution_instance_groups": ["data"]})
    by_option = resolve_cluster(env, options_for("--instance-groups", "train"))
    assert by_option.hosts == ("algo-1", "algo-2") and not by_option.role.trains
    assert "named by --instance-groups" in by_option.role.why
    by_sdk = resolve_cluster(env)
    assert by_sdk.hosts == ("algo-3",) and by_sdk.role.trains and by_sdk.node_rank == 0
    assert "sagemaker_distribution_instance_groups" in by_sdk.role.why
    write_job(str(tmp_path), JOB, "algo-3", {"epochs": 1})
    every = resolve_cluster(env)
    assert every.hosts == ("algo-1", "algo-2", "algo-3") and every.role.trains
    assert every.role.why.startswith("every group trains")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(st.characters(categories=["L", "N"], include_characters="-_."), min_size=1, max_size=12),
                min_size=1, max_size=5, unique=True))
def test_group_names_read_back_as_aws_renders_them(names: list[str]) -> None:
    # AWS's toolkit renders a list hyperparameter with str(); SDK 3.x with JSON; a person writes a,b.
    rendered = aws_argv.render_args({"launcher-instance-groups": names})[1]
    assert parse_names(rendered) == tuple(names)
    assert parse_names(json.dumps(names)) == tuple(names)
    if not any("," in n or n != n.strip() for n in names):
        assert parse_names(",".join(names)) == tuple(names)


@pytest.mark.parametrize("text", ["", ",", "[]", "[1]", "a,a", "['a', 'a']", "[", "a, ,b"])
def test_bad_group_names_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_names(text)


# ------------------------------------------------------------------------------------------------
# Bad configurations: exit 2, one line, nothing started
# ------------------------------------------------------------------------------------------------

BAD = {
    "an unknown group": (JOB, "algo-1", ["--instance-groups", "gpu"], None,
                         "names instance group 'gpu', which this job does not have"),
    "an unknown group from SDK 2.x": (JOB, "algo-1", [], {"sagemaker_distribution_instance_groups": ["gpu"]},
                                      "sagemaker_distribution_instance_groups names instance group 'gpu'"),
    "a training group without hosts": ([("train", "ml.g5.xlarge", []), ("data", "ml.c5.xlarge", ["algo-1"])],
                                       "algo-1", ["--instance-groups", "train"], None,
                                       "training instance group 'train' has no host"),
    "the current host in no group": ([("train", "ml.g5.xlarge", ["algo-1"]), ("data", "ml.c5.xlarge", ["algo-2"])],
                                     "algo-3", ["--instance-groups", "train"], None,
                                     "current host 'algo-3' is in no instance group"),
    "a one-group platform": (None, "", ["--instance-groups", "train"], None,
                             "--instance-groups 'train': local jobs have no instance groups"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_configuration_exits_2_with_one_line(tmp_path: Any, case: str) -> None:
    made, current, args, hps, message = BAD[case]
    env = launcher_env()
    if made is not None:
        hosts = sorted(h for _n, _t, members in made for h in members)
        env.update(write_job(str(tmp_path), made, current, hps))
        if current not in hosts:  # SageMaker lists the current host in hosts; here no group has it
            path = tmp_path / "input" / "config" / "resourceconfig.json"
            config = json.loads(path.read_text())
            config["hosts"] = sorted([*config["hosts"], current])
            path.write_text(json.dumps(config))
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    done = subprocess.run([PYTHON, "-m", "launcher", *args, str(script)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "must not run" not in done.stderr + done.stdout


# ------------------------------------------------------------------------------------------------
# What each host does: the dry run, the launch outside the training world, its exit code
# ------------------------------------------------------------------------------------------------

def test_the_dry_run_of_every_host_says_which_group_trains_and_why(tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    seen = {}
    for host in ("algo-1", "algo-2", "algo-3"):
        env = launcher_env(LAUNCHER_INSTANCE_GROUPS="train",
                           **write_job(str(tmp_path / host), JOB, host))
        out = subprocess.run([PYTHON, "-m", "launcher", "--dry-run", str(script)], env=env, capture_output=True,
                             text=True, timeout=60, check=True).stdout
        seen[host] = out
        assert "training groups train named by --instance-groups (hyperparameter launcher-instance-groups)" in out
    assert "node 0 of 2, master algo-1:7777" in seen["algo-1"] and "torch.distributed.run" in seen["algo-1"]
    assert "this host listens on port " in seen["algo-1"]
    assert "node 1 of 2" in seen["algo-2"] and "connects to algo-1:" in seen["algo-2"]
    assert "connects to algo-1:" in seen["algo-3"]  # the hub is on the job's first host
    outside = seen["algo-3"]
    assert "outside the training world of 2 node(s)" in outside and "torch.distributed.run" not in outside
    assert "MASTER_ADDR=algo-1" in outside and "SM_CURRENT_INSTANCE_GROUP=data" in outside
    assert "RANK=" not in outside.replace("MASTER_", "")


def test_a_host_outside_the_training_world_runs_the_script_with_no_rank(tmp_path: Any) -> None:
    env = write_job(str(tmp_path), JOB, "algo-3")
    options = options_for("--instance-groups", "train", "--master-port", "4000", "--resolve", "algo-1=10.0.0.1")
    cluster = resolve_cluster(env, options)
    inherited = {"RANK": "5", "WORLD_SIZE": "9", "PET_NNODES": "2", "SM_CURRENT_INSTANCE_GROUP": "data",
                 "SM_HOSTS": "kept-by-the-toolkit"}
    launch = groups.script_launch(cluster, options, "train.py", ["--lr", "1"], inherited, str(tmp_path), "py")
    assert launch.argv == ("py", "train.py", "--lr", "1")
    env_after = launch.environment(inherited)
    assert {"RANK", "WORLD_SIZE", "PET_NNODES"} & set(env_after) == set()
    assert env_after["MASTER_ADDR"] == "10.0.0.1" and env_after["MASTER_PORT"] == "4000"
    assert env_after["SM_HOSTS"] == "kept-by-the-toolkit" and env_after["SM_IS_HETERO"] == "true"
    assert json.loads(env_after["SM_CURRENT_INSTANCE_GROUP_HOSTS"]) == ["algo-3"]


@pytest.mark.parametrize("returncode, stop, after_grace, ended, code", [
    (0, None, False, False, 0), (3, None, False, False, 3), (-9, None, False, False, 137),
    (0, 15, False, True, 0), (-15, 15, False, True, 0), (4, 15, False, True, 4), (-9, 15, True, True, 137),
    (-15, 15, False, False, 143), (0, 15, False, False, 0)])
def test_the_exit_code_outside_the_training_world(returncode: int, stop: Optional[int], after_grace: bool,
                                                   ended: bool, code: int) -> None:
    outcome = Outcome(returncode, 1, stop, after_grace)
    assert groups.exit_code(outcome, ended) == code
    if stop and not ended:  # stopped because another host failed: never a success
        assert groups.exit_code(outcome, ended, stopped_by_failure=True) == (code or 128 + stop)


# ------------------------------------------------------------------------------------------------
# The job watch: the training world's end stops the other hosts, and that is no failure
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hub_trains", [True, False])
def test_the_training_worlds_end_stops_the_other_hosts(hub_trains: bool) -> None:
    port, started = free_port(), []
    training = frozenset({0, 1}) if hub_trains else frozenset({1, 2})
    try:
        recs = []
        for node in range(3):
            rec = Recorder()
            # no loss is tested here: a loss timeout a starved test process cannot reach (1.5 s could: the fast
            # tier once lost a trainer that way, and the training world's end never came)
            watch = jobwatch.start(node, f"algo-{node + 1}", 3, "127.0.0.1", port, 60.0, 30.0, rec.log,
                                   training=training)
            assert watch is not None
            watch.attach(rec.stop)
            started.append(watch)
            recs.append(rec)
        until(lambda: len(started[0].states) == 2)
        outside = ({0, 1, 2} - training).pop()
        trainers = sorted(training - {0}) + ([0] if 0 in training else [])  # the hub finishes last
        finishing = [n for n in trainers if n != 0]
        for node in finishing:
            assert started[node].finish(0, "", True) is None  # no failure or loss anywhere: no root cause
        if 0 in training:
            import threading

            hub_done = threading.Thread(target=started[0].finish, args=(0, "", True))
            hub_done.start()
        until(lambda: recs[outside].stops != [])
        grace, why = recs[outside].stops[0]
        assert grace == float("inf") and "the training world has ended" in why
        assert started[outside].training_ended and started[outside].cause() is None
        if outside != 0:
            assert started[outside].finish(0, "", True) is None  # no failure or loss anywhere: no root cause
        else:
            assert started[0].finish(0, "", True) is None  # no failure or loss anywhere: no root cause
        if 0 in training:
            hub_done.join(timeout=10)
            assert not hub_done.is_alive()
        assert all(not started[n].training_ended for n in training)
        assert all(r.stops == [] for i, r in enumerate(recs) if i != outside)
    finally:
        for watch in started:
            watch.close()
            assert not watch.thread.is_alive()


# ------------------------------------------------------------------------------------------------
# simulate --instance-groups: AWS's tree, checked against AWS's own toolkit
# ------------------------------------------------------------------------------------------------

TOOLKIT = """
import json
from sagemaker_training import environment
env = environment.Environment()
print(json.dumps(env.to_env_vars()))
"""


def test_simulated_trees_are_what_aws_toolkit_reads(tmp_path: Any) -> None:
    from launcher.simulate.hosts.sagemaker_env import toolkit_env

    made = assign_hosts(parse_instance_groups("train=ml.g5.xlarge:2,data=ml.c5.xlarge:1", 64),
                        ["algo-1", "algo-2", "algo-3"])
    assert made == (("train", "ml.g5.xlarge", ("algo-1", "algo-2")), ("data", "ml.c5.xlarge", ("algo-3",)))
    hps = {"sagemaker_program": '"launch.py"', "launcher-instance-groups": '["train"]'}
    for host in ("algo-2", "algo-3"):
        base = str(tmp_path / host)
        config = resource_config(["algo-1", "algo-2", "algo-3"], host, "ml.m5.xlarge", "eth0", made)
        assert config["instance_groups"][0]["hosts"][0] == host  # the current group first, the host first
        os.makedirs(os.path.join(base, "input", "config"))
        for name, content in (("resourceconfig", config), ("hyperparameters", hps), ("inputdataconfig", {})):
            with open(os.path.join(base, "input", "config", f"{name}.json"), "w") as fh:
                json.dump(content, fh)
        env = launcher_env(SAGEMAKER_BASE_DIR=base, TRAINING_JOB_NAME="job")
        theirs = json.loads(subprocess.run([PYTHON, "-c", TOOLKIT], env=env, capture_output=True, text=True,
                                           timeout=60, check=True).stdout.strip().splitlines()[-1])
        ours = toolkit_env(base, config, {}, hps, "job")
        for name in ("SM_CURRENT_INSTANCE_GROUP", "SM_CURRENT_INSTANCE_GROUP_HOSTS", "SM_INSTANCE_GROUPS",
                     "SM_INSTANCE_GROUPS_DICT", "SM_DISTRIBUTION_INSTANCE_GROUPS", "SM_IS_HETERO",
                     "SM_CURRENT_INSTANCE_TYPE", "SM_HOSTS", "SM_CURRENT_HOST", "SM_RESOURCE_CONFIG"):
            assert ours[name] == theirs[name], name
        # What the launcher gives a script outside the training world is what the toolkit would say.
        cluster = resolve_cluster({"SAGEMAKER_BASE_DIR": base}, options_for("--instance-groups", "train"))
        if not cluster.role.trains:
            for name, value in cluster.role.env:
                if name.startswith("SM_"):
                    assert theirs[name] == value, name


@pytest.mark.parametrize("text, message", [
    ("train", "is not NAME=ml.TYPE:COUNT"), ("train=ml.g5.xlarge:0", "needs at least 1 instance"),
    ("a=ml.c5.xlarge:1,a=ml.c5.xlarge:1", "given twice"), ("train=g5.xlarge:1", "is not NAME=ml.TYPE:COUNT"),
    (",".join(f"g{i}=ml.c5.xlarge:1" for i in range(6)), "at most 5 groups"), ("a=ml.c5.xlarge:70", "more than 64"),
])
def test_bad_simulated_groups_are_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_instance_groups(text, 64)


# ------------------------------------------------------------------------------------------------
# Garbage in the group fields: a cluster or one bounded line, never another exception
# ------------------------------------------------------------------------------------------------

_names = st.sampled_from(["train", "data", "", " ", "x" * 300])
_groups = st.one_of(st.none(), st.text(max_size=5), st.integers(), st.lists(st.one_of(
    st.fixed_dictionaries({}, optional={
        "instance_group_name": st.one_of(_names, st.integers(), st.none()),
        "instance_type": st.one_of(st.text(max_size=5), st.integers(), st.none()),
        "hosts": st.one_of(st.lists(st.sampled_from(["algo-1", "algo-2", "algo-9", ""]), max_size=3),
                           st.text(max_size=3), st.none())}),
    st.integers(), st.none()), max_size=3))


@settings(max_examples=300, deadline=None)
@given(groups_=_groups, current=st.sampled_from(["algo-1", "algo-2"]),
       distribution=st.one_of(st.none(), st.just('["train"]'), st.just('"data,train"'), st.just("[1]"),
                              st.just("{"), st.just('["gpu"]')),
       chosen=st.one_of(st.none(), st.just("train"), st.just("data,train"), st.just("gpu")))
def test_group_fields_give_a_cluster_or_one_line(tmp_path_factory: Any, groups_: Any, current: str,
                                                  distribution: Optional[str], chosen: Optional[str]) -> None:
    base = tmp_path_factory.mktemp("fuzz")
    (base / "input" / "config").mkdir(parents=True)
    config = {"hosts": ["algo-1", "algo-2"], "current_host": current, "current_group_name": "train"}
    if groups_ is not None:
        config["instance_groups"] = groups_
    (base / "input" / "config" / "resourceconfig.json").write_text(json.dumps(config))
    if distribution is not None:
        (base / "input" / "config" / "hyperparameters.json").write_text(
            json.dumps({"sagemaker_distribution_instance_groups": distribution}))
    options = options_for(*(["--instance-groups", chosen] if chosen else []))
    try:
        cluster = resolve_cluster({"SAGEMAKER_BASE_DIR": str(base)}, options)
    except ConfigError as err:
        assert "\n" not in str(err) and len(str(err)) < 700
        return
    assert cluster.nnodes == len(cluster.hosts) >= 1 and list(cluster.hosts) == sorted(cluster.hosts)
    if cluster.role is None or cluster.role.trains:
        assert cluster.hosts[cluster.node_rank] == current
    else:
        assert cluster.node_rank == -1 and current not in cluster.hosts and current in cluster.role.job_hosts
