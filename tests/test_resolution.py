"""Unit tests: files and variables -> options, cluster, torchrun command. Pure functions, no processes."""

from __future__ import annotations

import json
import os

import conftest
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher import cli, command
from launcher.errors import ConfigError
from launcher.options import SPECS, parse_bool, parse_invocation
from launcher.platforms import sagemaker
from launcher.platforms.base import HostView
from launcher.platforms.sagemaker import argv as aws_argv


def resolve_cluster(environ, nproc=None, dev_dir="/dev"):
    """The chosen platform's cluster, with ``--nproc-per-node nproc`` when given."""
    options = parse_invocation(([f"--nproc-per-node={nproc}"] if nproc else []) + ["t.py"], {}).options
    return conftest.resolve_cluster(environ, options, dev_dir)


def write_tree(base, hosts, current, **extra):
    config = os.path.join(base, "input", "config")
    os.makedirs(config, exist_ok=True)
    with open(os.path.join(config, "resourceconfig.json"), "w") as fh:
        json.dump({"current_host": current, "hosts": hosts, "network_interface_name": "eth0",
                   "current_instance_type": "ml.p4d.24xlarge", **extra}, fh)
    return {"SAGEMAKER_BASE_DIR": str(base)}


# --- hosts, ranks, master ----------------------------------------------------------------------

@pytest.mark.parametrize("current", ["algo-1", "algo-2", "algo-10"])
def test_host_order_is_the_same_everywhere(tmp_path, current):
    # The file's order differs per host; string order is what every host computes.
    hosts = {"algo-1": ["algo-2", "algo-10", "algo-1"], "algo-2": ["algo-10", "algo-1", "algo-2"],
             "algo-10": ["algo-1", "algo-2", "algo-10"]}[current]
    env = write_tree(tmp_path, hosts, current)
    cluster = resolve_cluster(env, dev_dir=str(tmp_path))
    assert cluster.hosts == ("algo-1", "algo-10", "algo-2")
    assert cluster.master_addr == "algo-1"
    assert cluster.nnodes == 3
    assert cluster.node_rank == {"algo-1": 0, "algo-10": 1, "algo-2": 2}[current]
    assert cluster.network_interface == "eth0"
    assert sagemaker.PLATFORM.report_path(env) == str(tmp_path / "output" / "failure")


def test_resourceconfig_wins_over_sm_hosts(tmp_path):
    env = write_tree(tmp_path, ["algo-1", "algo-2"], "algo-2")
    env.update(SM_HOSTS='["x-1"]', SM_CURRENT_HOST="x-1")
    assert resolve_cluster(env, dev_dir=str(tmp_path)).node_rank == 1


def test_sm_hosts_fallback(tmp_path):
    env = {"SAGEMAKER_BASE_DIR": str(tmp_path), "SM_HOSTS": '["algo-2","algo-1"]',
           "SM_CURRENT_HOST": "algo-2", "SM_NETWORK_INTERFACE_NAME": "ens5"}
    cluster = resolve_cluster(env, dev_dir=str(tmp_path))
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr) == (2, 1, "algo-1")
    assert cluster.network_interface == "ens5"


def test_sdk_v3_variables(tmp_path):
    env = {"SAGEMAKER_BASE_DIR": str(tmp_path), "SM_HOST_COUNT": "4", "SM_CURRENT_HOST_RANK": "3",
           "SM_MASTER_ADDR": "algo-1"}
    cluster = resolve_cluster(env, dev_dir=str(tmp_path))
    assert (cluster.nnodes, cluster.node_rank, cluster.master_addr, cluster.current_host) == \
        (4, 3, "algo-1", "algo-4")


