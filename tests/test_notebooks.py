"""The notebooks, executed headless, against a real local AWS endpoint (moto's server) and this machine.

``sagemaker_ddp.ipynb`` runs with its parameters pointed at a moto server started here on 127.0.0.1
(fake credentials, SDK telemetry opted out, every other HTTP(S) address sent to a dead proxy). What
the endpoint recorded is then checked: the CreateTrainingJob request (moto's request recording,
which keeps the request exactly as the SDK sent it) and moto's state (DescribeTrainingJob, S3).
The loop is closed by running what was submitted: the uploaded ``sourcedir.tar.gz`` and the
recorded hyperparameters go through ``launcher simulate --toolkit`` (AWS's real sagemaker-training
``train`` on two simulated hosts), which must train and write the model.

moto's training jobs run nothing: CreateTrainingJob stores the request and DescribeTrainingJob says
``Completed`` at once (with a ``train:progress`` final metric of its own and its own
MetricDefinitions), so ``fit(wait=True)`` returns after one status poll.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import posixpath
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import boto3
import nbformat
import pytest
from conftest import PYTHON, REPO, TRAIN_SCRIPTS, assert_gone, free_port, launcher_env
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from launcher.platforms.sagemaker import argv as aws_argv
from launcher.platforms.sagemaker import bundle

NOTEBOOKS = os.path.join(REPO, "notebooks")
SAGEMAKER_NOTEBOOK = os.path.join(NOTEBOOKS, "sagemaker_ddp.ipynb")
LOCAL_NOTEBOOK = os.path.join(NOTEBOOKS, "local_simulation.ipynb")
TRAIN_SCRIPT = os.path.join(TRAIN_SCRIPTS, "train_resnet.py")
sys.path.insert(0, os.path.join(REPO, "tools"))
import check_notebooks  # noqa: E402

REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's default account
ROLE = f"arn:aws:iam::{ACCOUNT}:role/ddp-launcher-notebook-test"
BUCKET = "ddp-launcher-notebook-test"
PREFIX = "ddp-launcher/hymenoptera"  # the notebook's default
INSTANCE_TYPE = "ml.c5.xlarge"
EPOCHS = 1
# Tiny and quick on 2 shared cores; accepted by train_resnet.py (ddp_utils.add_common_arguments).
TINY = {"batch-size": 4, "image-size": 32, "workers": 0}
SDK_ENTRIES = {"sagemaker_program", "sagemaker_submit_directory", "sagemaker_container_log_level",
               "sagemaker_job_name", "sagemaker_region"}
TELEMETRY_OFF = "SchemaVersion: '1.0'\nSageMaker:\n  PythonSDK:\n    Modules:\n      TelemetryOptOut: true\n"


# ------------------------------------------------------------------------------------------------
# The local AWS endpoint
# ------------------------------------------------------------------------------------------------

class TrapProxy:
    """A "proxy" on 127.0.0.1 that forwards nothing: it records the first line of every request
    (``CONNECT sm-pysdk-t-us-east-1.s3...:443 HTTP/1.1``) and closes. Every HTTP(S) request not for
    127.0.0.1 is sent here, so an attempt to reach any other address fails and is on record."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.sock.settimeout(0.1)
        self.hits: list[str] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:  # timeout: look at the flag again
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.hits.append(conn.recv(1024).split(b"\r\n", 1)[0].decode(errors="replace"))
                except OSError:
                    self.hits.append("(connection without a request line)")

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.sock.close()


