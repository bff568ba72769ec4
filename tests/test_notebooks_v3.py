"""SDK 3.x: ``sagemaker_v3_modeltrainer.ipynb`` executed headless against moto, and what it sent run for real.

The notebook runs in a kernel of the second virtual environment (``.venv-v3``, SageMaker SDK 3.x,
made by ``make test``) against the moto server of ``test_notebooks.py`` (fake credentials, telemetry
opted out, ``SAGEMAKER_VALIDATE_ROLE=false``, every other HTTP(S) address sent to a recording trap).
From what the endpoint recorded: CreateTrainingJob names 2 instances and the SDK's container command,
the ``code`` channel holds exactly the bundle, the ``sm_drivers`` channel the installed SDK's drivers,
the hyperparameters the training script. The loop is closed with ``simulate --sdk v3``: the recorded
``code`` and ``sm_drivers`` uploads and hyperparameters run on two hosts through the SDK's own
``sm_train.sh`` and drivers, each host with its tree on ``/opt/ml`` in its own mount namespace.
A second submission (``ModelTrainer`` in a plain script) carries hyperparameters with spaces, quotes,
a list and a bool to ``tests/scripts/ddp_allreduce.py``, which records the argv it got, and fails with 7.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import subprocess
import textwrap
import time
from dataclasses import dataclass
from typing import Any

import nbformat
import pytest
from conftest import PYTHON, REPO, TRAIN_SCRIPTS, assert_gone
from hypothesis import given, settings
from hypothesis import strategies as st
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from test_notebooks import NOTEBOOKS, REGION, ROLE, TINY, endpoint, inject_parameters, outputs, run_cells  # noqa: F401

from launcher.platforms.sagemaker import bundle
from launcher.simulate.hosts import sagemaker_v3

V3_PYTHON = os.path.join(REPO, ".venv-v3", "bin", "python")
NOTEBOOK = os.path.join(NOTEBOOKS, "sagemaker_v3_modeltrainer.ipynb")
BUCKET = "ddp-launcher-v3-test"
PREFIX = "ddp-launcher-v3/hymenoptera"  # the notebook's default
INSTANCE_TYPE = "ml.c5.xlarge"
ALLREDUCE = os.path.join(REPO, "tests", "scripts", "ddp_allreduce.py")
# Spaces, double quotes, a list and a bool; ModelTrainer keeps the order given.
ODD = {"train-script": "ddp_allreduce.py", "steps": 2, "note": 'say "hi" to a b', "layers": [1, 2], "flag": True}
# What the script must receive: the SDK's safe_serialize in hyperparameters.json, then its basic script
# driver's hyperparameters_to_cli_args (written out by hand, not computed).
ODD_ARGV = ["--steps", "2", "--note", 'say "hi" to a b', "--layers", "[1, 2]", "--flag", "true"]

pytestmark = pytest.mark.skipif(not os.access(V3_PYTHON, os.X_OK),
                                reason="no .venv-v3 (SageMaker SDK 3.x): `make test` creates it")


def v3_env(endpoint) -> dict[str, str]:  # noqa: F811
    """The endpoint's environment, for SDK 3.x: no role validation, no PYTHONPATH of the 2.x venv."""
    env = endpoint.env()
    env.pop("PYTHONPATH", None)
    env["SAGEMAKER_VALIDATE_ROLE"] = "false"
    return env


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _kernel(tmp: str) -> KernelManager:
    """A kernel of ``.venv-v3``'s Python (the 2.x SDK of this venv is not visible in it)."""
    spec_dir = os.path.join(tmp, "kernels", "sdkv3")
    os.makedirs(spec_dir)
    with open(os.path.join(spec_dir, "kernel.json"), "w") as fh:
        json.dump({"argv": [V3_PYTHON, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                   "display_name": "SageMaker SDK 3.x", "language": "python"}, fh)
    specs = KernelSpecManager(kernel_dirs=[os.path.dirname(spec_dir)])
    return KernelManager(kernel_name="sdkv3", kernel_spec_manager=specs)


@dataclass
class Recorded:
    notebook: nbformat.NotebookNode
    seconds: float
    request: dict[str, Any]
    description: dict[str, Any]
    channels: dict[str, str]  # channel name -> local copy of what was uploaded
    hetero: dict[str, Any]  # the heterogeneous job's CreateTrainingJob request
    hetero_channels: dict[str, str]


def _creates(endpoint) -> list[dict[str, Any]]:  # noqa: F811
    return [json.loads(r["body"]) for r in endpoint.requests()
            if r["headers"].get("x-amz-target") == "SageMaker.CreateTrainingJob"]


def _download(endpoint, request: dict[str, Any], dest: str) -> dict[str, str]:  # noqa: F811
    """Every channel of the request, downloaded from the endpoint's S3 into ``dest/<channel>``."""
    s3 = endpoint.client("s3")
    found = {}
    for channel in request["InputDataConfig"]:
        uri = channel["DataSource"]["S3DataSource"]["S3Uri"]
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        target = os.path.join(dest, channel["ChannelName"])
        for obj in s3.list_objects_v2(Bucket=bucket, Prefix=prefix.rstrip("/") + "/")["Contents"]:
            path = os.path.join(target, os.path.relpath(obj["Key"], prefix.rstrip("/")))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            s3.download_file(bucket, obj["Key"], path)
        found[channel["ChannelName"]] = target
    return found


@pytest.fixture(scope="module")
def recorded(endpoint, tmp_path_factory) -> Recorded:  # noqa: F811
    scratch = str(tmp_path_factory.mktemp("executed-v3"))
    before = len(_creates(endpoint))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    inject_parameters(nb, {"role_arn": ROLE, "bucket": BUCKET, "region": REGION, "instance_type": INSTANCE_TYPE,
                           "instance_count": 2, "epochs": 1, "extra_hyperparameters": TINY, "wait": True,
                           "logs": False, "hetero_data_instance_type": INSTANCE_TYPE, "endpoint_url": endpoint.url})
    start = time.monotonic()
    run_cells(nb, _kernel(scratch), {**v3_env(endpoint), "TMPDIR": scratch},
              os.path.join(scratch, "sagemaker_v3_modeltrainer.ipynb"))
    seconds = time.monotonic() - start
    creates = _creates(endpoint)[before:]
    names = [c["TrainingJobName"] for c in creates]
    assert [n.split("-2")[0] for n in names] == ["ddp-resnet-v3", "ddp-hetero-v3"], names  # main job, then hetero
    request, hetero = creates
    description = endpoint.client("sagemaker").describe_training_job(TrainingJobName=request["TrainingJobName"])
    return Recorded(nb, seconds, request, description, _download(endpoint, request, os.path.join(scratch, "s3")),
                    hetero, _download(endpoint, hetero, os.path.join(scratch, "s3-hetero")))


@pytest.mark.notebook
def test_create_training_job_names_two_hosts_the_drivers_command_and_the_script(recorded, endpoint):  # noqa: F811
    req = recorded.request
    assert req["ResourceConfig"]["InstanceCount"] == 2
    assert req["ResourceConfig"]["InstanceType"] == INSTANCE_TYPE
    assert req["RoleArn"] == ROLE
    # SDK 3.x: hyperparameters as plain text in the order given, no sagemaker_* entries.
    assert list(req["HyperParameters"].items()) == [
        ("train-script", "train_resnet.py"), ("epochs", "1"), *((k, str(v)) for k, v in TINY.items())]
    spec = req["AlgorithmSpecification"]
    assert (*spec["ContainerEntrypoint"], *spec["ContainerArguments"]) == sagemaker_v3.CONTAINER_COMMAND
    assert spec["TrainingImage"].endswith("/pytorch-training:2.8-cpu-py312")
    assert [d["Name"] for d in spec["MetricDefinitions"]] == \
        ["epoch", "train_loss", "val_loss", "val_accuracy", "images_per_sec"]
    assert sorted(recorded.channels) == ["code", "sm_drivers", "train", "val"]
    assert recorded.description["ResourceConfig"]["InstanceCount"] == 2
    assert {e["headers"]["host"] for e in endpoint.requests()} == {f"127.0.0.1:{endpoint.port}"}
    assert endpoint.trap.hits == []


@pytest.mark.notebook
def test_code_channel_is_exactly_the_bundle(recorded, tmp_path):
    expected = bundle.stage_bundle(os.path.join(TRAIN_SCRIPTS, "train_resnet.py"), str(tmp_path / "bundle"))
    code = recorded.channels["code"]
    assert bundle.list_bundle(code) == bundle.list_bundle(expected)
    mismatched = [n for n in bundle.list_bundle(code)
                  if not filecmp.cmp(os.path.join(code, n), os.path.join(expected, n), shallow=False)]
    assert mismatched == []


@pytest.mark.notebook
def test_drivers_channel_is_the_installed_sdks(recorded):
    drivers = recorded.channels["sm_drivers"]
    installed = subprocess.run([V3_PYTHON, "-c", "from sagemaker.train.constants import SM_DRIVERS_LOCAL_PATH as p; "
                                "print(p)"], capture_output=True, text=True, check=True).stdout.strip()
    for name in bundle.list_bundle(installed):
        if "__pycache__" not in name:
            assert filecmp.cmp(os.path.join(installed, name), os.path.join(drivers, name), shallow=False), name
    with open(os.path.join(drivers, "sourcecode.json")) as fh:
        assert json.load(fh)["entry_script"] == bundle.ENTRY_POINT
    with open(os.path.join(drivers, "distributed.json")) as fh:
        assert json.load(fh) == {}  # no distributed=: the launcher starts torchrun, once per host
    with open(os.path.join(drivers, "sm_train.sh")) as fh:
        assert "distributed_drivers/basic_script_driver.py" in fh.read()


@pytest.mark.notebook
def test_notebook_reports_status_metrics_plot_and_model(recorded):
    text, mimes = outputs(recorded.notebook)
    desc = recorded.description
    assert "status: Completed" in text
    assert f"model artifact: {desc['ModelArtifacts']['S3ModelArtifacts']}" in text
    assert "image/png" in mimes
    assert recorded.seconds < 300


def simulate(workdir: str, channels: dict[str, str], hps: dict[str, str], env: dict[str, str],
             extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``simulate --sdk v3`` with the recorded code and sm_drivers uploads and hyperparameters."""
    data = [a for name, path in channels.items() if name not in ("code", "sm_drivers")
            for a in ("--channel", f"{name}={path}")]
    command = [PYTHON, "-m", "launcher", "simulate", "--sdk", "v3", "--hosts", "2", "--nproc-per-node", "1",
               "--instance-type", INSTANCE_TYPE, "--workdir", workdir, "--sm-drivers", channels["sm_drivers"],
               "--code", channels["code"], "--hyperparameters", json.dumps(hps), *extra, *data]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.job
@pytest.mark.lab
@pytest.mark.notebook
def test_what_was_submitted_trains_through_the_sdks_drivers(recorded, endpoint, tmp_path):  # noqa: F811
    workdir = str(tmp_path / "job")
    env = {**endpoint.env(), "PYTHONPATH": REPO}  # simulate from here; the hosts run the uploaded launcher
    proc = simulate(workdir, recorded.channels, recorded.request["HyperParameters"], env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert [h["exit_code"] for h in summary["hosts"]] == [0, 0]
    assert_gone([h["pid"] for h in summary["hosts"]])
    assert "Running Basic Script driver" in log  # the SDK's sm_train.sh ran the SDK's driver
    assert "[algo-1] [ddp-launcher] sagemaker host algo-1: node 0 of 2" in log  # rank 0 on algo-1
    assert "[algo-2] [ddp-launcher] sagemaker host algo-2: node 1 of 2" in log
    assert "[algo-1] [rank0]:model saved: /opt/ml/model/model.pt" in log  # /opt/ml is algo-1's own tree
    for definition in recorded.request["AlgorithmSpecification"]["MetricDefinitions"]:
        assert re.findall(definition["Regex"], log), definition  # CloudWatch would find every metric
    assert os.path.getsize(os.path.join(workdir, "algo-1", "model", "model.pt")) > 1000
    history = read_json(os.path.join(workdir, "algo-1", "output", "data", "metrics.json"))
    assert [r["epoch"] for r in history] == [1]
    # The hosts wrote their SDK environment into their own /opt/ml, i.e. their tree.
    with open(os.path.join(workdir, "algo-2", "input", "sm_training.env")) as fh:
        assert "export SM_CURRENT_HOST_RANK='1'" in fh.read()
    assert not os.path.exists("/opt/ml")  # the machine's /opt was never touched
    assert endpoint.trap.hits == []


@pytest.mark.job
@pytest.mark.lab
@pytest.mark.notebook
def test_the_heterogeneous_job_runs_through_the_sdks_drivers(recorded, endpoint, tmp_path):  # noqa: F811
    """``Compute(instance_groups=...)``: 2 train + 1 data instances; the recorded request replayed with the
    SDK's own drivers on three simulated hosts."""
    req, channels = recorded.hetero, recorded.hetero_channels
    groups = req["ResourceConfig"]["InstanceGroups"]
    assert [(g["InstanceGroupName"], g["InstanceType"], g["InstanceCount"]) for g in groups] == \
        [("train", INSTANCE_TYPE, 2), ("data", INSTANCE_TYPE, 1)]
    hps = req["HyperParameters"]
    assert json.loads(hps["launcher-instance-groups"]) == ["train"] and hps["train-script"] == "group_entry.py"
    assert sorted(os.listdir(channels["code"])) == sorted(["launch.py", "launcher", "train_resnet.py",
                                                           "ddp_utils.py", "group_entry.py"])
    workdir = str(tmp_path / "job")
    spec = ",".join(f"{g['InstanceGroupName']}={g['InstanceType']}:{g['InstanceCount']}" for g in groups)
    data = [a for name, path in channels.items() if name not in ("code", "sm_drivers")
            for a in ("--channel", f"{name}={path}")]
    command = [PYTHON, "-m", "launcher", "simulate", "--sdk", "v3", "--instance-groups", spec,
               "--nproc-per-node", "1", "--workdir", workdir, "--sm-drivers", channels["sm_drivers"],
               "--code", channels["code"], "--hyperparameters", json.dumps(hps), *data]
    proc = subprocess.run(command, cwd=REPO, env={**endpoint.env(), "PYTHONPATH": REPO}, capture_output=True,
                          text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert [h["exit_code"] for h in summary["hosts"]] == [0, 0, 0]
    assert_gone([h["pid"] for h in summary["hosts"]])
    assert "[algo-1] [ddp-launcher] sagemaker host algo-1: node 0 of 2" in log
    assert "[algo-3] [ddp-launcher] sagemaker host algo-3: group data, outside the training world" in log
    assert "[algo-3] group data on algo-3: serving the training world of algo-1 until it ends" in log
    assert "[algo-3] [ddp-launcher] the training world has ended and this host's script with it" in log
    assert os.path.getsize(os.path.join(workdir, "algo-1", "model", "model.pt")) > 1000
    assert endpoint.trap.hits == []


SUBMIT = textwrap.dedent("""
    import json, sys
    from sagemaker.core.helper.session_helper import Session
    from sagemaker.core.training.configs import Compute, SourceCode
    from sagemaker.train import ModelTrainer
    source_dir, hps = sys.argv[1], json.loads(sys.argv[2])
    ModelTrainer(training_image="123456789012.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.8-cpu-py312",
                 source_code=SourceCode(source_dir=source_dir, entry_script="launch.py"),
                 compute=Compute(instance_type="ml.c5.xlarge", instance_count=2), hyperparameters=hps,
                 role=sys.argv[3], sagemaker_session=Session(default_bucket=sys.argv[4]),
                 base_job_name="odd-hps").train(wait=False, logs=False)
""")


@pytest.fixture(scope="module")
def odd_submission(endpoint, tmp_path_factory) -> tuple[dict[str, str], dict[str, str]]:  # noqa: F811
    """ModelTrainer submits ddp_allreduce.py with ``ODD``; returns the recorded hyperparameters and channels."""
    scratch = str(tmp_path_factory.mktemp("odd"))
    source = bundle.stage_bundle(ALLREDUCE, os.path.join(scratch, "bundle"))
    before = len(_creates(endpoint))
    proc = subprocess.run([V3_PYTHON, "-c", SUBMIT, source, json.dumps(ODD), ROLE, BUCKET], cwd=scratch,
                          env=v3_env(endpoint), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    request = _creates(endpoint)[before:][0]
    return request["HyperParameters"], _download(endpoint, request, os.path.join(scratch, "s3"))


@pytest.mark.job
@pytest.mark.lab
@pytest.mark.notebook
def test_odd_hyperparameters_reach_the_script_as_v3_renders_them(odd_submission, endpoint, tmp_path):  # noqa: F811
    hps, channels = odd_submission
    assert hps == {"train-script": "ddp_allreduce.py", "steps": "2", "note": 'say "hi" to a b',
                   "layers": "[1, 2]", "flag": "true"}
    workdir = str(tmp_path / "job")
    proc = simulate(workdir, channels, hps, {**endpoint.env(), "PYTHONPATH": REPO})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    for rank, host in enumerate(("algo-1", "algo-2")):
        with open(os.path.join(workdir, host, "output", "data", f"rank{rank}.json")) as fh:
            record = json.load(fh)
        assert record["argv"] == ODD_ARGV
        assert record["env"]["SM_CURRENT_HOST"] == host and record["env"]["SM_HP_NOTE"] == ODD["note"]
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert_gone([h["pid"] for h in summary["hosts"]])


@pytest.mark.job
@pytest.mark.lab
@pytest.mark.notebook
def test_a_worker_exiting_7_gives_7_and_a_root_cause(odd_submission, endpoint, tmp_path):  # noqa: F811
    hps, channels = odd_submission
    failing = {**hps, "fail-rank": "1", "exit-code": "7"}  # ints as ModelTrainer's safe_serialize writes them
    workdir = str(tmp_path / "job")
    proc = simulate(workdir, channels, failing, {**endpoint.env(), "PYTHONPATH": REPO})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 7, log[-6000:]
    summary = read_json(os.path.join(workdir, "summary.json"))
    codes = {h["host"]: h["exit_code"] for h in summary["hosts"]}
    assert codes["algo-2"] == 7, codes
    with open(os.path.join(workdir, "algo-2", "output", "failure")) as fh:
        report = fh.read()
    assert report.startswith("algo-2: rank 1 (local rank 0) exited with code 7"), report
    assert_gone([h["pid"] for h in summary["hosts"]])


@pytest.mark.parametrize(("options", "says"), [
    (["--sdk", "v3", "--sm-drivers", "{tmp}"], "not ModelTrainer's sm_drivers channel (no sm_train.sh)"),
    (["--sdk", "v3"], "--sdk v3 needs --sm-drivers DIR"),
    (["--sm-drivers", "{drivers}"], "--sm-drivers needs --sdk v3"),
    (["--sdk", "v3", "--sm-drivers", "{drivers}", "--toolkit"], "--toolkit is SDK 2.x's"),
    (["--sdk", "v3", "--sm-drivers", "{drivers}", "--code", "{tmp}/nowhere"], "--code: directory not found"),
    (["--platform", "slurm", "--sdk", "v3"], "--sdk is SageMaker-only"),
])
def test_simulate_v3_bad_input_is_one_line_and_exit_2(tmp_path, options, says):
    drivers = tmp_path / "drivers"
    for name in ("sm_train.sh", "scripts/environment.py", "common/utils.py"):
        (drivers / name).parent.mkdir(parents=True, exist_ok=True)
        (drivers / name).write_text("")
    words = [w.format(tmp=tmp_path / "empty", drivers=drivers) for w in options]
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([PYTHON, "-m", "launcher", "simulate", *words, "--hosts", "2",
                           "--workdir", str(tmp_path / "job"), "--", ALLREDUCE],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert says in proc.stderr and not (tmp_path / "job").exists()


@pytest.mark.job
@pytest.mark.lab
@pytest.mark.notebook
def test_a_stop_signal_reaches_the_launcher_under_the_drivers(odd_submission, endpoint, tmp_path):  # noqa: F811
    """A spot interruption of algo-1 goes to its ``launch.py`` (not to the drivers' bash), which stops its
    workers: they record the SIGTERM; the launcher is the parent of their torchrun."""
    hps, channels = odd_submission
    workdir = str(tmp_path / "job")
    proc = simulate(workdir, channels, {**hps, "steps": "0"}, {**endpoint.env(), "PYTHONPATH": REPO},
                    ("--fault", "algo-1:SIGTERM:step=2"))
    log = proc.stdout + proc.stderr
    fired = re.search(r"fault: SIGTERM to algo-1's launcher \(pid (\d+)\) at", log)
    assert fired, log[-6000:]
    record = read_json(os.path.join(workdir, "algo-1", "output", "data", "rank0.json"))
    assert record["sigterm"] is True, record
    summary = read_json(os.path.join(workdir, "summary.json"))
    host_pid = next(h["pid"] for h in summary["hosts"] if h["host"] == "algo-1")
    launcher = int(fired.group(1))
    assert launcher != host_pid and record["ancestors"][1] == launcher  # worker -> torchrun -> launcher
    assert proc.returncode == 143, log[-6000:]
    assert_gone([h["pid"] for h in summary["hosts"]] + [launcher, record["pid"]])


@pytest.mark.notebook
@pytest.mark.lab
def test_sdk_v3_fails_a_job_whose_hyperparameter_holds_a_single_quote(odd_submission, endpoint, tmp_path):  # noqa: F811
    """A known limit of the SDK (sagemaker-train 1.27), not of the launcher: environment.py writes
    ``export SM_HPS='...'`` unescaped, so ``source`` of that file fails and the job ends with exit 2
    before the entry script starts. Pinned here so that a fixed SDK shows up."""
    hps, channels = odd_submission
    workdir = str(tmp_path / "job")
    proc = simulate(workdir, channels, {**hps, "note": "it's"}, {**endpoint.env(), "PYTHONPATH": REPO})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-6000:]
    assert "sm_training.env: line" in log and "unexpected EOF" in log
    assert "[ddp-launcher]" not in log  # the launcher never ran
    summary = read_json(os.path.join(workdir, "summary.json"))
    assert_gone([h["pid"] for h in summary["hosts"]])


def _sdk_utils():
    """The SDK's own ``container_drivers/common/utils.py`` (standard library only), loaded from .venv-v3."""
    import glob
    import importlib.util

    path = glob.glob(os.path.join(REPO, ".venv-v3", "lib", "python3*", "site-packages", "sagemaker", "train",
                                  "container_drivers", "common", "utils.py"))[0]
    spec = importlib.util.spec_from_file_location("sm_container_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HP_KEYS = st.text(st.characters(codec="utf-8", exclude_characters="\0="), min_size=1, max_size=12).filter(
    lambda k: not k.startswith(("sagemaker_", "launcher", "train")) and k not in ("_tuning_objective_metric",
                                                                                  "default_user_module_name"))
HP_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(st.characters(codec="utf-8",
                                                                                           exclude_characters="\0")),
                         lambda inner: st.lists(inner, max_size=3), max_leaves=4)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(HP_KEYS, HP_VALUES, max_size=6), st.integers(0, 6))
def test_the_launcher_reads_any_v3_argv_as_the_sdk_renders_it(tmp_path_factory, hps, position):
    """Whatever ModelTrainer's hyperparameters: the launcher takes ``train-script`` from the argv the SDK's
    driver renders, leaves every other word to the script in order, and never "repairs" it (the repair
    is for SDK 2.x's split argv)."""
    from launcher.options import parse_invocation
    from launcher.platforms.sagemaker import PLATFORM

    utils = _sdk_utils()
    items = list(hps.items())
    items.insert(min(position, len(items)), ("train-script", "train.py"))
    raw = {k: utils.safe_serialize(v) for k, v in items}  # hyperparameters.json, as ModelTrainer writes it
    argv = utils.hyperparameters_to_cli_args({k: utils.safe_deserialize(v) for k, v in raw.items()})
    base = str(tmp_path_factory.getbasetemp() / "v3hps")
    os.makedirs(os.path.join(base, "input", "config"), exist_ok=True)
    with open(os.path.join(base, "input", "config", "hyperparameters.json"), "w") as fh:
        json.dump(raw, fh)
    environ = {"SAGEMAKER_BASE_DIR": base}
    notes: list[str] = []
    assert PLATFORM.prepare_argv(argv, environ, notes) == argv and notes == []
    invocation = parse_invocation(argv, environ)
    i = argv.index("--train-script")
    assert invocation.script == "train.py" and list(invocation.script_args) == argv[:i] + argv[i + 2:]


@pytest.mark.notebook
def test_sm_drivers_tool_writes_what_model_trainer_uploaded(recorded, tmp_path):
    """``tools/sm_drivers_v3.py`` (for simulate runs without a recording) writes the very channel the
    notebook's ModelTrainer uploaded: the same files, byte for byte, but sourcecode.json's source_dir."""
    dest = str(tmp_path / "drivers")
    proc = subprocess.run([V3_PYTHON, os.path.join(REPO, "tools", "sm_drivers_v3.py"), dest],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    uploaded = recorded.channels["sm_drivers"]
    names = [n for n in bundle.list_bundle(dest) if "__pycache__" not in n]  # caches: whatever Python left there
    assert names == [n for n in bundle.list_bundle(uploaded) if "__pycache__" not in n]
    differ = [n for n in names
              if not filecmp.cmp(os.path.join(dest, n), os.path.join(uploaded, n), shallow=False)]
    assert differ == ["sourcecode.json"]
    ours, sent = (read_json(os.path.join(d, "sourcecode.json")) for d in (dest, uploaded))
    assert {**ours, "source_dir": None} == {**sent, "source_dir": None}
