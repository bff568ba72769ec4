"""simulate's command line: the options, the checks of bad input (exit 2) and the resulting :class:`Config`.

Nothing here writes or starts anything: :func:`build_config` parses and checks, or raises
:class:`~launcher.errors.ConfigError`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from launcher.errors import ConfigError, shown
from launcher.platforms.sagemaker import bundle
from launcher.simulate.hosts import BUILDERS, DEFAULT, builder
from launcher.simulate.hosts.sagemaker_files import sdk_entries

PROG = "ddp-launcher simulate"
MAX_HOSTS = 64
DEFAULT_INSTANCE_TYPE = "ml.m5.xlarge"
DEFAULT_GRACE_PERIOD = 5.0
DEFAULT_DEADLINE = 86400.0  # SageMaker's default MaxRuntimeInSeconds: the platform's own hard stop
NETWORKS = ("netns", "loopback")
NETWORK_FAULTS = ("partition", "poweroff")  # faults that are not a signal to the launcher and do not end
# Transient faults (HOST:KIND:AFTER:SECONDS): each ends by itself after SECONDS; what each stands for.
TRANSIENT_FAULTS = {"blip": "network blip", "pause": "stalled launcher", "vmpause": "VM pause",
                    "starve": "CPU starvation", "saturate": "CPU saturation"}
NETNS_FAULTS = ("partition", "blip")  # they take a host's link down: only a host of its own has one
MAX_FAULT_SECONDS = 86400.0
SCRIPT_KEYS = ("train-script", "train_script")
MAX_HYPERPARAMETERS, MAX_KEY_CHARS, MAX_VALUE_CHARS = 100, 256, 2500  # CreateTrainingJob's limits
MAX_DEPTH = 100  # JSON nesting of a value: deeper ones break the JSON writers' recursion down the line
CHANNEL_NAME = re.compile(r"^[A-Za-z0-9.\-_]{1,64}$")
JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
KUBERNETES_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS-1035 label
SAGEMAKER_ONLY = ("instance_type", "channel", "hyperparameters", "toolkit", "sdk", "sm_drivers", "code")
EPILOG = """then: -- script.py args...  (SageMaker: the estimator's hyperparameters, --key value ...)

platforms (each host gets what the platform gives a real node; the manual: launcher/simulate/__init__.py):
  sagemaker    algo-1..algo-N: /opt/ml tree (resourceconfig.json ...) and SM_* variables
  kubeflow     JOB-master-0, JOB-worker-i: MASTER_ADDR/PORT, WORLD_SIZE, RANK, PET_NNODES, PET_NODE_RANK,
               PET_NPROC_PER_NODE, PET_MASTER_ADDR/PORT (--kubeflow-legacy: MASTER_*, WORLD_SIZE, RANK)
  kubeflow-v2  JOB-node-0-i: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR/PORT
  oci          node-i: NODE_RANK, NODE_COUNT, INITIAL_CLUSTER_SIZE, CLUSTER_NODES_METADATA_FILE
  vertex       workerpool0-ID-0, workerpool1-ID-i: CLUSTER_SPEC
  env          node-i: MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK
  slurm        node1..nodeN: SLURM_JOB_ID, SLURM_NODEID, SLURM_STEP_NODELIST, SLURMD_NODENAME, ...
  pbs          node1..nodeN: PBS_NODEFILE (a line per slot), PBS_JOBID, ...; own host name (unshare)"""


@dataclass(frozen=True)
class Fault:
    """A fault of one host, after some time or at a training step: a signal to its launcher
    (``kind`` ``signal``), or ``partition`` (its link goes down) or ``poweroff`` (every process of
    the host killed at once, the link down first); those two have ``signum`` 0. A transient fault
    (a kind of :data:`TRANSIENT_FAULTS`) lasts ``seconds`` and then ends by itself."""

    host: str
    signum: int
    after: Optional[float] = None
    step: Optional[int] = None
    kind: str = "signal"
    seconds: Optional[float] = None  # how long a transient fault lasts

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.kind == "signal" else self.kind

    @property
    def transient(self) -> bool:
        """True for a fault that ends by itself (the host is expected to survive it)."""
        return self.kind in TRANSIENT_FAULTS

    def meaning(self) -> str:
        """What the fault stands for on a cloud platform."""
        if self.kind in TRANSIENT_FAULTS:
            return TRANSIENT_FAULTS[self.kind]
        if self.kind != "signal":
            return {"partition": "network partition", "poweroff": "power loss"}[self.kind]
        return {signal.SIGKILL: "lost instance", signal.SIGTERM: "spot interruption"}.get(
            self.signum, "signal")

    def when(self) -> str:
        return f"step={self.step}" if self.step is not None else f"{self.after:g} s"


@dataclass(frozen=True)
class Config:
    """Everything simulate decided from its command line, before anything is written or started."""

    platform: str
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
    script_args: tuple[str, ...] = ()  # the words after the script, untouched (not SageMaker)
    kubeflow_legacy: bool = False
    network: Optional[str] = None  # netns or loopback; None: netns where permitted (decided at the start)
    network_note: str = ""  # why this network, when it was not asked for
    platform_stop: bool = True  # stop the other hosts when one fails, as the platform does
    deadline: float = DEFAULT_DEADLINE  # seconds: then every host is stopped
    sdk: Optional[str] = None  # SageMaker: None (SDK 2.x estimator) or "v3" (ModelTrainer)
    drivers_dir: Optional[str] = None  # --sdk v3: the sm_drivers channel, absolute
    code_dir: Optional[str] = None  # --sdk v3: the code channel, absolute (None: the staged bundle)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is a one-line :class:`ConfigError` (exit 2, nothing started)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """simulate's options (the script and its hyperparameters come after ``--``)."""
    p = _Parser(prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Run N hosts of a cluster platform as N launcher processes on this machine.",
                epilog=EPILOG)
    p.add_argument("--platform", choices=list(BUILDERS), default=DEFAULT,
                   help=f"the platform the hosts are given the variables and files of (default {DEFAULT})")
    p.add_argument("--hosts", type=int, required=True, help=f"number of hosts, 1-{MAX_HOSTS}")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per host (the platform's own field where it has one, else "
                        "LAUNCHER_NPROC_PER_NODE; default: the platform's or the launcher's, 1 on CPU)")
    p.add_argument("--kubeflow-legacy", action="store_true",
                   help="kubeflow: a training-operator before 1.7 (one process per pod: MASTER_ADDR, "
                        "MASTER_PORT, WORLD_SIZE = pods, RANK = pod index; no PET_*)")
    p.add_argument("--instance-type", default=None, help=f"SageMaker: default {DEFAULT_INSTANCE_TYPE}")
    p.add_argument("--channel", action="append", default=[], metavar="NAME=DIR",
                   help="SageMaker: an input channel, input/data/NAME links to DIR")
    p.add_argument("--workdir", default=None, help="where the hosts' trees go (default ./runs/JOB)")
    p.add_argument("--job-name", default=None,
                   help="the job's name, in its host names and TRAINING_JOB_NAME (default simulate-<time>)")
    p.add_argument("--hyperparameters", default=None, metavar="JSON",
                   help="SageMaker: the estimator's hyperparameters as a JSON object")
    p.add_argument("--toolkit", action="store_true",
                   help="SageMaker: start each host through AWS's sagemaker-training `train` command")
    p.add_argument("--sdk", choices=["v2", "v3"], default=None,
                   help="SageMaker: the SDK line that submitted the job (default v2: estimator; v3: ModelTrainer, "
                        "run through its sm_train.sh and drivers, each host with its own /opt/ml)")
    p.add_argument("--sm-drivers", default=None, metavar="DIR",
                   help="--sdk v3: the sm_drivers channel ModelTrainer uploaded (sm_train.sh, drivers, ...)")
    p.add_argument("--code", default=None, metavar="DIR",
                   help="--sdk v3: the code channel as uploaded (default: the bundle staged from the script)")
    p.add_argument("--fault", action="append", default=[], metavar="HOST:KIND:AFTER[:SECONDS]",
                   help="AFTER is seconds from the host's start or step=N; e.g. algo-2:SIGKILL:5 (lost "
                        "instance), algo-2:SIGTERM:step=3 (spot), algo-2:partition:5 (its link goes down), "
                        "algo-2:poweroff:5 (every process of the host killed at once). Transient, for "
                        "SECONDS, then undone: blip (link down, then up), pause (the launcher SIGSTOPped, "
                        "then SIGCONT), vmpause (every process of the host stopped), starve (the host's "
                        "processes held to 0.1%% of a CPU by a cgroup), saturate (a busy loop pinned to "
                        "each of the host's CPUs), e.g. algo-2:blip:10:5. HOST as the platform names it")
    p.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_PERIOD,
                   help="seconds a launcher may take to stop its workers (LAUNCHER_GRACE_PERIOD)")
    p.add_argument("--network", choices=NETWORKS, default=None,
                   help="netns: each host its own network namespace, address, hostname and /etc/hosts "
                        "on a private bridge; loopback: every host is 127.0.0.1 (default: netns where "
                        "permitted, else loopback)")
    p.add_argument("--platform-stop", choices=("on", "off"), default="on",
                   help="on: when a host fails, stop the others as the platform does; off: leave them "
                        "running, so the launcher's own behaviour is measured (default on)")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE, metavar="SECONDS",
                   help=f"stop every host this long after the start (default {DEFAULT_DEADLINE:g}, "
                        "SageMaker's default max_run)")
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
    except (ValueError, RecursionError):  # RecursionError: nested too deeply to be meant as JSON
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
    except RecursionError:
        raise ConfigError("--hyperparameters is not valid JSON: nested too deeply") from None
    except ValueError as exc:
        raise ConfigError(f"--hyperparameters is not valid JSON ({exc}): {shown(text)}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--hyperparameters must be a JSON object, found {shown(text)}")
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