@pytest.mark.parametrize("env, expected", [
    ({"SM_NUM_GPUS": "8"}, 8),
    ({"SM_NUM_GPUS": "0"}, 1),
    ({"SM_NUM_GPUS": "0", "SM_NUM_NEURONS": "32"}, 32),
    ({"SM_NUM_GPUS": "4", "SM_NUM_NEURONS": "32"}, 4),
    ({}, 1),
])
def test_processes_per_node(tmp_path, env, expected):
    base = write_tree(tmp_path, ["algo-1"], "algo-1")
    assert resolve_cluster({**base, **env}, dev_dir=str(tmp_path)).nproc_per_node == expected


def test_processes_per_node_option_wins_and_devices_count(tmp_path):
    base = write_tree(tmp_path, ["algo-1"], "algo-1")
    assert resolve_cluster({**base, "SM_NUM_GPUS": "8"}, 3, dev_dir=str(tmp_path)).nproc_per_node == 3
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    assert resolve_cluster(base, dev_dir=str(dev)).nproc_per_node == 2


def test_local_platform_without_any_cluster(tmp_path):
    cluster = resolve_cluster({}, dev_dir=str(tmp_path))
    assert (cluster.platform, cluster.nnodes, cluster.node_rank, cluster.nproc_per_node) == ("local", 1, 0, 1)


@pytest.mark.parametrize("content, needle", [
    ("{not json", "malformed JSON in"),
    ('{"current_host": "algo-3", "hosts": ["algo-1", "algo-2"]}', "current host 'algo-3' is not in"),
    ('{"current_host": "algo-1", "hosts": []}', "empty or not a list"),
    ('{"current_host": "algo-1", "hosts": ["algo-1", "algo-1"]}', "duplicate host 'algo-1'"),
    ('{"current_host": "algo-1", "hosts": ["algo-1", ""]}', "empty or non-text host name ''"),
    ('["algo-1"]', "expected a JSON object"),
])
def test_bad_resourceconfig(tmp_path, content, needle):
    config = tmp_path / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text(content)
    with pytest.raises(ConfigError) as err:
        resolve_cluster({"SAGEMAKER_BASE_DIR": str(tmp_path)}, dev_dir=str(tmp_path))
    assert needle in str(err.value)
    assert "resourceconfig.json" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("env, needle", [
    ({"SM_HOSTS": "algo-1", "SM_CURRENT_HOST": "algo-1"}, "SM_HOSTS is not a JSON list of host names: 'algo-1'"),
    ({"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-9"}, "current host 'algo-9'"),
    ({"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1", "SM_NUM_GPUS": "two"},
     "SM_NUM_GPUS is not a whole number: 'two'"),
    ({"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1", "SM_NUM_GPUS": "-1"}, "SM_NUM_GPUS must be >= 0: '-1'"),
    ({"SM_HOST_COUNT": "2", "SM_CURRENT_HOST_RANK": "2"}, "SM_CURRENT_HOST_RANK must be 0-1"),
    ({"SM_HOST_COUNT": "x"}, "SM_HOST_COUNT is not a whole number: 'x'"),
    ({"TRAINING_JOB_NAME": "job"}, "without a host list"),
    ({"TORCHELASTIC_RUN_ID": "abc", "LOCAL_RANK": "0"}, "already inside a torchrun worker"),
])
def test_bad_variables(tmp_path, env, needle):
    with pytest.raises(ConfigError) as err:
        resolve_cluster({"SAGEMAKER_BASE_DIR": str(tmp_path), **env}, dev_dir=str(tmp_path))
    assert needle in str(err.value)


# --- options ----------------------------------------------------------------------------------

def test_positional_form_passes_script_args_untouched():
    inv = parse_invocation(["--nproc-per-node", "2", "train.py", "--lr", "0.1", "--name", "a b", "--nproc-per-node",
                            "9"], {})
    assert inv.script == "train.py"
    assert inv.script_args == ("--lr", "0.1", "--name", "a b", "--nproc-per-node", "9")
    assert inv.options.nproc_per_node == 2


