"""The training scripts and ``ddp_utils``, run as real processes (gloo on CPU, 127.0.0.1 only).

Every test that starts processes records the launcher's PID and every worker's (``ddp_utils``
writes ``<rank>.pid`` into ``DDP_UTILS_PID_DIR``) and proves with ``assert_gone`` that none is left.
Data is made on disk by the tests (a fake CIFAR-10 in torchvision's pickle format, a tiny
ImageFolder of PNGs) or comes with scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import PYTHON, TRAIN_SCRIPTS, LiveProcess, assert_gone, free_port, launcher_env

sys.path.insert(0, TRAIN_SCRIPTS)
import ddp_utils  # noqa: E402
import train_cifar10  # noqa: E402
import train_digits  # noqa: E402
import train_resnet  # noqa: E402

CIFAR = os.path.join(TRAIN_SCRIPTS, "train_cifar10.py")
RESNET = os.path.join(TRAIN_SCRIPTS, "train_resnet.py")
DIGITS = os.path.join(TRAIN_SCRIPTS, "train_digits.py")
KILLED_ONCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "digits_killed_once.py")
RUN_TIMEOUT = 240.0


# ------------------------------------------------------------------------------------------------
# Running jobs
# ------------------------------------------------------------------------------------------------

class Run(LiveProcess):
    """A launcher (or ``launcher simulate``) started by the test; its output is read as it comes."""

    def __init__(self, argv: list[str], tmp: Path, env: Optional[dict[str, str]] = None) -> None:
        self.pid_dir = tmp / "pids"
        self.hash_dir = tmp / "hashes"
        self.tmpdir = tmp / "tmp"  # TMPDIR: where each launcher makes its run directory (torchrun alone, its own)
        self.tmpdir.mkdir(exist_ok=True)
        super().__init__(argv, str(tmp), launcher_env(DDP_UTILS_PID_DIR=str(self.pid_dir),
                                                      DDP_UTILS_HASH_DIR=str(self.hash_dir), TMPDIR=str(self.tmpdir),
                                                      **(env or {})))

    def abort(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # its watchdog kills the tree
        self.finish(timeout=30)

    def finish(self, timeout: float = RUN_TIMEOUT) -> int:
        """Wait for the end (killing it on a timeout); then prove that no process is left."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)  # its watchdog kills the tree
            self.proc.wait()
            code = None
        self.join_readers()
        assert_gone(self.pids())
        if code is None:
            pytest.fail(f"still running after {timeout} s:\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}")
        if code >= 0:  # it ended by itself (not killed by the test): every launcher removed its run directory
            assert [n for n in os.listdir(self.tmpdir) if n.startswith("ddp-launcher-")] == [], self.stderr[-3000:]
        return code

    def pids(self) -> list[int]:
        workers = [int(p.read_text()) for p in self.pid_dir.glob("*.pid")] if self.pid_dir.exists() else []
        return [self.proc.pid, *workers]

    def hashes(self) -> dict[int, str]:
        return {int(p.stem): p.read_text() for p in self.hash_dir.glob("*.sha256")}


def launch(tmp: Path, script: str, args: list[str], env: Optional[dict[str, str]] = None) -> Run:
    """``python -m launcher --nproc-per-node 2 script args`` (one host)."""
    tmp.mkdir(exist_ok=True)
    return Run([PYTHON, "-m", "launcher", "--nproc-per-node", "2", script, *args], tmp, env)


def simulate(tmp: Path, script: str, args: list[str], channels: dict[str, Path]) -> tuple[Run, Path]:
    """A 2-host SageMaker job (1 process per host) with ``launcher simulate``; returns the run and its dir."""
    workdir = tmp / "sim"
    channel_args = [w for name, path in channels.items() for w in ("--channel", f"{name}={path}")]
    run = Run([PYTHON, "-m", "launcher", "simulate", "--hosts", "2", "--nproc-per-node", "1",
               "--workdir", str(workdir), *channel_args, "--", script, *args], tmp)
    return run, workdir


def finish_simulation(run: Run, workdir: Path) -> dict[str, Any]:
    """Wait for a simulated job; check it succeeded; include the host launchers in ``assert_gone``."""
    code = run.finish()
    summary = json.loads((workdir / "summary.json").read_text())
    assert_gone([h["pid"] for h in summary["hosts"]])
    assert code == 0, f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert [h["exit_code"] for h in summary["hosts"]] == [0, 0]
    assert summary["hosts"][1]["model_files"] == []  # only rank 0 (on algo-1) writes the model
    return summary


def metric_values(text: str) -> dict[str, list[float]]:
    """Every value of every metric in a log, found with the regexes SageMaker would use."""
    return {d["Name"]: [float(v) for v in re.findall(d["Regex"], text)] for d in ddp_utils.METRIC_DEFINITIONS}


def check_history(history: list[dict[str, Any]], epochs: int) -> None:
    assert [r["epoch"] for r in history] == list(range(1, epochs + 1))
    for record in history:
        assert 0.0 <= record["val_accuracy"] <= 1.0 and record["train_loss"] > 0 and record["images_per_sec"] > 0


# ------------------------------------------------------------------------------------------------
# Data made by the tests
# ------------------------------------------------------------------------------------------------

def make_fake_cifar10(root: Path, per_batch: int = 24, test: int = 31) -> Path:
    """A small CIFAR-10 in torchvision's layout: ``cifar-10-batches-py/data_batch_1..5``, ``test_batch``."""
    folder = root / train_cifar10.BATCHES_DIR
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, count in [*((n, per_batch) for n in train_cifar10.TRAIN_FILES), ("test_batch", test)]:
        labels = rng.integers(0, 10, count)
        data = rng.integers(0, 256, (count, 3 * 32 * 32), dtype=np.uint8)
        data[:, :1024] = (labels * 25)[:, None].astype(np.uint8)  # the red channel tells the class
        with open(folder / name, "wb") as fh:
            pickle.dump({"batch_label": name, "labels": labels.tolist(), "data": data,
                         "filenames": [f"{i}.png" for i in range(count)]}, fh)
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": list(train_cifar10.CLASSES), "num_cases_per_batch": per_batch}, fh)
    return root