def _fault_seconds(text: str, what: str, value: str, least: float) -> float:
    """A number of seconds in a ``--fault``: finite, at least ``least`` (above it when ``least`` is 0 for a
    duration), at most :data:`MAX_FAULT_SECONDS`."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not least <= seconds <= MAX_FAULT_SECONDS or (what == "SECONDS" and seconds == 0):
        bound = "> 0" if what == "SECONDS" else ">= 0"
        raise ConfigError(f"--fault {shown(text)}: {what} must be seconds {bound} (at most "
                          f"{MAX_FAULT_SECONDS:g}){' or step=N' if what == 'AFTER' else ''}: {shown(value)}")
    return seconds


def parse_fault(text: str, hosts: Sequence[str]) -> Fault:
    """``algo-2:SIGKILL:5``, ``algo-2:SIGTERM:step=3``, ``algo-2:partition:5``, ``algo-2:poweroff:5``, or a
    transient fault with its duration: ``algo-2:blip:10:5`` (after 10 s, for 5 s), ``algo-2:pause:step=3:5``."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ConfigError(f"--fault must be HOST:SIGNAL:AFTER (e.g. algo-2:SIGKILL:5) or HOST:KIND:AFTER:SECONDS "
                          f"(e.g. algo-2:blip:10:5): {shown(text)}")
    host, sig, after = parts[:3]
    if host not in hosts:
        raise ConfigError(f"--fault {shown(text)}: no host {shown(host)} (the hosts are {', '.join(hosts[:3])}"
                          f"{', ...' if len(hosts) > 3 else ''})")
    word = sig.strip().lower()
    kind = word if word in NETWORK_FAULTS or word in TRANSIENT_FAULTS else "signal"
    try:
        signum = parse_signal(sig) if kind == "signal" else 0
    except (KeyError, ValueError):
        raise ConfigError(f"--fault {shown(text)}: unknown fault {shown(sig)}: a signal, partition, poweroff, "
                          f"{', '.join(TRANSIENT_FAULTS)}") from None
    if len(parts) == 3 and kind in TRANSIENT_FAULTS:
        raise ConfigError(f"--fault {shown(text)}: {kind} lasts SECONDS: HOST:{kind}:AFTER:SECONDS, e.g. "
                          f"{host}:{kind}:10:5")
    if len(parts) == 4 and kind not in TRANSIENT_FAULTS:
        raise ConfigError(f"--fault {shown(text)}: {shown(sig)} takes no duration (only "
                          f"{', '.join(TRANSIENT_FAULTS)} do)")
    seconds = _fault_seconds(text, "SECONDS", parts[3], 0.0) if len(parts) == 4 else None
    if after.startswith("step="):
        step = after[len("step="):]
        if not (step.isdigit() and step.isascii() and len(step) <= 9):
            raise ConfigError(f"--fault {shown(text)}: AFTER must be seconds >= 0 or step=N: {shown(after)}")
        return Fault(host, signum, step=int(step), kind=kind, seconds=seconds)
    return Fault(host, signum, after=_fault_seconds(text, "AFTER", after, 0.0), kind=kind, seconds=seconds)


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
    if not 0 < args.deadline < float("inf"):
        raise ConfigError(f"--deadline must be > 0 seconds: {args.deadline:g}")
    if args.instance_type is not None and not args.instance_type.startswith("ml."):
        raise ConfigError(f"--instance-type must be a SageMaker type like ml.m5.xlarge: "
                          f"{args.instance_type!r}")