@pytest.mark.parametrize("flag", ["--train-script", "--train_script"])
def test_sagemaker_form_in_either_spelling(flag):
    # AWS's argv: --key value pairs; the launcher's keys are train-script and launcher-*/launcher_*.
    argv = ["-b", "3", "--cfg", "a=1", "--epochs", "10", "--flag", "True", "--launcher-master-port", "2345",
            "--launcher_grace_period", "30", "--name", "a b", flag, "train.py", "--x", ""]
    inv = parse_invocation(argv, {})
    assert aws_argv.is_pairs_form(argv) and inv.script == "train.py"
    assert inv.script_args == ("-b", "3", "--cfg", "a=1", "--epochs", "10", "--flag", "True", "--name", "a b",
                               "--x", "")
    assert inv.options.grace_period == 30.0 and inv.options.master_port == 2345


def test_boolean_options_take_sagemaker_spelling():
    inv = parse_invocation(["--epochs", "1", "--launcher-dry-run", "False", "--launcher_json", "True",
                            "--train-script", "t.py"], {})
    assert inv.options.dry_run is False and inv.options.json is True
    assert inv.script_args == ("--epochs", "1")
    inv = parse_invocation(["--dry-run", "False", "--json", "t.py", "--epochs", "1"], {})  # the plain form
    assert inv.options.dry_run is False and inv.options.json is True and inv.script_args == ("--epochs", "1")
    assert [parse_bool(t) for t in ("True", "false", "1", "0")] == [True, False, True, False]


def test_environment_supplies_options_and_flags_win():
    env = {"LAUNCHER_MASTER_PORT": "4000", "LAUNCHER_RESOLVE": "algo-1=127.0.0.1,algo-2=127.0.0.2",
           "LAUNCHER_GRACE_PERIOD": "5"}
    inv = parse_invocation(["--grace-period", "7", "t.py"], env)
    assert inv.options.master_port == 4000 and inv.options.grace_period == 7.0
    assert inv.options.resolve == {"algo-1": "127.0.0.1", "algo-2": "127.0.0.2"}
    assert {s.env for s in SPECS} >= {"LAUNCHER_TRAIN_SCRIPT", "LAUNCHER_NPROC_PER_NODE"}


@pytest.mark.parametrize("argv, env, needle", [
    (["--master-port", "99999", "t.py"], {}, "invalid value for --master-port: '99999'"),
    (["--nproc-per-node", "0", "t.py"], {}, "invalid value for --nproc-per-node: '0'"),
    (["--grace-period", "-1", "t.py"], {}, "invalid value for --grace-period: '-1'"),
    (["--resolve", "algo-1", "t.py"], {}, "invalid value for --resolve: 'algo-1'"),
    (["--bogus", "t.py"], {}, "unknown launcher option '--bogus'"),
    (["--max-restarts"], {}, "option --max-restarts needs a value"),
    ([], {}, "no training script"),
    (["t.py"], {"LAUNCHER_MASTER_PORT": "abc"}, "invalid value for LAUNCHER_MASTER_PORT: 'abc'"),
    (["--train-script="], {}, "invalid value for --train-script: ''"),
])
def test_bad_options(argv, env, needle):
    with pytest.raises(ConfigError) as err:
        parse_invocation(argv, env)
    assert needle in str(err.value)


# --- hyperparameters --------------------------------------------------------------------------

SDK_V2_FILE = {  # what SDK v2 writes to hyperparameters.json: every value JSON-encoded
    "epochs": "10", "flag": "true", "name": '"a b"', "cfg": '{"a": 1, "b": "x"}', "b": "3",
    "layers": "[1, 2]", "none": "null", "train-script": '"train.py"',
    "sagemaker_program": '"launch.py"', "sagemaker_submit_directory": '"s3://b/k/sourcedir.tar.gz"',
    "sagemaker_region": '"us-east-1"', "_tuning_objective_metric": '"loss"',
}
AWS_ARGV = ["-b", "3", "--cfg", "a=1,b=x", "--epochs", "10", "--flag", "True", "--layers", "[1, 2]",
            "--name", "a b", "--none", "", "--train-script", "train.py"]