def make_image_folder(root: Path, per_class: int = 12, val_per_class: int = 5, size: int = 32) -> Path:
    """``train/<class>/*.png`` and ``val/<class>/*.png`` for two classes told apart by colour."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for index, cls in enumerate(("ants", "bees")):
            (root / split / cls).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 128, (size, size, 3), dtype=np.uint8)
                pixels[..., index] += 120
                Image.fromarray(pixels).save(root / split / cls / f"{i}.png")
    return root


# ------------------------------------------------------------------------------------------------
# Unit tests: flags, metric lines, checkpoints
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [("True", True), ("true", True), ("1", True), ("yes", True),
                                        ("False", False), ("false", False), ("0", False), ("no", False)])
def test_str2bool(text: str, value: bool) -> None:
    assert ddp_utils.str2bool(text) is value


def test_boolean_flags_false_really_is_false() -> None:
    parsers = {"cifar": train_cifar10.build_parser(), "resnet": train_resnet.build_parser(),
               "digits": train_digits.build_parser()}
    for name, parser in parsers.items():
        assert all(action.type is not bool for action in parser._actions), name
        args = parser.parse_args(["--scale-lr", "False", "--resume", "false", "--bf16", "0"])
        assert (args.scale_lr, args.resume, args.bf16) == (False, False, False), name
        args = parser.parse_args(["--scale-lr", "True", "--resume", "1", "--channels-last", "auto"])
        assert (args.scale_lr, args.resume, args.channels_last) == (True, True, None), name
        with pytest.raises(SystemExit):
            parser.parse_args(["--scale-lr", "maybe"])
    assert parsers["cifar"].parse_args(["--augment", "False"]).augment is False
    assert parsers["resnet"].parse_args(["--pretrained-download", "False"]).pretrained_download is False
    assert parsers["resnet"].parse_args(["--pretrained-download", "True"]).pretrained_download is True
    assert parsers["digits"].parse_args(["--plot", "False"]).plot is False
    # The seed's command line still works, --output-dir being where the model goes.
    args = parsers["cifar"].parse_args(["--data-dir", "d", "--epochs", "2", "--batch-size", "8", "--workers",
                                        "0", "--learning-rate", "0.01", "--momentum", "0.5", "--output-dir",
                                        "o", "--print-freq", "5", "--backend", "gloo", "--timeout", "5"])
    assert (args.model_dir, args.batch_size, args.learning_rate, args.timeout) == ("o", 8, 0.01, 5)


CPUINFO_X86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx512f {extra} avx512vl\n"


@pytest.mark.parametrize("text,native", [
    (CPUINFO_X86.format(extra="avx512_bf16"), True),  # Cooper Lake, AMD Zen 4 and newer
    (CPUINFO_X86.format(extra="amx_bf16 amx_tile"), True),  # Sapphire Rapids and newer
    (CPUINFO_X86.format(extra="avx512_vnni"), False),  # Skylake / Cascade Lake (ml.c5, ml.m5): fp32
    ("processor\t: 0\nFeatures\t: fp asimd sve\n", False),
])
def test_bf16_is_the_default_only_where_the_cpu_computes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             text: str, native: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    read = ddp_utils.cpu_flags
    monkeypatch.setattr(ddp_utils, "cpu_flags", lambda: read(str(cpuinfo)))
    job = ddp_utils.Job(0, 0, 1, torch.device("cpu"), "gloo")
    assert ddp_utils.native_bf16(job) is native
    assert ddp_utils.use_bf16(job, None) is native  # --bf16 auto
    assert ddp_utils.use_bf16(job, False) is False and ddp_utils.use_bf16(job, True) is True
    x = torch.randn(4, 3)
    with ddp_utils.autocast(job, None):
        out = torch.nn.functional.linear(x, torch.randn(2, 3))
    assert out.dtype == (torch.bfloat16 if native else torch.float32)


def test_cpu_flags_of_a_machine_without_cpuinfo(tmp_path: Path) -> None:
    assert ddp_utils.cpu_flags(str(tmp_path / "absent")) == frozenset()


ALLOCATION_LOOP = """
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
import ddp_utils
kept = ddp_utils.keep_freed_memory()
torch.ones(1 << 20).sum()  # the first step also faults in torch's one-time state (kernels, thread pool)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    torch.ones(1 << 20).sum()  # 4 MiB allocated, touched and freed: what a training step does
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def test_freed_activation_memory_is_reused_instead_of_faulted_in_again(tmp_path: Path) -> None:
    def faults(**env: str) -> dict[str, Any]:
        out = subprocess.run([PYTHON, "-c", ALLOCATION_LOOP, TRAIN_SCRIPTS], capture_output=True, text=True,
                             env={**os.environ, **env}, check=True, timeout=120).stdout
        return json.loads(out)

    tuned, chosen = faults(), faults(MALLOC_MMAP_THRESHOLD_="131072")
    assert chosen["kept"] is False  # the user's own malloc setting wins
    assert tuned["kept"] is True
    # glibc's default: every 4 MiB block is mmap'ed and faulted in page by page (1,024 faults each, 50 steps:
    # ~51,200); kept, the heap reuses its pages: a few blocks' worth at most (1,024-4,097 measured), whatever
    # the number of steps.
    assert chosen["faults"] > 40 * 1024 and tuned["faults"] < 8 * 1024, (tuned, chosen)


