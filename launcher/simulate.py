"""``ddp-launcher simulate``: run N SageMaker hosts as N launcher processes on this machine.

Usage::

    ddp-launcher simulate --hosts N [--nproc-per-node P] [--instance-type ml.m5.xlarge]
        [--channel NAME=DIR ...] [--workdir DIR] [--job-name NAME] [--hyperparameters JSON]
        [--toolkit] [--fault HOST:SIGNAL:AFTER ...] [--grace-period S]
        [-- script.py --key value ...]

``-- script.py --epochs 3 --name "a b" --flag`` stands for the estimator's hyperparameters
``{"train-script": "script.py", "epochs": 3, "name": "a b", "flag": true}``: each value is decoded as
JSON where it parses, a key without a value is ``true``. ``--hyperparameters JSON`` gives them
directly; both may be combined (the ``--`` form wins for a key given twice).

Each host ``algo-i`` gets what a SageMaker host gets, written in AWS's formats:

- ``DIR/algo-i/`` is its ``/opt/ml`` (``SAGEMAKER_BASE_DIR``): ``input/config/`` with
  ``resourceconfig.json``, ``hyperparameters.json`` (JSON-encoded values and the ``sagemaker_*``
  entries, as SDK v2 writes them), ``inputdataconfig.json`` and ``checkpointconfig.json``;
  ``input/data/<channel>``; ``code/``; ``model/``; ``output/data/``; ``checkpoints/``.
- The source bundle (:func:`launcher.bundle.stage_bundle`) is packed once into
  ``DIR/sourcedir.tar.gz``, the file the SDK uploads; ``sagemaker_submit_directory`` names it. Without
  ``--toolkit`` simulate extracts it into each ``code/``; with ``--toolkit`` AWS's toolkit does
  (``files.download_and_extract``), as on SageMaker.
- The environment AWS's toolkit gives the entry point (every ``SM_*`` of
  ``sagemaker_training.environment.Environment.to_env_vars()``, plus ``CURRENT_HOST``,
  ``SAGEMAKER_JOB_NAME``, ``SAGEMAKER_REGION``), ``TRAINING_JOB_NAME``, and what an estimator's
  ``environment=`` would carry for a local run: ``LAUNCHER_RESOLVE`` (every host -> 127.0.0.1),
  ``LAUNCHER_MASTER_PORT`` (a free port), ``LAUNCHER_GRACE_PERIOD``, ``LAUNCHER_NPROC_PER_NODE``.
- It starts as SageMaker starts it: in ``code/``, ``python launch.py <the argv AWS's toolkit renders
  from hyperparameters.json>``; with ``--toolkit``, through AWS's real ``train`` command.

Choices, and why:

- Default work directory ``./runs/<job-name>``: kept after the run, so the model, the failure files
  and ``summary.json`` can be read afterwards (``/runs/`` is git-ignored).
- Channels are symlinks to the user's directories: a copy per host would cost N times the disk and
  the time for a real data set. A script that writes into its channel writes the user's files.
- ``network_interface_name`` is ``lo``: every simulated host is 127.0.0.1, which is on ``lo``.
- ``instance_groups`` lists the current host first: SageMaker does not sort that list.
- When a host ends with a failure, is lost or was stopped on purpose, simulate sends SIGTERM to the
  other launchers, as SageMaker stops the remaining instances of a failed job. Their workers would
  otherwise wait in a collective until gloo gives up (about 20 s, NCCL 10 min). Each launcher gets
  ``--grace-period`` (default 5 s) to stop its workers; a launcher still running 5 s after that is
  killed with its process tree.
- Exit code: that of the first host to end with a non-zero code, in time (the root cause; the others
  mostly end because of it), 0 if every host succeeded.
- Stop signals (SIGINT, SIGTERM, SIGHUP) are forwarded to every launcher; a second one kills every
  host at once. With ``--toolkit`` they go to the launcher the toolkit started: the toolkit forwards
  none (on SageMaker the signal reaches the container's first process only).

Faults: ``--fault algo-2:SIGKILL:5`` kills that host's launcher 5 s after the start (a lost
instance: its watchdog kills the workers); ``SIGTERM`` is a spot interruption. ``AFTER`` may be
``step=N``: the fault fires when a line of that host's output contains ``step=N`` (or ``step N``).

Standard library only; never imports torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Optional

from launcher import bundle, hyperparameters, proctree
from launcher.errors import ConfigError

PROG = "ddp-launcher simulate"
MAX_HOSTS = 64
DEFAULT_INSTANCE_TYPE = "ml.m5.xlarge"
DEFAULT_GRACE_PERIOD = 5.0
BACKSTOP_SECONDS = 5.0  # after the grace period: simulate kills a launcher that is still running
TICK = 0.05
GROUP = "homogeneousCluster"
INTERFACE = "lo"
ADDRESS = "127.0.0.1"
REGION = "us-east-1"
LOG_LEVEL = 20  # logging.INFO, the SDK's default container_log_level
SCRIPT_KEYS = ("train-script", "train_script")
MAX_HYPERPARAMETERS, MAX_KEY_CHARS, MAX_VALUE_CHARS = 100, 256, 2500  # CreateTrainingJob's limits
CHANNEL_NAME = re.compile(r"^[A-Za-z0-9.\-_]{1,64}$")
JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
# What the caller's environment must not pass to a host: another platform's or run's variables.
FOREIGN_PREFIXES = ("SM_", "SAGEMAKER_", "TORCHELASTIC_", "PET_")
FOREIGN_NAMES = frozenset({"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                           "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "TRAINING_JOB_NAME",
                           "CURRENT_HOST", "LAUNCHER_TRAIN_SCRIPT", "LAUNCHER_DRY_RUN"})
# sagemaker_training.params.SAGEMAKER_HYPERPARAMETERS and the flags that make a group distributed.
TOOLKIT_KEYS = frozenset({"sagemaker_program", "sagemaker_submit_directory", "sagemaker_region",
                          "sagemaker_enable_cloudwatch_metrics", "sagemaker_container_log_level",
                          "sagemaker_job_name", "default_user_module_name", "_tuning_objective_metric",
                          "sagemaker_s3_output"})
DISTRIBUTION_FLAGS = ("sagemaker_mpi_enabled", "sagemaker_parameter_server_enabled",
                      "sagemaker_distributed_dataparallel_enabled", "sagemaker_pytorch_ddp_enabled",
                      "sagemaker_pytorch_xla_multi_worker_enabled",
                      "sagemaker_multi_worker_mirrored_strategy_enabled",
                      "sagemaker_torch_distributed_enabled")


def log(message: str) -> None:
    """One line of simulate's own, on stderr."""
    sys.stderr.write(f"[simulate] {message}\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """A signal sent on purpose to one host's launcher, after some time or at a training step."""

    host: str
    signum: int
    after: Optional[float] = None
    step: Optional[int] = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def meaning(self) -> str:
        """What the fault stands for on SageMaker."""
        return {signal.SIGKILL: "lost instance", signal.SIGTERM: "spot interruption"}.get(
            self.signum, "signal")

    def when(self) -> str:
        return f"step={self.step}" if self.step is not None else f"{self.after:g} s"


@dataclass(frozen=True)
class Config:
    """Everything simulate decided from its command line, before anything is written or started."""

    hosts: tuple[str, ...]
    nproc_per_node: Optional[int]
    instance_type: str
    channels: Mapping[str, str]  # name -> absolute directory
    workdir: str
    job_name: str
    user_hyperparameters: Mapping[str, Any]  # decoded, with train-script = the script's file name
    script: str  # absolute path
    toolkit: Optional[tuple[str, ...]]  # AWS's `train` command, when --toolkit
    faults: tuple[Fault, ...]
    grace_period: float


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is a one-line :class:`ConfigError` (exit 2, nothing started)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """simulate's options (the script and its hyperparameters come after ``--``)."""
    p = _Parser(prog=PROG, allow_abbrev=False,
                description="Run N SageMaker hosts as N launcher processes on this machine.",
                epilog="then: -- script.py --key value ...  (the estimator's hyperparameters)")
    p.add_argument("--hosts", type=int, required=True, help=f"number of hosts, 1-{MAX_HOSTS}")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per host (LAUNCHER_NPROC_PER_NODE; default: the launcher's, 1 on CPU)")
    p.add_argument("--instance-type", default=DEFAULT_INSTANCE_TYPE)
    p.add_argument("--channel", action="append", default=[], metavar="NAME=DIR",
                   help="an input channel: input/data/NAME links to DIR")
    p.add_argument("--workdir", default=None, help="where the hosts' trees go (default ./runs/JOB)")
    p.add_argument("--job-name", default=None, help="TRAINING_JOB_NAME (default simulate-<time>)")
    p.add_argument("--hyperparameters", default=None, metavar="JSON",
                   help="the estimator's hyperparameters as a JSON object")
    p.add_argument("--toolkit", action="store_true",
                   help="start each host through AWS's sagemaker-training `train` command")
    p.add_argument("--fault", action="append", default=[], metavar="HOST:SIGNAL:AFTER",
                   help="e.g. algo-2:SIGKILL:5 (lost instance), algo-2:SIGTERM:step=3 (spot)")
    p.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_PERIOD,
                   help="seconds a launcher may take to stop its workers (LAUNCHER_GRACE_PERIOD)")
    return p


def split_at_dashes(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """simulate's own options, and the words after the first ``--``."""
    words = list(argv)
    if "--" in words:
        i = words.index("--")
        return words[:i], words[i + 1:]
    return words, []


def decode_value(text: str) -> Any:
    """A command-line value as the user meant it: JSON where it parses, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _is_key(word: str) -> bool:
    return (word.startswith("--") and len(word) > 2) or re.match(r"^-[A-Za-z_]", word) is not None


def script_hyperparameters(words: Sequence[str]) -> tuple[Optional[str], dict[str, Any]]:
    """``script.py --epochs 3 --flag`` -> ``("script.py", {"epochs": 3, "flag": True})``."""
    if not words:
        return None, {}
    script, rest = words[0], list(words[1:])
    if script.startswith("-"):
        raise ConfigError(f"expected the training script right after '--', found {script!r}")
    found: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        word = rest[i]
        if not _is_key(word):
            raise ConfigError(f"hyperparameter value {word!r} has no --key before it "
                              "(hyperparameters are --key value pairs)")
        key, sep, inline = word.lstrip("-").partition("=")
        if sep:
            found[key] = decode_value(inline)
        elif i + 1 < len(rest) and not _is_key(rest[i + 1]):
            found[key] = decode_value(rest[i + 1])
            i += 1
        else:
            found[key] = True
        i += 1
    return script, found


def parse_hyperparameters_json(text: Optional[str]) -> dict[str, Any]:
    """``--hyperparameters``: a JSON object, or a one-line error naming the bad text."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--hyperparameters is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--hyperparameters must be a JSON object, found {text!r}")
    return value


def parse_channel(text: str, cwd: str) -> tuple[str, str]:
    """``train=data/train`` -> ``("train", "/abs/data/train")``; the directory must exist."""
    name, sep, path = text.partition("=")
    if not sep or not CHANNEL_NAME.match(name):
        raise ConfigError(f"--channel must be NAME=DIR with NAME of letters, digits, '.', '-', '_' "
                          f"(at most 64): {text!r}")
    full = os.path.abspath(os.path.join(cwd, path))
    if not os.path.isdir(full):
        raise ConfigError(f"--channel {name}: directory not found: {path!r}")
    return name, full


def parse_signal(text: str) -> int:
    """``SIGKILL``, ``KILL``, ``kill`` or ``9`` -> 9."""
    word = text.strip().upper()
    if word.isdigit():
        number = int(word)
        if number in {s.value for s in signal.Signals}:
            return number
        raise ValueError(text)
    name = word if word.startswith("SIG") else "SIG" + word
    return int(signal.Signals[name])


def parse_fault(text: str, hosts: Sequence[str]) -> Fault:
    """``algo-2:SIGKILL:5`` or ``algo-2:SIGTERM:step=3``."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ConfigError(f"--fault must be HOST:SIGNAL:AFTER, e.g. algo-2:SIGKILL:5: {text!r}")
    host, sig, after = parts
    if host not in hosts:
        raise ConfigError(f"--fault {text!r}: no host {host!r} (the hosts are algo-1..algo-{len(hosts)})")
    try:
        signum = parse_signal(sig)
    except (KeyError, ValueError):
        raise ConfigError(f"--fault {text!r}: unknown signal {sig!r}") from None
    try:
        if after.startswith("step="):
            step = int(after[len("step="):])
            if step < 0:
                raise ValueError
            return Fault(host, signum, step=step)
        seconds = float(after)
        if not seconds >= 0:
            raise ValueError
        return Fault(host, signum, after=seconds)
    except ValueError:
        raise ConfigError(f"--fault {text!r}: AFTER must be seconds >= 0 or step=N: {after!r}") from None


def toolkit_command() -> Optional[tuple[str, ...]]:
    """AWS's ``train`` command (sagemaker_training.cli.train) for this Python, if installed."""
    if importlib.util.find_spec("sagemaker_training") is None:
        return None
    beside = os.path.join(os.path.dirname(sys.executable), "train")
    if os.access(beside, os.X_OK):
        return (beside,)
    return (sys.executable, "-m", "sagemaker_training.cli.train")


def default_job_name() -> str:
    """``simulate-2024-05-01-12-00-00-123``, as the SDK names jobs from a base name."""
    now = time.time()
    return f"simulate-{time.strftime('%Y-%m-%d-%H-%M-%S', time.localtime(now))}-{int(now * 1000) % 1000:03d}"


def _find_script(script_word: Optional[str], hps: dict[str, Any], cwd: str) -> str:
    """The training script's absolute path, from ``-- script.py`` or the ``train-script`` value."""
    named = [hps.pop(k) for k in SCRIPT_KEYS if k in hps]
    given = script_word if script_word is not None else (named[0] if named else None)
    if given is None:
        raise ConfigError("no training script: give it after '--' (-- script.py --key value ...) or "
                          "as the 'train-script' hyperparameter")
    if not isinstance(given, str) or not given:
        raise ConfigError(f"the 'train-script' hyperparameter must be a path, found {given!r}")
    path = os.path.abspath(os.path.join(cwd, given))
    if not os.path.isfile(path):
        raise ConfigError(f"training script not found: {given!r}")
    if os.path.basename(path) in (bundle.ENTRY_POINT, bundle.HELPER_MODULE):
        raise ConfigError(f"the training script cannot be named {os.path.basename(path)!r}: the "
                          "source bundle uses that name")
    return path


def _check_counts(args: argparse.Namespace) -> None:
    if not 1 <= args.hosts <= MAX_HOSTS:
        raise ConfigError(f"--hosts must be 1-{MAX_HOSTS}: {args.hosts}")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1: {args.nproc_per_node}")
    if not args.grace_period > 0:
        raise ConfigError(f"--grace-period must be > 0 seconds: {args.grace_period:g}")
    if not args.instance_type.startswith("ml."):
        raise ConfigError(f"--instance-type must be a SageMaker type like ml.m5.xlarge: "
                          f"{args.instance_type!r}")


def _check_limits(hps: Mapping[str, Any], sagemaker_entries: int) -> None:
    """CreateTrainingJob refuses more than 100 entries, keys over 256 or values over 2500 chars."""
    if len(hps) + sagemaker_entries > MAX_HYPERPARAMETERS:
        raise ConfigError(f"{len(hps)} hyperparameters and the SDK's {sagemaker_entries} exceed "
                          f"SageMaker's limit of {MAX_HYPERPARAMETERS}")
    for key, value in hps.items():
        if not key or len(key) > MAX_KEY_CHARS:
            raise ConfigError(f"hyperparameter name must be 1-{MAX_KEY_CHARS} characters: {key!r}")
        if len(json.dumps(value)) > MAX_VALUE_CHARS:
            raise ConfigError(f"hyperparameter {key!r}: value longer than {MAX_VALUE_CHARS} "
                              "characters once JSON-encoded")


def _workdir(args: argparse.Namespace, job_name: str, cwd: str) -> str:
    path = os.path.abspath(os.path.join(cwd, args.workdir or os.path.join("runs", job_name)))
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConfigError(f"work directory exists and is not empty: {path!r} "
                          "(give another --workdir or --job-name)")
    return path


def build_config(argv: Sequence[str], cwd: str) -> Config:
    """Parse and check everything; raises :class:`ConfigError`. Writes and starts nothing."""
    own, script_words = split_at_dashes(argv)
    args = build_parser().parse_args(own)
    _check_counts(args)
    hosts = tuple(f"algo-{i}" for i in range(1, args.hosts + 1))
    hps = parse_hyperparameters_json(args.hyperparameters)
    script_word, from_words = script_hyperparameters(script_words)
    if script_word is not None:
        for key in SCRIPT_KEYS:
            hps.pop(key, None)
    hps.update(from_words)
    script = _find_script(script_word, hps, cwd)
    hps = {"train-script": os.path.basename(script), **hps}
    _check_limits(hps, len(sdk_entries("", "", "")))
    channels = dict(parse_channel(text, cwd) for text in args.channel)
    job_name = args.job_name or default_job_name()
    if not JOB_NAME.match(job_name):
        raise ConfigError(f"--job-name must be 1-63 letters, digits and hyphens: {job_name!r}")
    faults = tuple(parse_fault(text, hosts) for text in args.fault)
    command = toolkit_command() if args.toolkit else None
    if args.toolkit and command is None:
        raise ConfigError(f"--toolkit needs AWS's sagemaker-training package in {sys.executable}: "
                          "pip install sagemaker-training")
    return Config(hosts, args.nproc_per_node, args.instance_type, channels,
                  _workdir(args, job_name, cwd), job_name, hps, script, command, faults,
                  args.grace_period)


# ----------------------------------------------------------------------------------------------
# SageMaker's files, in AWS's formats
# ----------------------------------------------------------------------------------------------

def sdk_entries(job_name: str, submit_dir: str, program: str) -> dict[str, Any]:
    """What SDK v2's ``_script_mode_hyperparam_update`` adds to the user's hyperparameters."""
    return {"sagemaker_submit_directory": submit_dir, "sagemaker_program": program,
            "sagemaker_container_log_level": LOG_LEVEL, "sagemaker_job_name": job_name,
            "sagemaker_region": REGION}


def encode_hyperparameters(decoded: Mapping[str, Any]) -> dict[str, str]:
    """``hyperparameters.json`` as SDK v2 writes it: every value JSON-encoded."""
    return {str(key): json.dumps(value) for key, value in decoded.items()}


def resource_config(hosts: Sequence[str], current: str, instance_type: str) -> dict[str, Any]:
    """``resourceconfig.json``: ``hosts`` sorted; the group's list unsorted (current host first)."""
    group_hosts = [current] + [h for h in hosts if h != current]
    return {"current_host": current, "current_instance_type": instance_type,
            "current_group_name": GROUP, "hosts": sorted(hosts),
            "instance_groups": [{"instance_group_name": GROUP, "instance_type": instance_type,
                                 "hosts": group_hosts}],
            "network_interface_name": INTERFACE}


def input_data_config(channels: Mapping[str, str]) -> dict[str, Any]:
    """``inputdataconfig.json``: one File-mode, fully replicated entry per channel."""
    return {name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                   "RecordWrapperType": "None"} for name in channels}