def test_render_matches_aws_toolkit():
    from sagemaker_training import mapping  # AWS's real implementation

    user = aws_argv.user_hyperparameters(aws_argv.decode(SDK_V2_FILE))
    assert aws_argv.render_args(user) == AWS_ARGV
    assert mapping.to_cmd_args(user) == AWS_ARGV


def test_render_one_letter_and_contract_example():
    hps = {"epochs": 10, "flag": True, "name": "a b", "cfg": {"a": 1}, "b": 3}
    assert aws_argv.render_args(hps) == \
        ["-b", "3", "--cfg", "a=1", "--epochs", "10", "--flag", "True", "--name", "a b"]


def test_split_argv_is_repaired_and_intact_argv_is_not():
    split = " ".join(AWS_ARGV).split()
    assert aws_argv.repair_split_argv(split, SDK_V2_FILE) == AWS_ARGV
    assert aws_argv.repair_split_argv(AWS_ARGV, SDK_V2_FILE) is None
    assert aws_argv.repair_split_argv(["t.py", "--other"], SDK_V2_FILE) is None


def test_plan_repairs_split_argv_and_says_so(tmp_path, monkeypatch):
    env = write_tree(tmp_path, ["algo-1"], "algo-1")
    (tmp_path / "input" / "config" / "hyperparameters.json").write_text(json.dumps(SDK_V2_FILE))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    p = cli.plan(" ".join(AWS_ARGV).split(), env, run_dir=str(tmp_path / "run"))
    assert p.invocation.script == "train.py"
    assert list(p.invocation.script_args) == [a for a in AWS_ARGV if a not in ("--train-script", "train.py")]
    assert any("split at spaces" in n for n in p.notes)


# --- torchrun command -------------------------------------------------------------------------

def plan_for(tmp_path, hosts, current, argv, extra_env=None, sys_dir=None):
    env = {**write_tree(tmp_path, hosts, current), **(extra_env or {})}
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    inv = parse_invocation([*argv, str(script), "--lr", "0.1"], env)
    cluster = conftest.resolve_cluster(env, inv.options, dev_dir=str(tmp_path))
    fabric = sagemaker.PLATFORM.fabric_env(cluster, HostView(sys_dir=sys_dir or str(tmp_path)))
    return command.build_launch(cluster, inv.options, inv.script, inv.script_args, env, "/run",
                                fabric, python="python3")


TORCHRUN_LIKE = ["--start", "--master", "--nnodes", "--max-restarts", "--master-port", "--", "-m", "--no-python",
                 "--log", "--rdzv", "--node", "-r", "-t", "--standalone=1", "--tee", "-h", "--help"]


@settings(max_examples=200, deadline=None)
@given(args=st.lists(st.sampled_from(TORCHRUN_LIKE) | st.text(min_size=0, max_size=12), max_size=8),
       hosts=st.sampled_from([["algo-1"], ["algo-1", "algo-2"]]))
def test_torchrun_hands_the_script_every_argument_as_given(tmp_path_factory, args, hosts):
    """torchrun's own parser, fed the command the launcher builds: its script is the bootstrap, and the user's
    script gets every argument untouched, whatever it looks like (an abbreviation of two torchrun options,
    one of torchrun's own flags, ``--``); a restart's new port changes torchrun's flag, never the script's."""
    from torch.distributed.run import get_args_parser

    tmp_path = tmp_path_factory.mktemp("cmd")
    env = write_tree(tmp_path, hosts, hosts[-1])
    inv = parse_invocation(["train.py", *args], env)
    cluster = conftest.resolve_cluster(env, inv.options, dev_dir=str(tmp_path))
    assert list(inv.script_args) == args
    launch = command.build_launch(cluster, inv.options, inv.script, inv.script_args, env, "/run", python="python3")
    for argv in (launch.argv, command.for_generation(launch, 1025, 1).argv):
        parsed = get_args_parser().parse_args(list(argv[3:]))
        assert parsed.training_script == command.BOOTSTRAP
        assert parsed.training_script_args == ["train.py", *args]