LATE_RELEASE = """
import json, os, sys, threading, time, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import ddp_utils
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
flag = torch.zeros(1)
work = ddp_utils.collective(dist.all_reduce, flag, async_op=True)
work.wait()
held = flag._use_count() > 1  # finished, and still held on the C++ side

def let_go():  # what gloo's worker thread does after the caller's wait(), here late
    global work
    time.sleep(float(sys.argv[3]))
    work = None

threading.Thread(target=let_go, daemon=True).start()
started = time.monotonic()
ddp_utils.shutdown(timeout=float(sys.argv[4]))
print(json.dumps({"held": held, "waited": time.monotonic() - started, "after": flag._use_count()}))
"""


@pytest.mark.parametrize("release_after,timeout", [(0.5, 5.0), (30.0, 0.3)])
def test_shutdown_waits_until_no_collective_holds_our_tensors(release_after: float, timeout: float) -> None:
    """Leaving before gloo's thread let go of a tensor kills the process with SIGABRT at exit."""
    proc = subprocess.run([PYTHON, "-c", LATE_RELEASE, TRAIN_SCRIPTS, str(free_port()), str(release_after),
                           str(timeout)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["held"] is True
    if release_after < timeout:  # waits for the release, then goes on
        assert release_after - 0.05 <= found["waited"] < timeout and found["after"] == 1, found
    else:  # never hangs: gives up after its timeout
        assert timeout - 0.05 <= found["waited"] < release_after and found["after"] > 1, found


def test_metric_lines_match_the_metric_definitions() -> None:
    record = {"epoch": 3, "train_loss": 0.12344, "val_loss": 0.2, "val_accuracy": 0.97123,
              "images_per_sec": 1234.56, "lr": 0.1}
    line = ddp_utils.metric_line(record)
    assert line == "METRIC epoch=3 train_loss=0.1234 val_loss=0.2000 val_accuracy=0.9712 images_per_sec=1234.6"
    found = metric_values(f"[rank0]:{line}\n[rank0]:other 1.0 text\n")
    assert found == {"epoch": [3.0], "train_loss": [0.1234], "val_loss": [0.2], "val_accuracy": [0.9712],
                     "images_per_sec": [1234.6]}
    assert [d["Name"] for d in ddp_utils.METRIC_DEFINITIONS] == list(ddp_utils.METRIC_NAMES)


def test_random_generators_come_back_from_a_checkpoint(tmp_path: Path) -> None:
    """What a checkpoint keeps of the generators (torch's, Python's) survives torch.save and the weights-only
    load: the draws after a resume are the draws an uninterrupted run makes (dropout masks, shuffles)."""
    import random

    job = ddp_utils.Job(0, 0, 1, torch.device("cpu"), "gloo")
    torch.manual_seed(3)
    random.seed(3)
    torch.rand(5), random.random()  # a run that has drawn already
    path = ddp_utils.save_checkpoint(str(tmp_path), {"epoch": 1, "step": 0, "rng": [ddp_utils.rng_state(job)]})
    expected = (torch.rand(8), random.random(), torch.nn.functional.dropout(torch.ones(16), 0.5))
    torch.manual_seed(99)
    random.seed(99)
    _, saved = ddp_utils.load_latest_checkpoint(str(tmp_path))
    ddp_utils.set_rng_state(job, saved["rng"][0])
    again = (torch.rand(8), random.random(), torch.nn.functional.dropout(torch.ones(16), 0.5))
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1] and torch.equal(expected[2], again[2])
    assert path.endswith("checkpoint-e0001-s0000000.pt")


def test_a_half_written_checkpoint_never_replaces_a_good_one(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    good = ddp_utils.save_checkpoint(str(directory), {"epoch": 1, "step": 0, "model": {"w": torch.ones(4)}})
    good_bytes = Path(good).read_bytes()
    # A real crash in the middle of the write: the kernel kills the writer (SIGXFSZ) at 64 KiB.
    code = (f"import resource, signal, sys, torch\nsys.path.insert(0, {TRAIN_SCRIPTS!r})\nimport ddp_utils\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
            "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))\n"
            f"ddp_utils.save_checkpoint({str(directory)!r}, "
            "{'epoch': 2, 'step': 0, 'model': {'w': torch.zeros(1_000_000)}})\n")
    proc = subprocess.Popen([PYTHON, "-c", code], env=launcher_env(PYTHONDONTWRITEBYTECODE="1"))
    assert proc.wait(timeout=120) == -signal.SIGXFSZ
    assert_gone([proc.pid])
    leftovers = list(directory.glob(".tmp-*"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size == 65536  # the half-written file
    assert ddp_utils.list_checkpoints(str(directory)) == [good]
    assert Path(good).read_bytes() == good_bytes
    path, state = ddp_utils.load_latest_checkpoint(str(directory))
    assert (path, state["epoch"]) == (good, 1)
    # A truncated file under a checkpoint's name (say, a partial copy) is skipped, not trusted.
    (directory / "checkpoint-e0003-s0000000.pt").write_bytes(leftovers[0].read_bytes())
    path, state = ddp_utils.load_latest_checkpoint(str(directory))
    assert (path, state["epoch"]) == (good, 1)
    # The next save works and cleans up what the crashed writer left.
    newest = ddp_utils.save_checkpoint(str(directory), {"epoch": 4, "step": 0, "model": {"w": torch.ones(4)}})
    assert ddp_utils.load_latest_checkpoint(str(directory))[1]["epoch"] == 4
    assert not list(directory.glob(".tmp-*")) and newest in ddp_utils.list_checkpoints(str(directory))


def test_checkpoint_dir_follows_sagemaker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    assert ddp_utils.sagemaker_checkpoint_dir() == str(tmp_path / "checkpoints")
    (tmp_path / "input" / "config").mkdir(parents=True)
    (tmp_path / "input" / "config" / "checkpointconfig.json").write_text(
        json.dumps({"LocalPath": str(tmp_path / "ck"), "S3Uri": "s3://b/k"}))
    assert ddp_utils.sagemaker_checkpoint_dir() == str(tmp_path / "ck")
    args = ddp_utils.resolve_paths(train_digits.build_parser().parse_args(["--checkpoint-dir", "mine"]))
    assert args.checkpoint_dir == "mine"


# ------------------------------------------------------------------------------------------------
# Paths on every platform: option > SageMaker > Vertex AI / OCI ADS > DDP_* > default
# ------------------------------------------------------------------------------------------------

# Per directory, its sources from the highest to the lowest: (option or variable, value set, path expected).
PATH_SOURCES: dict[str, list[tuple[str, str, str]]] = {
    "model_dir": [("--model-dir", "opt/model", "opt/model"), ("SM_MODEL_DIR", "/sm/model", "/sm/model"),
                  ("AIP_MODEL_DIR", "gs://vertex-bucket/job/model/", "/gcs/vertex-bucket/job/model"),
                  ("OCI__SYNC_DIR", "/oci/sync", "/oci/sync"), ("DDP_MODEL_DIR", "/ddp/model", "/ddp/model")],
    "output_data_dir": [("--output-data-dir", "opt/out", "opt/out"), ("SM_OUTPUT_DATA_DIR", "/sm/out", "/sm/out"),
                        ("AIP_TENSORBOARD_LOG_DIR", "gs://vertex-bucket/job/logs/", "/gcs/vertex-bucket/job/logs"),
                        ("DDP_OUTPUT_DIR", "/ddp/out", "/ddp/out")],
    "checkpoint_dir": [("--checkpoint-dir", "opt/ck", "opt/ck"),
                       ("SageMaker's checkpoint dir", "{sagemaker}", "{sagemaker}/checkpoints"),
                       ("AIP_CHECKPOINT_DIR", "gs://vertex-bucket/job/checkpoints/",
                        "/gcs/vertex-bucket/job/checkpoints"),
                       ("DDP_CHECKPOINT_DIR", "/ddp/ck", "/ddp/ck")],
}
# Where each directory goes when none of its sources is set, given the other directories' environment.
PATH_DEFAULTS = {"model_dir": ("default", "outputs"), "output_data_dir": ("the model dir", "/ddp/model"),
                 "checkpoint_dir": ("<output data dir>/checkpoints", "/ddp/out/checkpoints")}


def _locate(field: str, sources: list[tuple[str, str]], empty: list[str], base: Path) -> ddp_utils.Paths:
    """``locate_paths`` with ``sources`` (options and variables) set, ``empty`` set to "" and, for the
    fields not under test, only their neutral variables."""
    assert not os.path.isdir("/opt/ml/input/config"), "this machine looks like a SageMaker host"
    env = {"DDP_MODEL_DIR": "/ddp/model", "DDP_OUTPUT_DIR": "/ddp/out", "DDP_CHECKPOINT_DIR": "/ddp/ck"}
    for name, _value, _ in PATH_SOURCES[field]:
        env.pop(name, None)
    options: dict[str, Optional[str]] = {}
    for name, value in [*sources, *((n, "") for n in empty)]:
        value = value.format(sagemaker=base)
        if name.startswith("--"):
            options[name[2:].replace("-", "_")] = value or None  # argparse's None: the option was not given
        else:
            env["SAGEMAKER_BASE_DIR" if name == "SageMaker's checkpoint dir" else name] = value
    return ddp_utils.locate_paths(environ=env, **options)


@pytest.mark.parametrize("field,index", [(f, i) for f, sources in PATH_SOURCES.items()
                                         for i in range(len(sources) + 1)])
def test_each_path_source_beats_every_lower_one(tmp_path: Path, field: str, index: int) -> None:
    """Sources ``index``.. are all set, the higher ones are empty (unset): source ``index`` wins."""
    sources = PATH_SOURCES[field]
    paths = _locate(field, [(n, v) for n, v, _ in sources[index:]], [n for n, _, _ in sources[:index]], tmp_path)
    found = getattr(paths, field)
    if index == len(sources):
        assert (found.source, found.path) == PATH_DEFAULTS[field]
    else:
        name, _value, expected = sources[index]
        assert (found.source, found.path) == (name, expected.format(sagemaker=tmp_path))
    assert f"{field.replace('_', ' ')} {found.path} ({found.source})" in paths.describe()


def test_oci_sync_dir_alone_receives_model_metrics_and_checkpoints() -> None:
    paths = ddp_utils.locate_paths(environ={"OCI__SYNC_DIR": "/home/datascience/sync"})
    assert (paths.model_dir.path, paths.output_data_dir.path, paths.checkpoint_dir.path) == (
        "/home/datascience/sync", "/home/datascience/sync", "/home/datascience/sync/checkpoints")


def test_nothing_set_keeps_the_old_local_defaults() -> None:
    args = ddp_utils.resolve_paths(train_digits.build_parser().parse_args([]), environ={})
    assert (args.model_dir, args.output_data_dir, args.checkpoint_dir) == ("outputs", "outputs", "outputs/checkpoints")


@pytest.mark.parametrize("value,expected", [
    ("gs://bucket/a/b/", "/gcs/bucket/a/b"), ("gs://bucket", "/gcs/bucket"), ("GS://bucket/x", "/gcs/bucket/x"),
    ("/plain/local", "/plain/local"), ("relative/dir", "relative/dir"), ("/gcs/bucket/x", "/gcs/bucket/x"),
])
def test_gs_uris_are_read_through_the_cloud_storage_fuse_mount(value: str, expected: str) -> None:
    assert ddp_utils.local_path("AIP_MODEL_DIR", value) == expected


@pytest.mark.parametrize("name", ["DDP_MODEL_DIR", "AIP_CHECKPOINT_DIR", "SM_OUTPUT_DATA_DIR", "DDP_DATA_DIR"])
@pytest.mark.parametrize("uri", ["s3://bucket/key", "oci://bucket@namespace/prefix", "https://example.com/x"])
def test_another_uri_is_bad_input_naming_the_variable(capsys: pytest.CaptureFixture[str], name: str,
                                                      uri: str) -> None:
    with pytest.raises(SystemExit) as exc:
        ddp_utils.locate_paths(environ={name: uri}) if name != "DDP_DATA_DIR" else ddp_utils.channel(
            "train", environ={name: uri})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {name}={uri!r}: "), err


@pytest.mark.parametrize("env,expected", [
    ({"SM_CHANNEL_TRAIN": "/sm/train", "DDP_CHANNEL_TRAIN": "/ddp/chan", "DDP_DATA_DIR": "/ddp"}, "/sm/train"),
    ({"SM_CHANNEL_TRAIN": "", "DDP_CHANNEL_TRAIN": "/ddp/chan", "DDP_DATA_DIR": "/ddp"}, "/ddp/chan"),
    ({"DDP_DATA_DIR": "/ddp"}, "/ddp/train"),
    ({"DDP_DATA_DIR": "gs://bucket/data/"}, "/gcs/bucket/data/train"),
    ({"DDP_CHANNEL_TRAIN": "gs://bucket/cifar"}, "/gcs/bucket/cifar"),
    ({"DDP_CHANNEL_VAL": "/ddp/val", "SM_CHANNEL_VAL": "/sm/val"}, "the default"),  # another channel
    ({}, "the default"),
])
def test_channel_sources_in_order(env: dict[str, str], expected: str) -> None:
    assert ddp_utils.channel("train", "the default", environ=env) == expected
    assert ddp_utils.channel("train", environ={}) is None


def test_resnet_finds_train_and_val_under_ddp_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith(("SM_CHANNEL_", "DDP_CHANNEL_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DDP_DATA_DIR", "/data/hymenoptera")
    args = train_resnet.build_parser().parse_args([])
    assert train_resnet.data_dirs(args) == ("/data/hymenoptera/train", "/data/hymenoptera/val")
    args = train_resnet.build_parser().parse_args(["--data-dir", "mine"])  # the option first
    assert train_resnet.data_dirs(args) == ("mine/train", "mine/val")


# ------------------------------------------------------------------------------------------------
# FitSettings: everything fit() is told
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("module,defaults", [
    (train_digits, {"epochs": 30, "batch_size": 32, "print_freq": 0, "channels_last": False}),
    (train_cifar10, {"epochs": 10, "batch_size": 16, "print_freq": 200, "channels_last": None}),
    (train_resnet, {"epochs": 25, "batch_size": 32, "print_freq": 0, "channels_last": None}),
])
def test_fit_settings_from_each_scripts_arguments(module: Any, defaults: dict[str, Any]) -> None:
    env = {"DDP_OUTPUT_DIR": "/ddp/out", "DDP_CHECKPOINT_DIR": "/ddp/ck"}
    settings = ddp_utils.FitSettings.from_args(ddp_utils.resolve_paths(module.build_parser().parse_args([]), env))
    assert settings == ddp_utils.FitSettings(checkpoint_dir="/ddp/ck", output_data_dir="/ddp/out", resume=True,
                                             bf16=None, **defaults)
    args = ddp_utils.resolve_paths(module.build_parser().parse_args(
        ["--epochs", "3", "--batch-size", "5", "--checkpoint-dir", "ck", "--output-data-dir", "out",
         "--resume", "false", "--print-freq", "7", "--bf16", "true", "--channels-last", "false"]), env)
    assert ddp_utils.FitSettings.from_args(args) == ddp_utils.FitSettings(
        epochs=3, batch_size=5, checkpoint_dir="ck", output_data_dir="out", resume=False, print_freq=7,
        bf16=True, channels_last=False)


def test_fit_settings_refuse_what_fit_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    parser = train_digits.build_parser()
    with pytest.raises(ValueError, match="resolve_paths"):
        ddp_utils.FitSettings.from_args(parser.parse_args([]))  # the directories are not filled yet
    for argv, line in ((["--batch-size", "0"], "--batch-size=0: must be at least 1"),
                       (["--epochs", "-1"], "--epochs=-1: must be at least 0"),
                       (["--print-freq", "-2"], "--print-freq=-2: must be at least 0")):
        with pytest.raises(SystemExit) as exc:
            ddp_utils.FitSettings.from_args(ddp_utils.resolve_paths(parser.parse_args(argv), {}))
        assert exc.value.code == 2 and capsys.readouterr().err == f"error: {line}\n"
    settings = ddp_utils.FitSettings(epochs=1, batch_size=1, checkpoint_dir="c", output_data_dir="o")
    with pytest.raises(AttributeError):
        settings.epochs = 2  # type: ignore[misc]  # frozen: nothing changes it behind fit's back


def test_fit_needs_nothing_but_its_settings(tmp_path: Path) -> None:
    """A world of one, in this process: fit() trains from FitSettings alone (an args Namespace is refused)."""
    job = ddp_utils.Job(0, 0, 1, torch.device("cpu"), "gloo")
    torch.manual_seed(0)
    x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_sampler = ddp_utils.sampler(job, len(x))

    def batches() -> Any:
        order = torch.tensor(list(train_sampler), dtype=torch.int64)
        return ((x[sel], y[sel]) for sel in order.split(8))

    kwargs = {"train_sampler": train_sampler, "train_batches": batches,
              "evaluate_fn": lambda: ddp_utils.evaluate(job, model, [(x, y)], bf16=False)}
    with pytest.raises(TypeError, match="FitSettings"):
        ddp_utils.fit(job, train_digits.build_parser().parse_args([]), model, optimizer, **kwargs)
    settings = ddp_utils.FitSettings(epochs=2, batch_size=8, checkpoint_dir=str(tmp_path / "ck"),
                                     output_data_dir=str(tmp_path / "out"), bf16=False, channels_last=False)
    result = ddp_utils.fit(job, settings, model, optimizer, **kwargs)
    check_history(result.history, 2)
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == result.history
    assert [os.path.basename(p) for p in ddp_utils.list_checkpoints(str(tmp_path / "ck"))] == [
        "checkpoint-e0001-s0000000.pt", "checkpoint-e0002-s0000000.pt"]
    path = ddp_utils.save_model(job, str(tmp_path / "model"), model, "m.pt")
    assert path == str(tmp_path / "model" / "m.pt")
    saved = torch.load(path, weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_resnet_starts_from_a_local_weights_file(tmp_path: Path) -> None:
    import torchvision

    job = ddp_utils.Job(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    imagenet = torchvision.models.resnet18(num_classes=1000)  # an ImageNet-shaped file, as torchvision's
    torch.save(imagenet.state_dict(), tmp_path / "resnet18.pth")
    model = train_resnet.build_model(job, 2, str(tmp_path / "resnet18.pth"), download=False)
    assert model.fc.out_features == 2  # the 1000-class classifier was left out, the rest loaded
    assert torch.equal(model.conv1.weight, imagenet.conv1.weight)
    assert torch.equal(model.layer4[1].bn2.running_var, imagenet.layer4[1].bn2.running_var)
    torch.save(model.state_dict(), tmp_path / "ours.pt")  # our own saved model loads whole
    again = train_resnet.build_model(job, 2, str(tmp_path / "ours.pt"), download=False)
    assert ddp_utils.state_hash(again) == ddp_utils.state_hash(model)
    torch.save({"something": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(SystemExit, match="not ResNet-18 weights"):
        train_resnet.build_model(job, 2, str(tmp_path / "other.pt"), download=False)


# ------------------------------------------------------------------------------------------------
# Distributed evaluation: exact totals
# ------------------------------------------------------------------------------------------------

EVAL_SCRIPT = """
import json, sys, torch
import ddp_utils
from torch.utils.data import DataLoader, Subset, TensorDataset

job = ddp_utils.start(timeout_minutes=2)
torch.manual_seed(0)
n = 101  # not divisible by the world size
x, y = torch.randn(n, 8), torch.randint(0, 3, (n,))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
share = ddp_utils.shard(job, n)
index = torch.tensor(share)
# fp32 (bf16=False): the comparison is of the sharding, not of the precision this CPU would pick
tensors = ddp_utils.evaluate(job, ddp_utils.wrap(job, model), [(x[index], y[index])], bf16=False)
loader = ddp_utils.evaluate(job, model, DataLoader(Subset(TensorDataset(x, y), share), batch_size=7), bf16=False)
with open(f"{sys.argv[1]}/{job.rank}.json", "w") as fh:
    json.dump({"world": job.world_size, "share": list(share), "tensors": tensors, "loader": loader}, fh)
if job.is_main:
    torch.save({"model": model.state_dict(), "x": x, "y": y}, f"{sys.argv[1]}/data.pt")
ddp_utils.shutdown()
"""


@pytest.mark.job
def test_distributed_evaluation_equals_one_process(tmp_path: Path) -> None:
    script = tmp_path / "eval_check.py"
    script.write_text(EVAL_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    run = launch(tmp_path, str(script), [str(out)],
                 {"PYTHONPATH": TRAIN_SCRIPTS + os.pathsep + launcher_env()["PYTHONPATH"]})
    assert run.finish() == 0, run.stdout + run.stderr
    saved = torch.load(out / "data.pt", weights_only=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model.load_state_dict(saved["model"])
    with torch.no_grad():  # one process, the whole data set, one batch
        logits = model(saved["x"])
    correct = int((logits.argmax(1) == saved["y"]).sum())
    loss = float(F.cross_entropy(logits, saved["y"]))
    results = [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["world"] for r in results] == [2, 2]
    assert sorted(results[0]["share"] + results[1]["share"]) == list(range(101))  # no padding, no overlap
    assert 0 < correct < 101
    for result in results:
        for way in ("tensors", "loader"):
            assert (result[way]["val_count"], result[way]["val_correct"]) == (101, correct)
            assert result[way]["val_accuracy"] == correct / 101
            assert result[way]["val_loss"] == pytest.approx(loss, rel=1e-5)


# ------------------------------------------------------------------------------------------------
# The scripts, end to end
# ------------------------------------------------------------------------------------------------

@pytest.mark.job
@pytest.mark.lab
def test_cifar10_two_hosts_fake_dataset(tmp_path: Path) -> None:
    data = make_fake_cifar10(tmp_path / "cifar")
    run, workdir = simulate(tmp_path, CIFAR, ["--epochs", "2", "--batch-size", "16", "--timeout", "2"],
                            {"train": data})
    finish_simulation(run, workdir)
    found = metric_values(run.stdout)
    assert found["epoch"] == [1.0, 2.0] and len(found["val_accuracy"]) == 2
    assert "training and 31 test images" in run.stdout and "120 training" in run.stdout
    job = ddp_utils.Job(0, 0, 2, torch.device("cpu"), "gloo")
    precision = "bf16 autocast" if ddp_utils.native_bf16(job) else "fp32"  # --bf16 auto on this CPU
    assert f"precision {precision} (--bf16), channels_last images" in run.stdout
    history = json.loads((workdir / "algo-1" / "output" / "data" / "metrics.json").read_text())
    check_history(history, 2)
    assert history[-1]["val_count"] == 31
    model = train_cifar10.Net()
    model.load_state_dict(torch.load(workdir / "algo-1" / "model" / "cifar_net.pt", weights_only=True))
    hashes = run.hashes()
    assert sorted(hashes) == [0, 1] and hashes[0] == hashes[1] == ddp_utils.state_hash(model)
    assert ddp_utils.list_checkpoints(str(workdir / "algo-1" / "checkpoints"))


@pytest.mark.job
@pytest.mark.lab
def test_resnet_two_hosts_image_folder(tmp_path: Path) -> None:
    data = make_image_folder(tmp_path / "hymenoptera")
    run, workdir = simulate(tmp_path, RESNET, ["--epochs", "2", "--batch-size", "4", "--image-size", "32",
                                               "--workers", "0", "--timeout", "2"],
                            {"train": data / "train", "val": data / "val"})
    finish_simulation(run, workdir)
    assert "classes ['ants', 'bees']: 24 training and 10 validation images" in run.stdout
    check_history(json.loads((workdir / "algo-1" / "output" / "data" / "metrics.json").read_text()), 2)
    import torchvision

    model = torchvision.models.resnet18(num_classes=2)
    model.load_state_dict(torch.load(workdir / "algo-1" / "model" / "model.pt", weights_only=True))
    assert json.loads((workdir / "algo-1" / "model" / "classes.json").read_text()) == ["ants", "bees"]
    hashes = run.hashes()  # parameters and BatchNorm buffers
    assert sorted(hashes) == [0, 1] and hashes[0] == hashes[1] == ddp_utils.state_hash(model)


@pytest.mark.job
@pytest.mark.lab
def test_digits_demo_two_hosts_reaches_95_percent(tmp_path: Path) -> None:
    run, workdir = simulate(tmp_path, DIGITS, ["--timeout", "2"], {})
    finish_simulation(run, workdir)
    history = json.loads((workdir / "algo-1" / "output" / "data" / "metrics.json").read_text())
    check_history(history, 30)
    assert history[-1]["val_accuracy"] >= 0.95 and history[-1]["val_count"] == 360
    assert sum(r["train_seconds"] for r in history) < 120
    assert metric_values(run.stdout)["val_accuracy"][-1] == round(history[-1]["val_accuracy"], 4)
    png = workdir / "algo-1" / "output" / "data" / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = train_digits.Net()
    model.load_state_dict(torch.load(workdir / "algo-1" / "model" / "model.pt", weights_only=True))
    x_train, y_train, x_test, y_test = train_digits.load_split()
    with torch.no_grad():
        model.eval()
        correct = int((model(x_test).argmax(1) == y_test).sum())
    assert (correct, correct / 360) == (history[-1]["val_correct"], history[-1]["val_accuracy"])
    hashes = run.hashes()
    assert sorted(hashes) == [0, 1] and hashes[0] == hashes[1] == ddp_utils.state_hash(model)


@pytest.mark.job
def test_digits_as_a_plain_process_with_sagemaker_variables(tmp_path: Path) -> None:
    """No torchrun (world size 1), SM_* paths, checkpointconfig.json's LocalPath, ``--plot False``."""
    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "checkpointconfig.json").write_text(json.dumps({"LocalPath": str(tmp_path / "ck")}))
    env = {"SAGEMAKER_BASE_DIR": str(base), "SM_MODEL_DIR": str(base / "model"),
           "SM_OUTPUT_DATA_DIR": str(base / "output" / "data")}
    run = Run([PYTHON, DIGITS, "--epochs", "2", "--plot", "False"], tmp_path, env)
    assert run.finish() == 0, run.stdout + run.stderr
    assert "world size 1" in run.stdout
    assert (base / "model" / "model.pt").is_file()
    check_history(json.loads((base / "output" / "data" / "metrics.json").read_text()), 2)
    assert not (base / "output" / "data" / "training_curves.png").exists()  # False was false
    assert [os.path.basename(p) for p in ddp_utils.list_checkpoints(str(tmp_path / "ck"))] == [
        "checkpoint-e0001-s0000000.pt", "checkpoint-e0002-s0000000.pt"]


@pytest.mark.job
def test_digits_under_plain_torchrun_writes_where_the_ddp_variables_say(tmp_path: Path) -> None:
    """Kubeflow, SLURM, a hand-made cluster: torchrun, no SM_* variable, the DDP_* ones say where files go."""
    assert not [k for k in os.environ if k.startswith(("AIP_", "OCI__", "DDP_MODEL", "DDP_OUTPUT", "DDP_CHECK"))]
    model_dir, out_dir, ck_dir = tmp_path / "m", tmp_path / "o", tmp_path / "c"
    run = Run([PYTHON, "-m", "torch.distributed.run", "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--local-addr", "127.0.0.1",
               DIGITS, "--epochs", "2", "--timeout", "2"], tmp_path,
              {"DDP_MODEL_DIR": str(model_dir), "DDP_OUTPUT_DIR": str(out_dir), "DDP_CHECKPOINT_DIR": str(ck_dir)})
    try:
        run.proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(run.proc.pid, signal.SIGKILL)  # torchrun's own session: it and its workers
    assert run.finish() == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not [k for k in launcher_env() if k.startswith("SM_")]  # Run's environment had none
    assert "world size 2" in run.stdout
    assert (f"model dir {model_dir} (DDP_MODEL_DIR), output data dir {out_dir} (DDP_OUTPUT_DIR), "
            f"checkpoint dir {ck_dir} (DDP_CHECKPOINT_DIR)") in run.stdout
    model = train_digits.Net()
    model.load_state_dict(torch.load(model_dir / "model.pt", weights_only=True))
    assert sorted(os.listdir(model_dir)) == ["model.pt"]
    check_history(json.loads((out_dir / "metrics.json").read_text()), 2)
    assert (out_dir / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [os.path.basename(p) for p in ddp_utils.list_checkpoints(str(ck_dir))] == [
        "checkpoint-e0001-s0000000.pt", "checkpoint-e0002-s0000000.pt"]
    assert not (tmp_path / "outputs").exists()  # nothing went to the local default
    hashes = run.hashes()
    assert sorted(hashes) == [0, 1] and hashes[0] == hashes[1] == ddp_utils.state_hash(model)


@pytest.mark.job
def test_a_script_given_a_bad_location_exits_2_before_starting(tmp_path: Path) -> None:
    """The in-process tests above cover every bad value; this one shows what a real script run does."""
    run = Run([PYTHON, DIGITS], tmp_path, {"DDP_MODEL_DIR": "s3://bucket/model"})
    assert run.finish(timeout=120) == 2
    assert run.stderr.startswith("error: DDP_MODEL_DIR='s3://bucket/model': "), run.stderr
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert not run.pid_dir.exists()  # start() never ran


@pytest.mark.job
def test_sigterm_checkpoints_and_the_next_run_resumes(tmp_path: Path) -> None:
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    args = ["--synthetic", "960", "--epochs", "3", "--batch-size", "16", "--output-dir", str(out),
            "--checkpoint-dir", str(checkpoints), "--timeout", "2", "--print-freq", "5"]
    first = launch(tmp_path / "first", CIFAR, args)
    first.wait_for("METRIC epoch=1 ")
    first.wait_for("epoch 2 step 5/30 ")  # 30 steps of 16 images per process and epoch
    first.proc.send_signal(signal.SIGTERM)  # the launcher forwards it to the workers
    stopped_at = time.monotonic()
    assert first.finish() == 0, first.stdout + first.stderr
    assert time.monotonic() - stopped_at < 60
    assert "received SIGTERM: finishing this step" in first.stderr
    assert "stopped by a signal" in first.stdout and "METRIC epoch=2" not in first.stdout
    path, state = ddp_utils.load_latest_checkpoint(str(checkpoints))
    assert state["epoch"] == 1 and 5 <= state["step"] < 30, path  # in the middle of the 2nd epoch
    assert not (out / "cifar_net.pt").exists()

    second = launch(tmp_path / "second", CIFAR, args)
    assert second.finish() == 0, second.stdout + second.stderr
    assert f"epoch 2 of 3, step {state['step']}" in second.stdout
    assert metric_values(second.stdout)["epoch"] == [2.0, 3.0]
    check_history(json.loads((out / "metrics.json").read_text()), 3)
    assert (out / "cifar_net.pt").is_file()


@pytest.mark.job
def test_a_job_restarted_in_place_ends_with_the_uninterrupted_model(tmp_path: Path) -> None:
    """``--max-restarts 1``: rank 1 is SIGKILLed (as the OOM killer would) in generation 0 as the 3rd epoch's
    checkpoint begins (tests/scripts/digits_killed_once.py: train_digits with that one fault); the new generation
    resumes from the 2nd epoch's checkpoint, and the weights it ends with are an uninterrupted run's of the same
    seed, bit for bit. The two runs go side by side."""
    args = ["--epochs", "6", "--timeout", "2", "--plot", "False", "--print-freq", "0"]
    runs = {}
    for name, launcher_args, script in (("whole", [], DIGITS), ("restarted", ["--max-restarts", "1"], KILLED_ONCE)):
        (tmp_path / name).mkdir()
        runs[name] = Run([PYTHON, "-m", "launcher", "--nproc-per-node", "2", *launcher_args, script, *args,
                          "--output-dir", str(tmp_path / name / "out"), "--checkpoint-dir",
                          str(tmp_path / name / "ck")], tmp_path / name)
    for run in runs.values():
        assert run.finish() == 0, run.stdout[-3000:] + run.stderr[-3000:]
    restarted = runs["restarted"]
    assert sorted(p.name for p in restarted.pid_dir.glob("g*.pid")) == ["g0.r0.pid", "g0.r1.pid", "g1.r0.pid",
                                                                         "g1.r1.pid"]  # all gone: finish()
    [restart] = [line for line in restarted.stderr.splitlines() if "restart 1 of 1 (job-wide)" in line]
    assert "rank 1" in restart and "SIGKILL" in restart, restart
    assert re.findall(r"resuming from \S*checkpoint-e(\d+)-s0000000\.pt: epoch (\d+) of 6, step 0",
                      restarted.stdout) == [("0002", "3")]
    assert "resuming from" not in runs["whole"].stdout
    whole, again = runs["whole"].hashes(), restarted.hashes()
    assert sorted(whole) == sorted(again) == [0, 1] and whole[0] == whole[1] == again[0] == again[1]
    learned = {name: [{k: r[k] for k in ("epoch", "train_loss", "val_loss", "val_accuracy")}
                      for r in json.loads((tmp_path / name / "out" / "metrics.json").read_text())] for name in runs}
    assert len(learned["whole"]) == 6 and learned["restarted"] == learned["whole"]  # every epoch's, the redone too


@pytest.mark.job
def test_a_failed_download_on_rank_0_stops_every_rank(tmp_path: Path) -> None:
    """The ranks waiting for rank 0's download learn that it failed instead of hanging.

    The data dir is a file, so torchvision's download fails at ``os.makedirs``, before any network use.
    """
    not_a_dir = tmp_path / "data"
    not_a_dir.write_text("not a directory")
    run = launch(tmp_path / "job", CIFAR, ["--data-dir", str(not_a_dir), "--timeout", "2",
                                           "--checkpoint-dir", str(tmp_path / "ck")])
    code = run.finish(timeout=120)
    assert code == 1, run.stdout + run.stderr
    # Every rank fails with rank 0's reason: the root cause in the launcher's report says what went wrong.
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]:.*FileNotFoundError: .* could not be downloaded there "
                         r"\(rank 0: FileExistsError: ", run.stderr), run.stderr[-3000:]
    assert time.monotonic() - run.started < 100  # not a collective timeout