def checkpoint_config(base: str, job_name: str) -> dict[str, str]:
    """``checkpointconfig.json``; nothing is synced: the URI only shows the format."""
    return {"LocalPath": os.path.join(base, "checkpoints"),
            "S3Uri": f"s3://simulated-bucket/{job_name}/checkpoints"}


# ----------------------------------------------------------------------------------------------
# The environment AWS's toolkit gives the entry point (sagemaker_training.environment)
# ----------------------------------------------------------------------------------------------

def _env_value(value: Any) -> str:
    """``mapping.to_env_vars``'s value format: text as is, None empty, the rest compact JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _distribution_hosts(resource: Mapping[str, Any], framework: Mapping[str, Any]) -> tuple[list, list]:
    """The toolkit's distribution instance groups and their hosts (empty unless a flag says so)."""
    group = resource.get("current_group_name", GROUP)
    groups = framework.get("sagemaker_distribution_instance_groups",
                           [group] if any(framework.get(f, False) for f in DISTRIBUTION_FLAGS) else [])
    configured = resource.get("instance_groups", [])
    hosts = [h for g in configured if g["instance_group_name"] in groups for h in g["hosts"]]
    return groups, (hosts if configured else list(resource["hosts"]))


def training_env(base: str, resource: Mapping[str, Any], data_config: Mapping[str, Any],
                 raw_hps: Mapping[str, str], job_name: str) -> dict[str, Any]:
    """``dict(Environment())``: every property of AWS's toolkit environment for this host."""
    decoded = hyperparameters.decode(raw_hps)
    sagemaker = {k: v for k, v in decoded.items() if k in TOOLKIT_KEYS or k.startswith("sagemaker_")}
    framework = {k: v for k, v in sagemaker.items() if k not in TOOLKIT_KEYS}
    groups = resource.get("instance_groups", [])
    current_group = resource.get("current_group_name", GROUP)
    dist_groups, dist_hosts = _distribution_hosts(resource, framework)
    master = dist_hosts[0] if dist_hosts else list(resource["hosts"])[0]
    program = sagemaker.get("sagemaker_program")
    module = str(program)
    return {
        "additional_framework_parameters": framework,
        "channel_input_dirs": {c: os.path.join(base, "input", "data", c) for c in data_config},
        "current_host": resource["current_host"],
        "current_instance_group": current_group,
        "current_instance_group_hosts": next((g["hosts"] for g in groups
                                              if g["instance_group_name"] == current_group), []),
        "current_instance_type": resource.get("current_instance_type", "local"),
        "distribution_hosts": dist_hosts, "distribution_instance_groups": dist_groups,
        "framework_module": None, "hosts": resource["hosts"],
        "hyperparameters": {k: v for k, v in decoded.items() if k not in sagemaker},
        "input_config_dir": os.path.join(base, "input", "config"),
        "input_data_config": dict(data_config), "input_dir": os.path.join(base, "input"),
        "instance_groups": [g["instance_group_name"] for g in groups],
        "instance_groups_dict": {g["instance_group_name"]: g for g in groups},
        "is_hetero": len(groups) > 1, "is_master": resource["current_host"] == master,
        "is_modelparallel_enabled": None,
        "is_smddpmprun_installed": shutil.which("smddpmprun") is not None,
        "is_smddprun_installed": shutil.which("smddprun") is not None,
        "job_name": job_name, "log_level": sagemaker.get("sagemaker_container_log_level", LOG_LEVEL),
        "master_hostname": master, "model_dir": os.path.join(base, "model"),
        "module_dir": str(sagemaker.get("sagemaker_submit_directory", os.path.join(base, "code"))),
        "module_name": module[:-3] if module.endswith(".py") else module,
        "network_interface_name": resource.get("network_interface_name", "eth0"),
        "num_cpus": os.cpu_count() or 1, "num_gpus": 0, "num_neurons": 0,
        "output_data_dir": os.path.join(base, "output", "data"),
        "output_dir": os.path.join(base, "output"),
        "output_intermediate_dir": os.path.join(base, "output", "intermediate"),
        "resource_config": dict(resource), "topology": resource.get("topology", []),
        "user_entry_point": program,
    }


