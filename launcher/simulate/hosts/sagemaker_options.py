"""simulate's SageMaker options and their checks: what only a SageMaker job has (an instance type, input
channels, the estimator's hyperparameters, AWS's toolkit, SDK 3.x's channels, instance groups).

The builder :mod:`launcher.simulate.hosts.sagemaker` declares them (the builder protocol in
:mod:`launcher.simulate.hosts`); :func:`check_options` returns a :class:`SageMakerOptions` or raises
:class:`~launcher.errors.ConfigError` (exit 2). Nothing here writes or starts anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from launcher.errors import ConfigError, shown
from launcher.platforms.sagemaker import bundle
from launcher.simulate.hosts.sagemaker_files import sdk_entries
from launcher.simulate.hosts.sagemaker_groups import Groups, assign_hosts, parse_instance_groups
from launcher.simulate.job import MAX_HOSTS, PlatformOptions

DEFAULT_INSTANCE_TYPE = "ml.m5.xlarge"
SCRIPT_KEYS = ("train-script", "train_script")
MAX_HYPERPARAMETERS, MAX_KEY_CHARS, MAX_VALUE_CHARS = 100, 256, 2500  # CreateTrainingJob's limits
MAX_DEPTH = 100  # JSON nesting of a value: deeper ones break the JSON writers' recursion down the line
CHANNEL_NAME = re.compile(r"^[A-Za-z0-9.\-_]{1,64}$")
# The builder protocol: how an option of this builder given with another --platform is refused, and
# the option that gives the number of hosts instead of --hosts.
WRONG_PLATFORM = "{option} is SageMaker-only (--platform {platform})"
HOSTS_OPTION = "--instance-groups"
SCRIPT_WORDS = "SageMaker: the estimator's hyperparameters, --key value ..."


@dataclass(frozen=True)
class SageMakerOptions(PlatformOptions):
    """A SageMaker job's own settings, checked."""

    instance_type: str = DEFAULT_INSTANCE_TYPE
    channels: Mapping[str, str] = field(default_factory=dict)  # name -> absolute directory
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)  # decoded, train-script = the script's name
    toolkit: Optional[tuple[str, ...]] = None  # AWS's `train` command, when --toolkit
    sdk: Optional[str] = None  # None (SDK 2.x estimator) or "v3" (ModelTrainer)
    drivers_dir: Optional[str] = None  # --sdk v3: the sm_drivers channel, absolute
    code_dir: Optional[str] = None  # --sdk v3: the code channel, absolute (None: the staged bundle)
    instance_groups: Groups = ()  # ((name, instance type, hosts), ...) of a heterogeneous job

    def report(self) -> dict[str, Any]:
        return {"toolkit": bool(self.toolkit)}

    def started_through(self) -> str:
        return ", through AWS toolkit" if self.toolkit else ""


def add_options(parser: argparse.ArgumentParser) -> None:
    """SageMaker's options, as a group of ``parser`` (each one's default means "not given")."""
    group = parser.add_argument_group("SageMaker (--platform sagemaker)")
    group.add_argument("--instance-type", default=None, help=f"default {DEFAULT_INSTANCE_TYPE}")
    group.add_argument("--channel", action="append", default=[], metavar="NAME=DIR",
                       help="an input channel, input/data/NAME links to DIR")
    group.add_argument("--hyperparameters", default=None, metavar="JSON",
                       help="the estimator's hyperparameters as a JSON object")
    group.add_argument("--toolkit", action="store_true",
                       help="start each host through AWS's sagemaker-training `train` command")
    group.add_argument("--sdk", choices=["v2", "v3"], default=None,
                       help="the SDK line that submitted the job (default v2: estimator; v3: ModelTrainer, "
                            "run through its sm_train.sh and drivers, each host with its own /opt/ml)")
    group.add_argument("--sm-drivers", default=None, metavar="DIR",
                       help="--sdk v3: the sm_drivers channel ModelTrainer uploaded (sm_train.sh, drivers, ...)")
    group.add_argument("--code", default=None, metavar="DIR",
                       help="--sdk v3: the code channel as uploaded (default: the bundle staged from the script)")
    group.add_argument(HOSTS_OPTION, default=None, metavar="NAME=TYPE:COUNT,...",
                       help="a heterogeneous cluster, e.g. train=ml.g5.xlarge:2,data=ml.c5.xlarge:1 "
                            "(hosts algo-1.. in this order; it gives --hosts)")


def count_hosts(args: argparse.Namespace) -> Optional[int]:
    """The number of hosts ``--instance-groups`` gives (None: not given); ``--hosts``, if given too, must agree."""
    if args.instance_groups is None:
        return None
    groups = parse_instance_groups(args.instance_groups, MAX_HOSTS)
    total = sum(g[2] for g in groups)
    if args.hosts is not None and args.hosts != total:
        raise ConfigError(f"--hosts {args.hosts} but --instance-groups has {total} hosts")
    if args.instance_type is not None:
        raise ConfigError("--instance-type and --instance-groups: each group names its own instance type")
    return total


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


def toolkit_command() -> Optional[tuple[str, ...]]:
    """AWS's ``train`` command (sagemaker_training.cli.train) for this Python, if installed."""
    if importlib.util.find_spec("sagemaker_training") is None:
        return None
    beside = os.path.join(os.path.dirname(sys.executable), "train")
    if os.access(beside, os.X_OK):
        return (beside,)
    return (sys.executable, "-m", "sagemaker_training.cli.train")


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


def check_options(args: argparse.Namespace, hosts: Sequence[str], job_name: str, words: Sequence[str],
                  cwd: str) -> tuple[str, tuple[str, ...], SageMakerOptions]:
    """The script (from ``-- script.py --key value ...`` or the ``train-script`` hyperparameter), no
    script arguments (the words are hyperparameters), and the checked :class:`SageMakerOptions`."""
    if args.instance_type is not None and not args.instance_type.startswith("ml."):
        raise ConfigError(f"--instance-type must be a SageMaker type like ml.m5.xlarge: {args.instance_type!r}")
    hps = parse_hyperparameters_json(args.hyperparameters)
    script_word, from_words = script_hyperparameters(words)
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
    groups = parse_instance_groups(args.instance_groups, MAX_HOSTS) if args.instance_groups else ()
    return script, (), SageMakerOptions(args.instance_type or DEFAULT_INSTANCE_TYPE, channels, hps, command,
                                        sdk=args.sdk if v3[0] else None, drivers_dir=v3[0], code_dir=v3[1],
                                        instance_groups=assign_hosts(groups, hosts))