def _texts(value: Any) -> tuple[list[str], int]:
    """Every text inside a decoded hyperparameter value (dict keys included), and its depth of nesting."""
    texts: list[str] = []
    deepest = 0
    stack = [(value, 0)]
    while stack:  # no recursion: a value may be nested deeper than Python's recursion limit
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict):
            texts.extend(item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return texts, deepest


def _unusable(text: str) -> Optional[str]:
    """Why a text cannot be part of an argv word or an environment variable (None: it can)."""
    if "\0" in text:
        return "a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a character that is not UTF-8 (a lone surrogate)"
    return None


def _check_limits(hps: Mapping[str, Any], sagemaker_entries: int) -> None:
    """CreateTrainingJob refuses more than 100 entries, keys over 256 or values over 2500 chars; each
    hyperparameter becomes argv words and ``SM_HP_<KEY>``: NUL, '=' in a key, lone surrogates are refused,
    and values nested deeper than ``MAX_DEPTH``."""
    if len(hps) + sagemaker_entries > MAX_HYPERPARAMETERS:
        raise ConfigError(f"{len(hps)} hyperparameters and the SDK's {sagemaker_entries} exceed "
                          f"SageMaker's limit of {MAX_HYPERPARAMETERS}")
    for key, value in hps.items():
        if not key or len(key) > MAX_KEY_CHARS:
            raise ConfigError(f"hyperparameter name must be 1-{MAX_KEY_CHARS} characters: {shown(key)}")
        why = "'=' (it names the variable SM_HP_<NAME>)" if "=" in key else _unusable(key)
        if why:
            raise ConfigError(f"hyperparameter name {shown(key)} contains {why}")
        texts, depth = _texts(value)
        if depth > MAX_DEPTH:
            raise ConfigError(f"hyperparameter {shown(key)}: value nested {depth} levels deep (at most {MAX_DEPTH})")
        why = next(filter(None, map(_unusable, texts)), None)
        if why:
            raise ConfigError(f"hyperparameter {shown(key)}: the value {shown(value)} contains {why}")
        if len(json.dumps(value)) > MAX_VALUE_CHARS:
            raise ConfigError(f"hyperparameter {shown(key)}: value longer than {MAX_VALUE_CHARS} "
                              "characters once JSON-encoded")


def _workdir(args: argparse.Namespace, job_name: str, cwd: str) -> str:
    path = os.path.abspath(os.path.join(cwd, args.workdir or os.path.join("runs", job_name)))
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConfigError(f"work directory exists and is not empty: {path!r} "
                          "(give another --workdir or --job-name)")
    return path


def _check_platform(args: argparse.Namespace, job_name: str) -> None:
    """Options that only one platform has, and the names Kubernetes accepts."""
    if args.platform != "sagemaker":
        given = [name for name in SAGEMAKER_ONLY if getattr(args, name) not in (None, False, [])]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} is SageMaker-only (--platform {args.platform})")
    if args.kubeflow_legacy and args.platform != "kubeflow":
        raise ConfigError(f"--kubeflow-legacy needs --platform kubeflow, not {args.platform!r}")
    if args.platform.startswith("kubeflow") and not KUBERNETES_NAME.match(job_name):
        raise ConfigError(f"--job-name must be a Kubernetes name (lower-case letters, digits, '-', "
                          f"starting with a letter) for --platform {args.platform}: {job_name!r}")