def toolkit_env(base: str, resource: Mapping[str, Any], data_config: Mapping[str, Any],
                raw_hps: Mapping[str, str], job_name: str) -> dict[str, str]:
    """``Environment().to_env_vars()`` for this host: the ``SM_*`` variables, in AWS's format.

    CPU simulation: ``SM_NUM_GPUS`` and ``SM_NUM_NEURONS`` are 0 even on a machine with devices
    (the simulated hosts would share them).
    """
    env = training_env(base, resource, data_config, raw_hps, job_name)
    fields = {
        "hosts": env["hosts"], "network_interface_name": env["network_interface_name"],
        "hps": env["hyperparameters"], "user_entry_point": env["user_entry_point"],
        "framework_params": env["additional_framework_parameters"],
        "channels": sorted(env["channel_input_dirs"]), "training_env": env,
        "user_args": hyperparameters.render_args(env["hyperparameters"]),
        **{k: env[k] for k in ("resource_config", "input_data_config", "output_data_dir",
                               "current_host", "current_instance_type", "current_instance_group",
                               "current_instance_group_hosts", "instance_groups",
                               "instance_groups_dict", "distribution_instance_groups", "is_hetero",
                               "module_name", "log_level", "framework_module", "input_dir",
                               "input_config_dir", "output_dir", "num_cpus", "num_gpus",
                               "num_neurons", "model_dir", "module_dir", "output_intermediate_dir")},
    }
    if env["topology"]:
        fields["topology"] = env["topology"]
    fields.update({f"channel_{name}": path for name, path in env["channel_input_dirs"].items()})
    fields.update({f"hp_{key}": value for key, value in env["hyperparameters"].items()})
    return {f"SM_{key.upper()}": _env_value(value) for key, value in fields.items()}