def test_multi_node_command_uses_static_rendezvous(tmp_path):
    launch = plan_for(tmp_path, ["algo-2", "algo-1"], "algo-2",
                      ["--nproc-per-node", "2", "--rdzv-timeout", "60", "--resolve",
                       "algo-1=10.0.0.1,algo-2=10.0.0.2"], {"TRAINING_JOB_NAME": "job-1"})
    argv = list(launch.argv)
    def flag(name):
        return argv[argv.index(name) + 1]
    assert argv[:3] == ["python3", "-m", "torch.distributed.run"]
    assert (flag("--nnodes"), flag("--nproc-per-node"), flag("--node-rank")) == ("2", "2", "1")
    assert (flag("--master-addr"), flag("--master-port"), flag("--local-addr")) == ("10.0.0.1", "7777", "10.0.0.2")
    assert (flag("--rdzv-backend"), flag("--rdzv-id"), flag("--rdzv-conf")) == ("static", "job-1", "timeout=60")
    assert argv[-3:] == [str(tmp_path / "train.py"), "--lr", "0.1"]
    assert "--standalone" not in argv
    assert launch.env_changes["NCCL_SOCKET_IFNAME"] == "eth0"
    assert launch.env_changes["TORCHELASTIC_ERROR_FILE"] == "/run/torchrun_error.json"
    assert "FI_PROVIDER" not in launch.env_changes


def test_single_node_command_needs_no_master(tmp_path):
    argv = list(plan_for(tmp_path, ["algo-1"], "algo-1", []).argv)
    assert "--standalone" in argv and "--master-addr" not in argv and "--node-rank" not in argv


def fake_sysfs(root, drivers):
    """``/sys/class/infiniband/<dev>/device/driver`` links as the kernel makes them."""
    for name, driver in drivers.items():
        (root / "bus" / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        device = root / "class" / "infiniband" / name / "device"
        device.mkdir(parents=True)
        (device / "driver").symlink_to(root / "bus" / "drivers" / driver)
    return str(root)


def test_efa_variables_only_with_an_efa_device_and_user_values_win(tmp_path):
    infiniband = fake_sysfs(tmp_path / "ib", {"mlx5_0": "mlx5_core"})  # InfiniBand, but not EFA
    launch = plan_for(tmp_path, ["algo-1", "algo-2"], "algo-1", [], sys_dir=infiniband)
    assert "FI_PROVIDER" not in launch.env_changes
    efa = fake_sysfs(tmp_path / "efa", {"rdmap0s31": "efa", "mlx5_0": "mlx5_core"})
    launch = plan_for(tmp_path, ["algo-1", "algo-2"], "algo-1", [], {"NCCL_SOCKET_IFNAME": "ens32"},
                      sys_dir=efa)
    assert launch.env_changes["FI_PROVIDER"] == "efa"
    assert "NCCL_SOCKET_IFNAME" not in launch.env_changes
    assert any("kept NCCL_SOCKET_IFNAME=ens32" in n for n in launch.notes)


def test_dry_run_json_shows_everything(tmp_path, capsys, monkeypatch):
    env = write_tree(tmp_path, ["algo-1", "algo-2"], "algo-1")
    (tmp_path / "train.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["--dry-run", "--json", "--nproc-per-node", "2", "train.py", "--a", "b c"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["platform"] == "sagemaker"
    assert out["cluster"]["nnodes"] == 2 and out["cluster"]["node_rank"] == 0
    assert out["argv"][-3:] == ["train.py", "--a", "b c"]
    assert any("resourceconfig.json" in e for e in out["evidence"])
    assert "TORCHELASTIC_ERROR_FILE" in out["env"]
    assert not os.path.exists(os.path.dirname(out["env"]["TORCHELASTIC_ERROR_FILE"]))  # nothing made


def test_missing_script_is_a_config_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["missing.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "training script not found: 'missing.py'" in err


def test_base_dir_default():
    assert sagemaker.base_dir({}) == "/opt/ml"