def _plain_script(words: Sequence[str], cwd: str) -> tuple[str, tuple[str, ...]]:
    """``-- script.py args...`` where the job's command is ``python -m launcher script.py args...``."""
    if not words or words[0].startswith("-"):
        raise ConfigError("no training script: give it after '--' (-- script.py args...)")
    path = os.path.abspath(os.path.join(cwd, words[0]))
    if not os.path.isfile(path):
        raise ConfigError(f"training script not found: {words[0]!r}")
    return path, tuple(words[1:])


def _check_v3(args: argparse.Namespace, cwd: str) -> tuple[Optional[str], Optional[str]]:
    """``--sdk v3``: the sm_drivers directory (required, with ``sm_train.sh``) and the code directory."""
    if args.sdk != "v3":
        given = "--sm-drivers" if args.sm_drivers else ("--code" if args.code else None)
        if given:
            raise ConfigError(f"{given} needs --sdk v3")
        return None, None
    if not args.sm_drivers:
        raise ConfigError("--sdk v3 needs --sm-drivers DIR: the sm_drivers channel ModelTrainer uploads "
                          "(python tools/sm_drivers_v3.py DIR in the SDK 3.x venv writes one)")
    found = []
    for option, path in (("--sm-drivers", args.sm_drivers), ("--code", args.code)):
        full = os.path.abspath(os.path.join(cwd, path)) if path else None
        if full is not None and not os.path.isdir(full):
            raise ConfigError(f"{option}: directory not found: {shown(path)}")
        found.append(full)
    missing = [name for name in ("sm_train.sh", "scripts/environment.py", "common/utils.py")
               if not os.path.isfile(os.path.join(found[0], name))]
    if missing:
        raise ConfigError(f"--sm-drivers {shown(args.sm_drivers)}: not ModelTrainer's sm_drivers channel "
                          f"(no {missing[0]})")
    return found[0], found[1]