# ----------------------------------------------------------------------------------------------
# The hosts' trees
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostSpec:
    """One simulated host: its name, its /opt/ml, and exactly how it is started."""

    name: str
    base_dir: str
    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str]


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


def pack_source(config: Config) -> str:
    """Stage the bundle and pack it as ``DIR/sourcedir.tar.gz``, as SDK v2 uploads it."""
    target = os.path.join(config.workdir, "sourcedir.tar.gz")
    with tempfile.TemporaryDirectory(prefix="simulate-bundle-") as tmp:
        source = bundle.stage_bundle(config.script, os.path.join(tmp, "source"))
        with tarfile.open(target, "w:gz", dereference=True) as tar:
            for name in sorted(os.listdir(source)):
                tar.add(os.path.join(source, name), arcname=name)
    return target


def caller_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment without another job's or platform's variables."""
    return {k: v for k, v in environ.items()
            if not k.startswith(FOREIGN_PREFIXES) and k not in FOREIGN_NAMES}


def estimator_environment(config: Config, port: int) -> dict[str, str]:
    """What a user would pass as the estimator's ``environment=`` for a local run of N hosts."""
    env = {"LAUNCHER_RESOLVE": ",".join(f"{h}={ADDRESS}" for h in config.hosts),
           "LAUNCHER_MASTER_PORT": str(port),
           "LAUNCHER_GRACE_PERIOD": f"{config.grace_period:g}",
           "PYTHONUNBUFFERED": "1"}  # AWS's framework containers set it too
    if config.nproc_per_node is not None:
        env["LAUNCHER_NPROC_PER_NODE"] = str(config.nproc_per_node)
    return env


