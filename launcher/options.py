"""The launcher's own options, and how they are told apart from the training script's arguments.

Every option can be given three ways, the first one found wins:

1. on the command line, as ``--grace-period 30``, ``--grace_period 30`` or ``--grace-period=30``;
2. in the environment, as ``LAUNCHER_GRACE_PERIOD=30``;
3. its default.

Two command-line forms exist:

- ``ddp-launcher [options] train.py [script args...]``: options come first, the first other word
  is the training script, and everything after it belongs to the script.
- The SageMaker form, where the launcher is the estimator's ``entry_point`` and the script is a
  hyperparameter: ``--epochs 25 --train-script train.py --lr 0.1``. As soon as the argv names
  ``--train-script`` (or ``--train_script``), the launcher's options are taken out wherever they
  stand and every other word is passed to the script unchanged and in order.

SageMaker renders a boolean hyperparameter as ``--dry-run True``, so boolean options take an
optional ``True/False/true/false/1/0`` after them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Callable, NamedTuple, Optional

from launcher.errors import ConfigError

ENV_PREFIX = "LAUNCHER_"
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError
    return value


def parse_bool(text: str) -> bool:
    """``True/False/true/false/1/0/yes/no`` as SageMaker and people write them."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError


def parse_resolve(text: str) -> dict[str, str]:
    """``algo-1=127.0.0.1,algo-2=127.0.0.1`` -> a host-name-to-address map."""
    mapping: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, sep, addr = item.partition("=")
        if not sep or not host.strip() or not addr.strip():
            raise ValueError
        mapping[host.strip()] = addr.strip()
    return mapping


class Spec(NamedTuple):
    """One launcher option: its name, how its text becomes a value, and what it means."""

    name: str
    parse: Callable[[str], object]
    default: object
    expects: str
    help: str
    metavar: str = ""

    @property
    def flags(self) -> tuple[str, str]:
        return "--" + self.name.replace("_", "-"), "--" + self.name

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def is_bool(self) -> bool:
        return self.parse is parse_bool


SPECS: tuple[Spec, ...] = (
    Spec("train_script", str, None, "a path", "the training script (the SageMaker form names it so)",
         metavar="PATH"),
    Spec("platform", str, None, "a platform name", "skip detection: the cluster type to read (see below)",
         metavar="NAME"),
    Spec("nproc_per_node", _positive_int, None, "a whole number >= 1",
         "processes per host; default SM_NUM_GPUS, else SM_NUM_NEURONS, else GPUs found, else 1", metavar="N"),
    Spec("master_port", _port, None, "a port 1-65535",
         "port of the rendezvous on the first host; default the platform's (SageMaker 7777, else 29500)",
         metavar="PORT"),
    Spec("rdzv_timeout", _positive_int, 900, "seconds >= 1",
         "how long hosts wait for each other at the start", metavar="SECONDS"),
    Spec("max_restarts", _non_negative_int, 0, "a whole number >= 0", "torchrun restarts of the workers", metavar="N"),
    Spec("grace_period", _positive_float, None, "seconds > 0",
         "after a stop signal, how long workers may take before the whole tree is killed; default "
         "inside the platform's own kill window (SageMaker 90, elsewhere 25)", metavar="SECONDS"),
    Spec("resolve", parse_resolve, {}, "HOST=ADDR[,HOST=ADDR...]",
         "addresses for host names the machine cannot resolve (simulated hosts)", metavar="HOST=ADDR,..."),
    Spec("dry_run", parse_bool, False, "true or false", "print what would be launched and exit"),
    Spec("json", parse_bool, False, "true or false", "with --dry-run: print it as JSON"),
)
_BY_FLAG = {flag: spec for spec in SPECS for flag in spec.flags}


class Options(NamedTuple):
    """The launcher's options after parsing (see :data:`SPECS` for their meaning)."""

    train_script: Optional[str]
    platform: Optional[str]
    nproc_per_node: Optional[int]
    master_port: Optional[int]
    rdzv_timeout: int
    max_restarts: int
    grace_period: Optional[float]
    resolve: dict
    dry_run: bool
    json: bool


class Invocation(NamedTuple):
    """The parsed command line: the launcher's options, the script and the script's arguments."""

    options: Options
    script: str
    script_args: tuple[str, ...]
    sagemaker_form: bool