def build_config(argv: Sequence[str], cwd: str) -> Config:
    """Parse and check everything; raises :class:`ConfigError`. Writes and starts nothing."""
    own, script_words = split_at_dashes(argv)
    args = build_parser().parse_args(own)
    _check_counts(args)
    job_name = args.job_name or default_job_name()
    if not JOB_NAME.match(job_name):
        raise ConfigError(f"--job-name must be 1-63 letters, digits and hyphens: {job_name!r}")
    _check_platform(args, job_name)
    hosts = builder(args.platform).host_names(job_name, args.hosts)
    faults = tuple(parse_fault(text, hosts) for text in args.fault)
    partition = next((f for f in faults if f.kind in NETNS_FAULTS), None)
    if partition is not None and args.network == "loopback":
        raise ConfigError(f"--fault {partition.host}:{partition.kind} needs --network netns (every host is "
                          "127.0.0.1 with --network loopback)")
    run = {"network": args.network, "platform_stop": args.platform_stop == "on", "deadline": args.deadline}
    if args.platform != "sagemaker":
        script, script_args = _plain_script(script_words, cwd)
        return Config(args.platform, hosts, args.nproc_per_node, "", {}, _workdir(args, job_name, cwd),
                      job_name, {}, script, None, faults, args.grace_period, script_args,
                      args.kubeflow_legacy, **run)
    hps = parse_hyperparameters_json(args.hyperparameters)
    script_word, from_words = script_hyperparameters(script_words)
    if script_word is not None:
        for key in SCRIPT_KEYS:
            hps.pop(key, None)
    hps.update(from_words)
    v3 = _check_v3(args, cwd)
    given = dict(hps)
    script = _find_script(script_word, hps, v3[1] or cwd)
    hps = {"train-script": os.path.basename(script), **hps}
    if v3[0] and any(k in given for k in SCRIPT_KEYS):  # ModelTrainer keeps the user's order
        hps = {k: os.path.basename(script) if k in SCRIPT_KEYS else v for k, v in given.items()}
    _check_limits(hps, len(sdk_entries("", "", "")))
    channels = dict(parse_channel(text, cwd) for text in args.channel)
    command = toolkit_command() if args.toolkit else None
    if v3[0] and args.toolkit:
        raise ConfigError("--toolkit is SDK 2.x's container toolkit; --sdk v3 runs ModelTrainer's own drivers")
    if args.toolkit and command is None:
        raise ConfigError(f"--toolkit needs AWS's sagemaker-training package in {sys.executable}: "
                          "pip install sagemaker-training")
    return Config(args.platform, hosts, args.nproc_per_node, args.instance_type or DEFAULT_INSTANCE_TYPE,
                  channels, _workdir(args, job_name, cwd), job_name, hps, script, command, faults,
                  args.grace_period, sdk=args.sdk if v3[0] else None, drivers_dir=v3[0], code_dir=v3[1], **run)