def host_environment(config: Config, base: str, files: Mapping[str, Any], submit: str,
                     common: Mapping[str, str]) -> dict[str, str]:
    """The full environment of one host's first process."""
    env = dict(common)
    env.update({"SAGEMAKER_BASE_DIR": base, "TRAINING_JOB_NAME": config.job_name})
    if config.toolkit:  # the toolkit computes SM_* itself from the tree
        env.update({"SAGEMAKER_PROGRAM": bundle.ENTRY_POINT, "SAGEMAKER_SUBMIT_DIRECTORY": submit,
                    "SM_STUDIO_LOCAL_MODE": "true"})  # skip its DNS wait for algo-* names
        return env
    env.update(toolkit_env(base, files["resource"], files["data"], files["hps"], config.job_name))
    env.update({"CURRENT_HOST": files["resource"]["current_host"],
                "SAGEMAKER_JOB_NAME": config.job_name, "SAGEMAKER_REGION": REGION})
    code = os.path.join(base, "code")
    env["PYTHONPATH"] = code + (os.pathsep + common["PYTHONPATH"] if common.get("PYTHONPATH") else "")
    return env


def _host_tree(config: Config, host: str, submit: str) -> tuple[str, dict[str, Any]]:
    """Write one host's /opt/ml; returns its path and the content of its config files."""
    base = os.path.join(config.workdir, host)
    for sub in ("input/config", "input/data", "code", "model", "output/data", "checkpoints"):
        os.makedirs(os.path.join(base, sub))
    raw = encode_hyperparameters({**config.user_hyperparameters,
                                  **sdk_entries(config.job_name, submit, bundle.ENTRY_POINT)})
    files = {"resource": resource_config(config.hosts, host, config.instance_type),
             "data": input_data_config(config.channels), "hps": raw}
    conf = os.path.join(base, "input", "config")
    _write_json(os.path.join(conf, "resourceconfig.json"), files["resource"])
    _write_json(os.path.join(conf, "hyperparameters.json"), raw)
    _write_json(os.path.join(conf, "inputdataconfig.json"), files["data"])
    _write_json(os.path.join(conf, "checkpointconfig.json"), checkpoint_config(base, config.job_name))
    for name, path in config.channels.items():
        os.symlink(path, os.path.join(base, "input", "data", name))
    if not config.toolkit:  # what the toolkit's files.download_and_extract would do
        with tarfile.open(submit, "r:gz") as tar:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(os.path.join(base, "code"), **safe)
    return base, files