@dataclass
class Endpoint:
    url: str
    port: int
    pid: int
    recording: str
    home: str  # fake AWS config files, SDK config
    trap: TrapProxy

    def client(self, service: str):
        session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                region_name=REGION)
        return session.client(service, endpoint_url=self.url)

    def requests(self) -> list[dict[str, Any]]:
        """Every request the server recorded, with the body decoded and the headers lower-cased."""
        entries = []
        with open(self.recording, encoding="utf-8") as fh:
            for line in fh:
                entry = json.loads(line)
                body = entry.get("body") or ""
                if entry.get("body_encoded"):
                    body = base64.b64decode(body).decode("utf-8", errors="replace")
                entry["body"] = body
                entry["headers"] = {k.lower(): v for k, v in entry["headers"].items()}
                entries.append(entry)
        return entries

    def env(self) -> dict[str, str]:
        """The environment of a process that must talk to this endpoint and to nothing else."""
        proxy = self.trap.url
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AWS_", "SAGEMAKER_", "SM_", "LAUNCHER_"))
               and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
        env.update({
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION,
            "AWS_CONFIG_FILE": os.path.join(self.home, "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": os.path.join(self.home, "aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": self.url,
            # SDK defaults config: TelemetryOptOut (the SDK has no variable for it), for user and admin.
            "SAGEMAKER_USER_CONFIG_OVERRIDE": os.path.join(self.home, "sagemaker-config.yaml"),
            "SAGEMAKER_ADMIN_CONFIG_OVERRIDE": os.path.join(self.home, "sagemaker-config.yaml"),
            "SAGEMAKER_SUPPRESS_V2_WARNING": "1",
            "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "http_proxy": proxy, "https_proxy": proxy,
            "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        })
        return env


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return found + [g for c in found for g in _children(c)]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """``python -m moto.server`` on 127.0.0.1, recording every request; stopped and proven gone after."""
    home = str(tmp_path_factory.mktemp("aws"))
    with open(os.path.join(home, "sagemaker-config.yaml"), "w") as fh:
        fh.write(TELEMETRY_OFF)
    port = free_port()
    recording = os.path.join(home, "recording.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(MOTO_ENABLE_RECORDING="true", MOTO_RECORDER_FILEPATH=recording,
               AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION=REGION)
    log_path = os.path.join(home, "moto.log")
    with open(log_path, "wb") as log:
        server = subprocess.Popen([PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, cwd=home)
    ep = Endpoint(f"http://127.0.0.1:{port}", port, server.pid, recording, home, TrapProxy())
    try:
        _wait_until_up(ep, server, log_path)
        yield ep
    finally:
        family = [server.pid, *_children(server.pid)]
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        ep.trap.close()
        assert_gone(family)


def _wait_until_up(ep: Endpoint, server: subprocess.Popen, log_path: str) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 60
    while True:
        if server.poll() is not None:
            with open(log_path, errors="replace") as fh:
                pytest.fail(f"moto server exited with code {server.returncode}: {fh.read()[-3000:]}")
        try:
            opener.open(f"{ep.url}/moto-api/reset", data=b"", timeout=2).read()  # also starts clean
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"moto server did not answer on {ep.url} within 60 s")
            time.sleep(0.2)


# ------------------------------------------------------------------------------------------------
# Running a notebook headless
# ------------------------------------------------------------------------------------------------

def inject_parameters(nb: nbformat.NotebookNode, values: dict[str, Any]) -> None:
    """Add a cell after the one tagged ``parameters`` that overrides them (as papermill does)."""
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "the notebook needs exactly one cell tagged 'parameters'"
    declared = set(re.findall(r"^(\w+) =", nb.cells[tagged[0]].source, flags=re.M))
    assert set(values) <= declared, f"not parameters of the notebook: {set(values) - declared}"
    source = "# Injected by the test\n" + "".join(f"{k} = {v!r}\n" for k, v in values.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(tagged[0] + 1, cell)


def run_cells(nb: nbformat.NotebookNode, km: KernelManager, env: dict[str, str], keep: str) -> None:
    """Run every cell of ``nb`` (as Jupyter would) in a new kernel of ``km``; save the executed copy to ``keep``.

    The test owns the kernel: it is shut down after the last cell (or the first that failed) and proven gone
    by its PID. (nbclient shuts down only a kernel it created itself: one of a kernel manager given to it
    lived on, idle, until pytest exited.)"""
    client = NotebookClient(nb, timeout=900, km=km, resources={"metadata": {"path": NOTEBOOKS}})
    pids = []
    try:
        client.execute(env=env)
    finally:
        nbformat.write(nb, keep)  # executed copy, kept with the test's files for reading
        if km.has_kernel:
            pids.append(km.provisioner.pid)
            if client.kc is not None:
                client.kc.stop_channels()
            km.shutdown_kernel(now=False)
    assert_gone(pids)  # fails when no kernel was recorded


def execute(path: str, values: dict[str, Any], env: dict[str, str], keep: str) -> nbformat.NotebookNode:
    """Execute a copy of the notebook in ``notebooks/`` with this venv's kernel; save it to ``keep``."""
    nb = nbformat.read(path, as_version=4)
    inject_parameters(nb, values)
    run_cells(nb, KernelManager(kernel_name="python3"), env, keep)
    return nb


def outputs(nb: nbformat.NotebookNode) -> tuple[str, list[str]]:
    """All text the notebook printed, and the MIME types of everything it displayed."""
    text, mimes = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text.append(out.text)
            elif out.output_type in ("display_data", "execute_result"):
                mimes += list(out.data)
                text.append(out.data.get("text/plain", ""))
    return "".join(text), mimes


# ------------------------------------------------------------------------------------------------
# sagemaker_ddp.ipynb against the endpoint
# ------------------------------------------------------------------------------------------------

@dataclass
class Submitted:
    notebook: nbformat.NotebookNode
    seconds: float
    request: dict[str, Any]  # the CreateTrainingJob request as sent
    description: dict[str, Any]  # DescribeTrainingJob from the endpoint
    source_tar: bytes  # sourcedir.tar.gz as stored in S3
    hetero: dict[str, Any]  # the heterogeneous job's CreateTrainingJob request
    hetero_tar: bytes  # and its sourcedir.tar.gz


def _metric_definitions() -> list[dict[str, str]]:
    path = os.path.join(TRAIN_SCRIPTS, "ddp_utils.py")
    spec = importlib.util.spec_from_file_location("ddp_utils_for_test", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses need it there
    spec.loader.exec_module(module)
    return module.METRIC_DEFINITIONS


@pytest.fixture(scope="module")
def submitted(endpoint, tmp_path_factory) -> Submitted:
    scratch = tmp_path_factory.mktemp("executed")
    keep = str(scratch / "sagemaker_ddp.ipynb")
    env = {**endpoint.env(), "TMPDIR": str(scratch)}  # the notebook's generated data and bundle go here
    start = time.monotonic()
    nb = execute(SAGEMAKER_NOTEBOOK, {
        "role_arn": ROLE, "bucket": BUCKET, "region": REGION, "instance_type": INSTANCE_TYPE,
        "instance_count": 2, "epochs": EPOCHS, "extra_hyperparameters": TINY, "wait": True,
        "hetero_data_instance_type": INSTANCE_TYPE, "endpoint_url": endpoint.url}, env, keep)
    seconds = time.monotonic() - start
    creates = [json.loads(r["body"]) for r in endpoint.requests()
               if r["headers"].get("x-amz-target") == "SageMaker.CreateTrainingJob"]
    names = [c["TrainingJobName"] for c in creates]
    assert [n.split("-2")[0] for n in names] == ["ddp-resnet", "ddp-hetero"], names  # the main job, then the other
    request, hetero = creates
    sm = endpoint.client("sagemaker")
    description = sm.describe_training_job(TrainingJobName=request["TrainingJobName"])
    return Submitted(nb, seconds, request, description, _source_tar(endpoint, description), hetero,
                     _source_tar(endpoint, sm.describe_training_job(TrainingJobName=hetero["TrainingJobName"])))


def _source_tar(endpoint, description: dict[str, Any]) -> bytes:  # noqa: F811
    """The job's uploaded sourcedir.tar.gz, from the endpoint's S3."""
    submit = json.loads(description["HyperParameters"]["sagemaker_submit_directory"])
    bucket, _, key = submit[len("s3://"):].partition("/")
    return endpoint.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.mark.notebook
def test_create_training_job_names_the_launcher_two_hosts_and_the_script(submitted, endpoint):
    req, desc = submitted.request, submitted.description
    hps = req["HyperParameters"]
    # The launcher is the program; the training script is a JSON-encoded hyperparameter (SDK v2).
    assert hps["sagemaker_program"] == json.dumps(bundle.ENTRY_POINT) == '"launch.py"'
    assert hps["train-script"] == '"train_resnet.py"'
    assert hps["epochs"] == json.dumps(EPOCHS)
    assert hps["batch-size"] == json.dumps(TINY["batch-size"])
    # Exactly these: no distribution flags (sagemaker_torch_distributed_enabled, ..._mpi_enabled).
    assert set(hps) == {"train-script", "epochs", *TINY, *SDK_ENTRIES}
    assert json.loads(hps["sagemaker_job_name"]) == req["TrainingJobName"]
    assert json.loads(hps["sagemaker_region"]) == REGION
    assert req["ResourceConfig"]["InstanceCount"] == 2
    assert req["ResourceConfig"]["InstanceType"] == INSTANCE_TYPE
    assert req["RoleArn"] == ROLE
    image = req["AlgorithmSpecification"]["TrainingImage"]
    assert re.fullmatch(r"\d+\.dkr\.ecr\.us-east-1\.amazonaws\.com/pytorch-training:2\.8-cpu-py312", image)
    assert req["AlgorithmSpecification"]["MetricDefinitions"] == _metric_definitions()
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in req["InputDataConfig"]}
    data = f"s3://{BUCKET}/{PREFIX}/data"
    assert channels == {"train": f"{data}/train", "val": f"{data}/val"}
    assert req["CheckpointConfig"]["S3Uri"] == f"s3://{BUCKET}/{PREFIX}/checkpoints/{req['TrainingJobName']}"
    assert req["OutputDataConfig"]["S3OutputPath"] == f"s3://{BUCKET}/{PREFIX}/output"
    # moto's state agrees with the request.
    assert desc["HyperParameters"] == hps
    assert desc["ResourceConfig"]["InstanceCount"] == 2
    assert desc["TrainingJobStatus"] == "Completed"
    # Every request went to this endpoint, signed with the fake credentials.
    entries = endpoint.requests()
    assert {e["headers"]["host"] for e in entries} == {f"127.0.0.1:{endpoint.port}"}
    signed = [e["headers"]["authorization"] for e in entries if "authorization" in e["headers"]]
    assert signed and all("Credential=testing/" in a for a in signed)
    # ... and nothing tried another address (the SDK's telemetry is opted out).
    assert endpoint.trap.hits == []


@pytest.mark.notebook
def test_uploaded_source_is_the_bundle_and_nothing_heavy(submitted):
    with tarfile.open(fileobj=io.BytesIO(submitted.source_tar), mode="r:gz") as tar:
        members = tar.getmembers()
        names = sorted(m.name for m in members)
        contents = {m.name: tar.extractfile(m).read() for m in members if m.isfile()}
    expected = sorted(["launch.py", "train_resnet.py", "ddp_utils.py",
                       *("launcher/" + p.replace(os.sep, "/") for p in bundle.package_files())])
    assert [n for n in names if contents.get(n) is not None] == expected  # the files, exactly
    assert all(m.isfile() or m.isdir() for m in members)  # no links
    directories = {posixpath.dirname(n) for n in expected} - {""}
    assert set(names) - set(expected) <= directories  # only their directories
    assert not {"requirements.txt", "setup.py", "setup.cfg", "pyproject.toml"} & set(names)
    for name in expected:
        if name.startswith("launcher/"):
            source = os.path.join(REPO, name)
        elif name == "launch.py":
            continue
        else:
            source = os.path.join(TRAIN_SCRIPTS, name)
        with open(source, "rb") as fh:
            assert contents[name] == fh.read(), name
    assert b"from launcher.cli import main" in contents["launch.py"]
    assert len(submitted.source_tar) < 200_000


@pytest.mark.notebook
def test_uploaded_data_set_and_bucket(submitted, endpoint):
    s3 = endpoint.client("s3")
    assert BUCKET in [b["Name"] for b in s3.list_buckets()["Buckets"]]  # the notebook made it
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/data/")["Contents"]]
    relative = sorted(k[len(f"{PREFIX}/data/"):] for k in keys)
    assert relative == sorted(f"{split}/{label}/{label}_{i:03d}.png"
                              for split, n in (("train", 8), ("val", 4))
                              for label in ("ants", "bees") for i in range(n))


@pytest.mark.notebook
def test_notebook_reports_status_metrics_plot_and_model(submitted):
    text, mimes = outputs(submitted.notebook)
    desc = submitted.description
    assert "status: Completed" in text
    assert f"model artifact: {desc['ModelArtifacts']['S3ModelArtifacts']}" in text
    assert desc["ModelArtifacts"]["S3ModelArtifacts"] == \
        f"s3://{BUCKET}/{PREFIX}/output/{desc['TrainingJobName']}/output/model.tar.gz"
    assert "image/png" in mimes  # the metrics plot
    assert "Applied value from config key = SageMaker.PythonSDK.Modules.TelemetryOptOut" in text
    assert submitted.seconds < 300


def _download_prefix(s3, uri: str, dest: str) -> str:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    for obj in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]:
        target = os.path.join(dest, os.path.relpath(obj["Key"], prefix))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        s3.download_file(bucket, obj["Key"], target)
    return dest


@pytest.mark.job
@pytest.mark.lab
@pytest.mark.notebook
def test_what_was_submitted_trains_under_aws_toolkit(submitted, endpoint, tmp_path):
    """Unpack the uploaded source and run it, with the recorded hyperparameters and the uploaded data,
    on two simulated hosts through AWS's real toolkit (``simulate --toolkit``)."""
    code = tmp_path / "code"
    with tarfile.open(fileobj=io.BytesIO(submitted.source_tar), mode="r:gz") as tar:
        tar.extractall(code, filter="data")
    # The bundle never ships launcher/simulate (it runs on a workstation, not in a job): add the
    # workstation's copy beside the uploaded package, which is what runs on the simulated hosts.
    assert not (code / "launcher" / "simulate").exists()
    shutil.copytree(os.path.join(REPO, "launcher", "simulate"), code / "launcher" / "simulate",
                    ignore=shutil.ignore_patterns("__pycache__"))
    s3 = endpoint.client("s3")
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"]
                for c in submitted.description["InputDataConfig"]}
    data = {name: _download_prefix(s3, uri, str(tmp_path / "data" / name)) for name, uri in channels.items()}
    # The recorded hyperparameters, decoded as AWS's toolkit decodes them; simulate adds the SDK's own
    # sagemaker_* entries again (pointing at its local copy of the source).
    raw = submitted.description["HyperParameters"]
    recorded = aws_argv.user_hyperparameters(aws_argv.decode(raw))
    workdir = tmp_path / "job"
    command = [PYTHON, "-m", "launcher", "simulate", "--hosts", "2", "--nproc-per-node", "1",
               "--instance-type", INSTANCE_TYPE, "--workdir", str(workdir), "--toolkit",
               "--hyperparameters", json.dumps(recorded),
               *[a for name, path in data.items() for a in ("--channel", f"{name}={path}")]]
    # cwd and PYTHONPATH = the unpacked source: `launcher` is imported from what was uploaded, and
    # 'train-script' names the uploaded script; simulate re-packs that copy as its sourcedir.tar.gz.
    env = {**endpoint.env(), "PYTHONPATH": str(code)}  # any AWS call would reach moto, nothing else
    proc = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["toolkit"] is True and [h["exit_code"] for h in summary["hosts"]] == [0, 0]
    assert "model.pt" in summary["hosts"][0]["model_files"]
    assert (workdir / "algo-1" / "model" / "model.pt").stat().st_size > 1000
    assert_gone([h["pid"] for h in summary["hosts"]])
    # AWS's toolkit ran it: its hyperparameters.json rendering, launch.py as the program.
    written = json.loads((workdir / "algo-1" / "input" / "config" / "hyperparameters.json").read_text())
    assert {k: v for k, v in written.items() if not k.startswith("sagemaker_")} == \
        {k: v for k, v in submitted.description["HyperParameters"].items() if not k.startswith("sagemaker_")}
    assert written["sagemaker_program"] == '"launch.py"'
    # What ran is what was uploaded: simulate packed the very same files.
    with tarfile.open(workdir / "sourcedir.tar.gz", "r:gz") as ran, \
            tarfile.open(fileobj=io.BytesIO(submitted.source_tar), mode="r:gz") as sent:
        ran_files = {m.name: ran.extractfile(m).read() for m in ran.getmembers() if m.isfile()}
        sent_files = {m.name: sent.extractfile(m).read() for m in sent.getmembers() if m.isfile()}
    assert ran_files == sent_files
    # The metric definitions sent to SageMaker find every metric in the log, as CloudWatch would.
    for definition in submitted.request["AlgorithmSpecification"]["MetricDefinitions"]:
        values = re.findall(definition["Regex"], log)
        assert len(values) >= EPOCHS, (definition, log[-3000:])
        assert all(float(v) >= 0 for v in values)
    history = json.loads((workdir / "algo-1" / "output" / "data" / "metrics.json").read_text())
    assert [r["epoch"] for r in history] == list(range(1, EPOCHS + 1))
    assert endpoint.trap.hits == []


@pytest.mark.job
@pytest.mark.lab
@pytest.mark.notebook
def test_the_heterogeneous_job_as_submitted_runs_on_simulated_hosts(submitted, endpoint, tmp_path):
    """The notebook's heterogeneous job: 2 train + 1 data instances, the launcher's hyperparameter; its
    recorded request replayed on three simulated hosts through AWS's real toolkit."""
    req = submitted.hetero
    groups = req["ResourceConfig"]["InstanceGroups"]
    assert [(g["InstanceGroupName"], g["InstanceType"], g["InstanceCount"]) for g in groups] == \
        [("train", INSTANCE_TYPE, 2), ("data", INSTANCE_TYPE, 1)]
    assert "InstanceCount" not in req["ResourceConfig"]
    hps = req["HyperParameters"]
    assert json.loads(hps["launcher-instance-groups"]) == ["train"] and hps["train-script"] == '"group_entry.py"'
    assert not [k for k in hps if "distribution" in k or k.endswith("_enabled")]  # no distribution=
    code = tmp_path / "code"
    with tarfile.open(fileobj=io.BytesIO(submitted.hetero_tar), mode="r:gz") as tar:
        tar.extractall(code, filter="data")
    assert (code / "group_entry.py").exists() and (code / "train_resnet.py").exists()
    shutil.copytree(os.path.join(REPO, "launcher", "simulate"), code / "launcher" / "simulate",
                    ignore=shutil.ignore_patterns("__pycache__"))
    s3 = endpoint.client("s3")
    data = {c["ChannelName"]: _download_prefix(s3, c["DataSource"]["S3DataSource"]["S3Uri"],
                                               str(tmp_path / "data" / c["ChannelName"]))
            for c in req["InputDataConfig"]}
    recorded = aws_argv.user_hyperparameters(aws_argv.decode(hps))
    spec = ",".join(f"{g['InstanceGroupName']}={g['InstanceType']}:{g['InstanceCount']}" for g in groups)
    workdir = tmp_path / "job"
    command = [PYTHON, "-m", "launcher", "simulate", "--instance-groups", spec, "--nproc-per-node", "1",
               "--workdir", str(workdir), "--toolkit", "--hyperparameters", json.dumps(recorded),
               *[a for name, path in data.items() for a in ("--channel", f"{name}={path}")]]
    env = {**endpoint.env(), "PYTHONPATH": str(code)}
    proc = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert [h["exit_code"] for h in summary["hosts"]] == [0, 0, 0]
    assert_gone([h["pid"] for h in summary["hosts"]])
    assert "[algo-1] [ddp-launcher] sagemaker host algo-1: node 0 of 2" in log
    assert "[algo-3] [ddp-launcher] sagemaker host algo-3: group data, outside the training world" in log
    assert "[algo-3] group data on algo-3: serving the training world of algo-1 until it ends" in log
    assert "[algo-3] [ddp-launcher] the training world has ended and this host's script with it" in log
    assert (workdir / "algo-1" / "model" / "model.pt").stat().st_size > 1000
    assert endpoint.trap.hits == []


# ------------------------------------------------------------------------------------------------
# local_simulation.ipynb on this machine
# ------------------------------------------------------------------------------------------------

@pytest.mark.job
@pytest.mark.lab
@pytest.mark.notebook
def test_local_simulation_notebook_plots_the_curves(tmp_path):
    workdir = tmp_path / "sim"
    env = launcher_env()
    env.pop("PYTHONPATH")
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env["TMPDIR"] = str(tmp_path)  # the generated data set, the launchers' run directories
    start = time.monotonic()
    nb = execute(LOCAL_NOTEBOOK, {"epochs": 2, "extra_hyperparameters": TINY, "workdir": str(workdir)},
                 env, str(tmp_path / "local_simulation.ipynb"))
    seconds = time.monotonic() - start
    text, mimes = outputs(nb)
    assert "image/png" in mimes, text[-3000:]
    history = json.loads((workdir / "algo-1" / "output" / "data" / "metrics.json").read_text())
    assert [r["epoch"] for r in history] == [1, 2]
    assert "algo-1: exit 0" in text and "algo-2: exit 0" in text
    summary = json.loads((workdir / "summary.json").read_text())
    assert_gone([h["pid"] for h in summary["hosts"]])
    assert seconds < 600


# ------------------------------------------------------------------------------------------------
# Committed notebooks: no outputs
# ------------------------------------------------------------------------------------------------

def test_notebooks_committed_without_outputs():
    paths = check_notebooks.committed_notebooks(REPO)
    assert {SAGEMAKER_NOTEBOOK, LOCAL_NOTEBOOK} <= set(paths)
    problems = [p for path in paths for p in check_notebooks.problems(path)]
    assert not problems, "\n".join(problems) + "\nfix: python tools/check_notebooks.py --fix"
    for path in (SAGEMAKER_NOTEBOOK, LOCAL_NOTEBOOK):
        nb = nbformat.read(path, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1


def test_checker_finds_outputs_and_fix_strips_them(tmp_path):
    nb = nbformat.read(SAGEMAKER_NOTEBOOK, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    cell.execution_count = 3
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hello\n")]
    cell.metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    path = tmp_path / "dirty.ipynb"
    nbformat.write(nb, str(path))
    found = check_notebooks.problems(str(path))
    assert len(found) == 3, found
    assert any("1 output" in f for f in found) and any("execution count 3" in f for f in found)
    assert check_notebooks.main([str(path)]) == 1
    assert check_notebooks.main(["--fix", str(path)]) == 0
    with open(path) as fh, open(SAGEMAKER_NOTEBOOK) as original:
        assert fh.read() == original.read()  # stripped back to exactly the committed text