def _convert(spec: Spec, text: str, source: str) -> object:
    try:
        return spec.parse(text)
    except ValueError:
        raise ConfigError(f"invalid value for {source}: {text!r} (expected {spec.expects})") from None


def _split_flag(token: str) -> tuple[Optional[Spec], Optional[str]]:
    name, sep, inline = token.partition("=")
    spec = _BY_FLAG.get(name)
    return spec, (inline if sep else None)


def _names_train_script(tokens: Sequence[str]) -> bool:
    for token in tokens:
        if token == "--":
            return False
        spec, _ = _split_flag(token)
        if spec is not None and spec.name == "train_script":
            return True
    return False


def parse_invocation(argv: Sequence[str], environ: Mapping[str, str]) -> Invocation:
    """Split ``argv`` into the launcher's options, the training script and the script's args.

    Raises :class:`ConfigError` for an unknown option before the script, a missing value, a value
    of the wrong type, or no script at all.
    """
    tokens = list(argv)
    sagemaker_form = _names_train_script(tokens)
    given: dict[str, object] = {}
    rest: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--" and not sagemaker_form:
            rest.extend(tokens[i + 1:])
            break
        spec, inline = _split_flag(token) if token.startswith("--") else (None, None)
        if spec is None:
            if not sagemaker_form and token.startswith("-"):
                raise ConfigError(f"unknown launcher option {token!r} before the training script "
                                  "(the script's own options go after it)")
            if sagemaker_form:
                rest.append(token)
                i += 1
                continue
            rest.extend(tokens[i:])
            break
        if inline is not None:
            text = inline
        elif spec.is_bool:
            following = tokens[i + 1] if i + 1 < len(tokens) else None
            if following is not None and following.lower() in _TRUE | _FALSE:
                text, i = following, i + 1
            else:
                text = "true"
        else:
            if i + 1 >= len(tokens):
                raise ConfigError(f"option {token} needs a value ({spec.expects})")
            text, i = tokens[i + 1], i + 1
        given[spec.name] = _convert(spec, text, token)
        i += 1

    values: dict[str, object] = {}
    for spec in SPECS:
        if spec.name in given:
            values[spec.name] = given[spec.name]
        elif environ.get(spec.env, "") != "":
            values[spec.name] = _convert(spec, environ[spec.env], spec.env)
        else:
            values[spec.name] = spec.default
    options = Options(**values)

    if options.train_script is not None:
        # --train-script, or LAUNCHER_TRAIN_SCRIPT: every other word belongs to the script.
        script, script_args = options.train_script, tuple(rest)
    elif rest:
        script, script_args = rest[0], tuple(rest[1:])
    else:
        raise ConfigError("no training script: give it as the first argument or as --train-script "
                          "(SageMaker hyperparameter 'train-script')")
    if not script:
        raise ConfigError("invalid value for --train-script: '' (expected a path)")
    return Invocation(options, script, script_args, sagemaker_form)


def option_rows() -> list[tuple[str, str, str]]:
    """``(flag and value, environment variable, meaning)`` per option: the help and README tables."""
    rows = []
    for spec in SPECS:
        flag = spec.flags[0] if spec.is_bool else f"{spec.flags[0]} {spec.metavar}"
        default = f" (default {spec.default:g})" if isinstance(spec.default, (int, float)) and \
            not isinstance(spec.default, bool) else ""
        rows.append((flag, spec.env, spec.help + default))
    return rows


def help_text(manual: str, platforms: Sequence[tuple[str, str]]) -> str:
    """``--help``: the command's manual, then the options and platforms, from the parser's own tables."""
    import textwrap  # only for --help

    def table(rows: Sequence[tuple[str, str]]) -> list[str]:
        width = max(len(left) for left, _ in rows)
        out = []
        for left, right in rows:
            wrapped = textwrap.wrap(right, 100 - width - 4) or [""]
            out.append(f"  {left:<{width}}  {wrapped[0]}")
            out += [" " * (width + 4) + more for more in wrapped[1:]]
        return out

    lines = [manual.strip(), "", "Options (each also LAUNCHER_<NAME> in the environment):", ""]
    lines += table([(flag, meaning) for flag, _, meaning in option_rows()])
    lines += ["", "Platforms, in detection order (the first whose variables or files are present wins):", ""]
    lines += table(list(platforms))
    return "\n".join(lines) + "\n"