def host_argv(config: Config, raw_hps: Mapping[str, str]) -> tuple[str, ...]:
    """The host's command: ``python launch.py <AWS's argv>``, or the toolkit's ``train``."""
    if config.toolkit:
        return tuple(config.toolkit)
    rendered = hyperparameters.render_args(hyperparameters.user_hyperparameters(
        hyperparameters.decode(raw_hps)))
    return (sys.executable, bundle.ENTRY_POINT, *rendered)


def make_tree(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write the work directory; on any error remove what was made and raise :class:`ConfigError`."""
    created = _first_missing(config.workdir)
    try:
        os.makedirs(config.workdir, exist_ok=True)
        submit = pack_source(config)
        common = {**caller_environment(environ), **estimator_environment(config, port)}
        specs = []
        for host in config.hosts:
            base, files = _host_tree(config, host, submit)
            specs.append(HostSpec(host, base, host_argv(config, files["hps"]),
                                  os.path.join(base, "code"),
                                  host_environment(config, base, files, submit, common)))
        return specs
    except (OSError, tarfile.TarError) as exc:
        _undo(config.workdir, created)
        raise ConfigError(f"cannot write the work directory {config.workdir!r}: {exc}") from None


def _first_missing(path: str) -> Optional[str]:
    """The outermost directory of ``path`` that does not exist yet (what to remove on failure)."""
    missing = None
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _undo(workdir: str, created: Optional[str]) -> None:
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
    elif os.path.isdir(workdir):
        for name in os.listdir(workdir):
            path = os.path.join(workdir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((ADDRESS, 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# Running the hosts
# ----------------------------------------------------------------------------------------------

@dataclass
class ArmedFault:
    """A fault waiting to fire; ``due`` is set by the output reader for ``step=N`` faults."""

    fault: Fault
    due: threading.Event = field(default_factory=threading.Event)
    fired_at: Optional[float] = None
    pattern: Optional[re.Pattern] = None

    def __post_init__(self) -> None:
        if self.fault.step is not None:
            self.pattern = re.compile(rf"\bstep[=: ]\s*{self.fault.step}\b".encode())


@dataclass
class HostRun:
    """One started host and what happened to it."""

    spec: HostSpec
    proc: subprocess.Popen
    started: float
    faults: list[ArmedFault]
    pumps: list[threading.Thread] = field(default_factory=list)
    ended: Optional[float] = None
    returncode: Optional[int] = None
    stopped_by: Optional[str] = None  # why simulate sent it a stop signal
    stop_sent: Optional[float] = None
    killed: Optional[str] = None  # why simulate killed its process tree

    @property
    def exit_code(self) -> Optional[int]:
        """The host's exit code as a shell shows it: 128+N for signal N."""
        rc = self.returncode
        return None if rc is None else (128 - rc if rc < 0 else rc)

    def fired(self) -> Optional[ArmedFault]:
        return next((f for f in self.faults if f.fired_at is not None), None)


def pump(source: IO[bytes], sink: IO[bytes], prefix: bytes, lock: threading.Lock,
         on_line: Callable[[bytes], None]) -> None:
    """Copy a host's lines to ``sink`` with its name in front, as they come."""
    for line in iter(source.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            try:
                sink.write(prefix + line)
                sink.flush()
            except (OSError, ValueError):
                pass  # our own output is gone (a closed pipe): keep draining the host's
        on_line(line)
    source.close()


def _send(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class Simulation:
    """Starts the hosts, streams their output, fires faults, stops the job, leaves nothing behind."""

    def __init__(self, config: Config, specs: Sequence[HostSpec]) -> None:
        self.config = config
        self.specs = list(specs)
        self.runs: list[HostRun] = []
        self.lock = threading.Lock()
        self.signals: list[int] = []
        self.user_signal: Optional[int] = None
        self.start = 0.0

    # -- starting -------------------------------------------------------------------------------
    def _start_host(self, spec: HostSpec) -> HostRun:
        proc = subprocess.Popen(spec.argv, cwd=spec.cwd, env=dict(spec.env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        faults = [ArmedFault(f) for f in self.config.faults if f.host == spec.name]
        run = HostRun(spec, proc, time.monotonic(), faults)
        prefix = f"[{spec.name}] ".encode()
        for source, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            thread = threading.Thread(target=pump, args=(source, sink, prefix, self.lock,
                                                         self._step_watcher(run)), daemon=True)
            thread.start()
            run.pumps.append(thread)
        return run

    @staticmethod
    def _step_watcher(run: HostRun) -> Callable[[bytes], None]:
        def watch(line: bytes) -> None:
            for armed in run.faults:
                if armed.pattern is not None and not armed.due.is_set() and armed.pattern.search(line):
                    armed.due.set()
        return watch

    # -- signals and faults ---------------------------------------------------------------------
    def _targets(self, run: HostRun) -> list[int]:
        """The host's launcher: the process itself, or the one AWS's toolkit started."""
        if not self.config.toolkit:
            return [run.proc.pid]
        return proctree.children_of(run.proc.pid)

    def _stop_host(self, run: HostRun, signum: int, reason: str) -> None:
        targets = self._targets(run) or [run.proc.pid]
        for pid in targets:
            _send(pid, signum)
        run.stopped_by, run.stop_sent = run.stopped_by or reason, time.monotonic()

    def stop_job(self, signum: int, reason: str) -> None:
        """Send ``signum`` to every host still running that was not told to stop yet."""
        waiting = [r for r in self.runs if r.ended is None and r.stop_sent is None]
        if waiting:
            log(f"{reason}; sending {signal.Signals(signum).name} to "
                f"{', '.join(r.spec.name for r in waiting)} (grace period {self.config.grace_period:g} s)")
        for run in waiting:
            self._stop_host(run, signum, reason)

    def _fire(self, run: HostRun, armed: ArmedFault, now: float) -> bool:
        fault = armed.fault
        targets = self._targets(run)
        if not targets:
            return False  # the toolkit has not started the launcher yet: try again next tick
        log(f"fault: {fault.name} to {run.spec.name}'s launcher (pid {', '.join(map(str, targets))}) "
            f"at {now - self.start:.1f} s: {fault.meaning()}")
        if fault.signum == signal.SIGKILL and self.config.toolkit:
            targets.append(run.proc.pid)  # a lost instance takes the toolkit with it
        for pid in targets:
            _send(pid, fault.signum)
        armed.fired_at = now
        if fault.signum != signal.SIGKILL:
            run.stopped_by, run.stop_sent = f"{fault.name} by --fault ({fault.meaning()})", now
        return True

    def _fire_due_faults(self, now: float) -> None:
        for run in self.runs:
            if run.ended is not None:
                continue
            for armed in run.faults:
                fault = armed.fault
                due = armed.due.is_set() if fault.step is not None else \
                    now - run.started >= (fault.after or 0.0)
                if armed.fired_at is None and due:
                    self._fire(run, armed, now)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)

    def _handle_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            name = signal.Signals(signum).name
            if self.user_signal is None:
                self.user_signal = signum
                self.stop_job(signum, f"received {name}")
            else:
                log(f"received {name} again: killing every host now")
                self._kill_all(f"at the second {name}")

    # -- ends -----------------------------------------------------------------------------------
    def _collect_exits(self, now: float) -> None:
        for run in self.runs:
            if run.ended is not None or run.proc.poll() is None:
                continue
            run.ended, run.returncode = now, run.proc.returncode
            failed = run.exit_code != 0 or run.fired() is not None
            log(f"{run.spec.name} exited with code {run.exit_code} after {now - run.started:.1f} s")
            if failed:
                what = "was lost" if run.returncode == -signal.SIGKILL else \
                    ("was stopped" if run.stopped_by else f"failed (exit code {run.exit_code})")
                self.stop_job(signal.SIGTERM, f"{run.spec.name} {what}")

    def _enforce_deadlines(self, now: float) -> None:
        limit = self.config.grace_period + BACKSTOP_SECONDS
        for run in self.runs:
            if run.ended is None and run.stop_sent is not None and not run.killed \
                    and now - run.stop_sent > limit:
                log(f"{run.spec.name} still runs {limit:g} s after the stop signal: killing it")
                proctree.kill_tree([run.proc.pid])
                run.killed = f"still running {limit:g} s after the stop signal"

    def _kill_all(self, why: str) -> None:
        for run in self.runs:
            if run.ended is None and not run.killed:
                proctree.kill_tree([run.proc.pid])
                run.killed = why

    # -- the whole run ----------------------------------------------------------------------------
    def run(self) -> None:
        """Start every host and return when all have ended and nothing of theirs is left."""
        proctree.become_subreaper()  # orphans of a killed launcher come back to us
        watchdog = proctree.Watchdog()  # forked before any pipe exists: it holds none of them
        previous = {s: signal.signal(s, self._on_signal)
                    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self.start = time.monotonic()
            for spec in self.specs:
                self.runs.append(self._start_host(spec))
                watchdog.guard(self.runs[-1].proc.pid)
            log(f"started {len(self.runs)} host(s): " +
                ", ".join(f"{r.spec.name} pid {r.proc.pid}" for r in self.runs))
            self._loop()
        finally:  # also when a host could not be started: nothing of the others may stay
            leftovers = proctree.kill_tree([os.getpid()], include_roots=False, exclude=[watchdog.pid])
            if leftovers:
                log(f"killed {leftovers} process(es) the hosts left behind")
            for run in self.runs:
                for thread in run.pumps:
                    thread.join(timeout=5)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            watchdog.release()
            proctree.reap_children()

    def _loop(self) -> None:
        while any(r.ended is None for r in self.runs):
            now = time.monotonic()
            self._handle_signals()
            self._fire_due_faults(now)
            self._collect_exits(now)
            self._enforce_deadlines(now)
            time.sleep(TICK)


# ----------------------------------------------------------------------------------------------
# The summary
# ----------------------------------------------------------------------------------------------

def _first_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.readline().strip()
    except OSError:
        return ""


def _model_files(model_dir: str) -> list[str]:
    found = []
    for root, _dirs, files in os.walk(model_dir):
        found += [os.path.relpath(os.path.join(root, f), model_dir) for f in files]
    return sorted(found)


def outcome_text(run: HostRun, start: float, user_signal: Optional[int]) -> str:
    """What happened to the host, in words."""
    armed = run.fired()
    if armed is not None:
        verb = "lost" if armed.fault.signum == signal.SIGKILL else "stopped"
        text = (f"{verb}: {armed.fault.name} by --fault at {armed.fired_at - start:.1f} s "
                f"({armed.fault.meaning()})")
    elif run.stopped_by is not None:
        text = f"stopped by simulate after {run.stopped_by}" if user_signal is None else \
            f"stopped: {signal.Signals(user_signal).name} from the user"
    else:
        text = "succeeded" if run.exit_code == 0 else "failed"
    return text + (f", killed {run.killed}" if run.killed else "")


def host_report(run: HostRun, start: float, user_signal: Optional[int]) -> dict[str, Any]:
    """One row of the summary."""
    model_dir = os.path.join(run.spec.base_dir, "model")
    return {"host": run.spec.name, "exit_code": run.exit_code, "pid": run.proc.pid,
            "started": round(run.started - start, 3), "ended": round((run.ended or start) - start, 3),
            "duration": round((run.ended or run.started) - run.started, 3),
            "outcome": outcome_text(run, start, user_signal),
            "fault_at": None if run.fired() is None else round(run.fired().fired_at - start, 3),
            "failure": _first_line(os.path.join(run.spec.base_dir, "output", "failure")),
            "model_dir": model_dir, "model_files": _model_files(model_dir)}


def job_report(sim: Simulation) -> dict[str, Any]:
    """The job's summary: each host, the exit code, and how fast the job ended after a death."""
    hosts = [host_report(r, sim.start, sim.user_signal) for r in sim.runs]
    failing = sorted((h["ended"], i) for i, h in enumerate(hosts)
                     if h["exit_code"] != 0 or h["fault_at"] is not None)
    first = hosts[failing[0][1]] if failing else None
    nonzero = sorted((h["ended"], i) for i, h in enumerate(hosts) if h["exit_code"] != 0)
    last = max(h["ended"] for h in hosts)
    return {"job_name": sim.config.job_name, "workdir": sim.config.workdir,
            "toolkit": bool(sim.config.toolkit), "hosts": hosts,
            "exit_code": hosts[nonzero[0][1]]["exit_code"] if nonzero else 0,
            "first_failure": first["host"] if first else None,
            "death_to_last_exit": round(last - first["ended"], 3) if first else None,
            "fault_to_last_exit": _fault_to_last(hosts, last)}


def _fault_to_last(hosts: Sequence[Mapping[str, Any]], last: float) -> Optional[float]:
    fired = [h["fault_at"] for h in hosts if h["fault_at"] is not None]
    return round(last - min(fired), 3) if fired else None


def format_summary(report: Mapping[str, Any]) -> str:
    """The table a person reads at the end."""
    rows = [("host", "exit", "time", "outcome", "failure (output/failure, first line)", "model")]
    for h in report["hosts"]:
        model = (f"{len(h['model_files'])} file(s) in {h['model_dir']}" if h["model_files"]
                 else "nothing")
        rows.append((h["host"], str(h["exit_code"]), f"{h['duration']:.1f}s", h["outcome"],
                     (h["failure"] or "-")[:100], model))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    if report["first_failure"]:
        lines.append(f"first to end badly: {report['first_failure']}; the last host exited "
                     f"{report['death_to_last_exit']:.1f} s after it")
    lines.append(f"exit code {report['exit_code']}; everything is in {report['workdir']} "
                 "(SageMaker would merge every host's model/ into one model.tar.gz)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ddp-launcher simulate``. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config = build_config(args, os.getcwd())
        port = free_port()
        specs = make_tree(config, os.environ, port)
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    log(f"job {config.job_name}: {len(specs)} host(s) in {config.workdir}, master "
        f"{ADDRESS}:{port}{', through AWS toolkit' if config.toolkit else ''}")
    sim = Simulation(config, specs)
    try:
        sim.run()
    except OSError as exc:
        sys.stderr.write(f"{PROG}: error: cannot start a host: {exc}\n")
        return 1
    for run in sim.runs:
        for armed in run.faults:
            if armed.fired_at is None:
                log(f"fault {armed.fault.host}:{armed.fault.name}:{armed.fault.when()} never fired")
    report = job_report(sim)
    _write_json(os.path.join(config.workdir, "summary.json"), report)
    sys.stdout.flush()
    sys.stderr.write("\n" + format_summary(report) + "\n")
    sys.stderr.flush()
    return int(report["exit_code"])
