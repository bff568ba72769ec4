"""The launcher's own options, and how they are told apart from the training script's arguments.

Every option can be given three ways, the first one found wins:

1. on the command line (see the two forms below);
2. in the environment, as ``LAUNCHER_GRACE_PERIOD=30`` (set in the job's own environment);
3. its default.

Two command-line forms exist:

- The plain form, ``ddp-launcher [options] train.py [script args...]``: the launcher's options come
  first, as ``--grace-period 30``, ``--grace_period 30`` or ``--grace-period=30``; the first other
  word is the training script, and everything after it belongs to the script untouched. ``--`` ends
  the options (``ddp-launcher -- train.py``). Boolean options take an optional
  ``True/False/true/false/1/0`` after them.
- A platform's own form, for a platform whose jobs cannot pass the launcher's flags as written: a
  platform module recognises it from the argv alone and reads out the launcher's options by name
  (:meth:`launcher.platforms.base.Platform.read_argv`); this module converts and checks their values
  as it does the plain form's. A boolean without a value is ``true``; any other option needs one.

Counts have sane bounds (a value outside them is a typo, not a plan): at most ``MAX_NPROC``
processes per host, grace period and rendezvous timeout at most a day, at most ``MAX_RESTARTS``
restarts. The script may not start with ``-``: torchrun would read it as one of its own options.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Callable, NamedTuple, Optional

from launcher import platforms
from launcher.cluster import MAX_NPROC
from launcher.errors import ConfigError, shown
from launcher.hangtimeout import CEILING_CPU, CEILING_GPU, FLOOR, MULTIPLE, START
from launcher.platforms.base import ArgvPairs

ENV_PREFIX = "LAUNCHER_"
MAX_SECONDS = 86400  # a day: the longest grace period or rendezvous timeout that is not a typo
MAX_RESTARTS = 100
# The failure classes a restart may help (launcher/codes.py; out_of_memory: a worker the OOM killer ended),
# and those restarted by default. A lost host, a stop signal, bad input and the launcher's error never are.
RESTARTABLE = ("worker_exit", "worker_signal", "out_of_memory", "hang", "rendezvous")
DEFAULT_RESTART_ON = ("worker_exit", "worker_signal", "out_of_memory", "hang")
MIN_LOSS_TIMEOUT = 1.5  # heartbeats come every second (every third of the timeout below 3 s)
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def _whole_number(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError
        return value
    return parse


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_SECONDS:  # also refuses nan and inf
        raise ValueError
    return value


def _seconds_or_off(text: str) -> float:
    value = float(text)
    if not 0 <= value <= MAX_SECONDS:  # 0 turns it off; also refuses nan and inf
        raise ValueError
    return value


def _loss_timeout(text: str) -> float:
    value = _seconds(text)
    if value < MIN_LOSS_TIMEOUT:  # heartbeats come every second: less would lose healthy hosts
        raise ValueError
    return value


def parse_bool(text: str) -> bool:
    """``True/False/true/false/1/0/yes/no`` as platforms and people write them."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError


def _path(text: str) -> str:
    if not text or "\0" in text:
        raise ValueError
    return text


def parse_resolve(text: str) -> dict[str, str]:
    """``algo-1=127.0.0.1,algo-2=127.0.0.1`` -> a host-name-to-address map."""
    mapping: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, sep, addr = item.partition("=")
        if not sep or not host.strip() or not addr.strip():
            raise ValueError
        mapping[host.strip()] = addr.strip()
    return mapping


def parse_names(text: str) -> tuple[str, ...]:
    """Names as a list: ``a,b``, or a JSON or Python list (or tuple) of text (AWS renders a list
    hyperparameter with Python's ``str()``: ``['a', 'b']``). Raises ValueError when empty, not text, or repeated."""
    text = text.strip()
    if text.startswith(("[", "(")):
        import ast
        import json

        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            try:
                value = ast.literal_eval(text)  # Python's str() of a list or a tuple
            except (ValueError, SyntaxError, RecursionError, MemoryError):
                raise ValueError(text) from None
    else:
        value = [part.strip() for part in text.split(",")]
    value = list(value) if isinstance(value, tuple) else value
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value) \
            or len(set(value)) != len(value):
        raise ValueError(text)
    return tuple(v.strip() for v in value)


def parse_classes(text: str) -> tuple[str, ...]:
    """``--restart-on``: names of :data:`RESTARTABLE` classes (:func:`parse_names`); ValueError otherwise."""
    names = parse_names(text)
    if any(name not in RESTARTABLE for name in names):
        raise ValueError(text)
    return names


class Spec(NamedTuple):
    """One launcher option: its name, how its text becomes a value, and what it means."""

    name: str
    parse: Callable[[str], object]
    default: object
    expects: str
    help: str
    metavar: str = ""
    aliases: tuple[str, ...] = ()  # older names, still accepted on the command line and in the environment

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(flag for name in (self.name, *self.aliases)
                     for flag in ("--" + name.replace("_", "-"), "--" + name))

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def envs(self) -> tuple[str, ...]:
        """The variable, then its aliases' (the first set wins)."""
        return tuple(ENV_PREFIX + name.upper() for name in (self.name, *self.aliases))

    @property
    def is_bool(self) -> bool:
        return self.parse is parse_bool


SPECS: tuple[Spec, ...] = (
    Spec("train_script", str, None, "a path",
         "the training script (instead of the first word; a platform's own form names it so)", metavar="PATH"),
    Spec("platform", str, None, "a platform name", "skip detection: the cluster type to read (see below)",
         metavar="NAME"),
    Spec("nproc_per_node", _whole_number(1, MAX_NPROC), None, f"a whole number 1-{MAX_NPROC}",
         "processes per host; default the platform's count (see the platforms), else one per GPU found, "
         "else 1", metavar="N"),
    Spec("master_port", _whole_number(1, 65535), None, "a port 1-65535",
         "port of the rendezvous on the first host; default the platform's (see the platforms), else 29500",
         metavar="PORT"),
    Spec("instance_groups", parse_names, None, "group names: a,b or a list",
         "the groups of hosts that train, in a job whose hosts form groups (see the platforms); the "
         "others run the script once, without torchrun; default the platform's choice, else every group",
         metavar="NAME,..."),
    Spec("rdzv_timeout", _whole_number(1, MAX_SECONDS), 900, f"whole seconds 1-{MAX_SECONDS}",
         "how long hosts wait for each other at the start", metavar="SECONDS"),
    Spec("max_restarts", _whole_number(0, MAX_RESTARTS), 0, f"a whole number 0-{MAX_RESTARTS}",
         "job-wide restarts in place: a failure on any host restarts every host's workers from their "
         "checkpoint, N times in all (docs/recovery.md); 0: a failure ends the job", metavar="N"),
    Spec("restart_on", parse_classes, DEFAULT_RESTART_ON, f"class names of {','.join(RESTARTABLE)}",
         "with --max-restarts: the failure classes that are restarted (of "
         f"{', '.join(RESTARTABLE)}); a lost host, a stop signal, bad input and the launcher's own "
         "error never are", metavar="CLASS,..."),
    Spec("grace_period", _seconds, None, f"seconds > 0, at most {MAX_SECONDS}",
         "after a stop signal, how long workers may take before the whole tree is killed; default "
         "the platform's, inside its own kill window (see the platforms)",
         metavar="SECONDS"),
    Spec("watch_port", _whole_number(1, 65535), None, "a port 1-65535",
         "port of the job watch on the first host (the launchers' heartbeats; a failed or lost host "
         "stops the job everywhere); default the first free of 4 ports in 61000-65499 derived from the job",
         metavar="PORT"),
    Spec("loss_timeout", _loss_timeout, 30, f"seconds {MIN_LOSS_TIMEOUT:g}-{MAX_SECONDS}",
         "the job watch: a host not heard from for this long is lost (silence makes it suspect first; "
         "alias --heartbeat-timeout)", metavar="SECONDS", aliases=("heartbeat_timeout",)),
    Spec("job_secret_file", str, None, "a path",
         "a file holding the job's shared secret: the job watch's messages are authenticated (HMAC); "
         "default the LAUNCHER_JOB_SECRET variable, else none", metavar="PATH"),
    Spec("no_job_watch", parse_bool, False, "true or false", "turn the job watch off"),
    Spec("hang_timeout", _seconds_or_off, None, f"seconds 0-{MAX_SECONDS} (0: off)",
         "a job in which no rank's training loop progressed (a beat, its main thread moving; lines only from "
         "a rank with neither) for this long is hung: every rank's Python stacks are taken, the rank that "
         f"stands out is named, the job ends with exit code 124; 0 turns it off; default learned from the job: "
         f"{MULTIPLE:g} x the longest gap between its steps, at least {FLOOR:g} s, at most {CEILING_GPU:g} s on "
         f"hosts with GPUs (before NCCL's 600 s) and {CEILING_CPU:g} s without", metavar="SECONDS"),
    Spec("hang_start_timeout", _seconds, START, f"seconds 0-{MAX_SECONDS} (above 0)",
         "the hang timeout from the workers' start until their first step (imports, checkpoint load, "
         "compilation; learned timeout: until its warm-up ends); at least --hang-timeout", metavar="SECONDS"),
    Spec("resolve", parse_resolve, {}, "HOST=ADDR[,HOST=ADDR...]",
         "addresses for host names this machine cannot resolve (simulated hosts; /etc/hosts is never "
         "touched)", metavar="HOST=ADDR,..."),
    Spec("outcome_file", _path, None, "a path",
         "write the run's outcome as JSON (class, exit code, root cause, durations) to this file at the end "
         "of every run; default the platform's place (SageMaker: output/data/outcome.json), else none",
         metavar="PATH"),
    Spec("dry_run", parse_bool, False, "true or false", "print what would be launched and exit"),
    Spec("json", parse_bool, False, "true or false", "with --dry-run: print it as JSON"),
)
_BY_FLAG = {flag: spec for spec in SPECS for flag in spec.flags}
_BY_NAME = {spec.name: spec for spec in SPECS}


class Options(NamedTuple):
    """The launcher's options after parsing (see :data:`SPECS` for their meaning)."""

    train_script: Optional[str]
    platform: Optional[str]
    nproc_per_node: Optional[int]
    master_port: Optional[int]
    instance_groups: Optional[tuple]
    rdzv_timeout: int
    max_restarts: int
    restart_on: tuple
    grace_period: Optional[float]
    watch_port: Optional[int]
    loss_timeout: float
    job_secret_file: Optional[str]
    no_job_watch: bool
    hang_timeout: Optional[float]
    hang_start_timeout: float
    resolve: dict
    outcome_file: Optional[str]
    dry_run: bool
    json: bool


class Invocation(NamedTuple):
    """The parsed command line: the launcher's options, the script and the script's arguments."""

    options: Options
    script: str
    script_args: tuple[str, ...]


def _convert(spec: Spec, text: str, source: str) -> object:
    try:
        return spec.parse(text)
    except ValueError:
        raise ConfigError(f"invalid value for {source}: {shown(text)} (expected {spec.expects})") from None


def _split_flag(token: str) -> tuple[Optional[Spec], Optional[str]]:
    name, sep, inline = token.partition("=")
    spec = _BY_FLAG.get(name)
    return spec, (inline if sep else None)


def _from_pairs(pairs: ArgvPairs) -> tuple[dict[str, object], list[str]]:
    """A platform's own form: the options it read out converted (a boolean without a value is true)."""
    given: dict[str, object] = {}
    for name, key, text in pairs.options:
        spec = _BY_NAME[name]
        if text is None and not spec.is_bool:
            raise ConfigError(f"hyperparameter {key} needs a value ({spec.expects})")
        given[name] = _convert(spec, "true" if text is None else text, key)
    return given, list(pairs.rest)


def _parse_plain(tokens: Sequence[str]) -> tuple[dict[str, object], list[str]]:
    """The plain form: options first, then the script and its arguments (``--`` ends the options)."""
    given: dict[str, object] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return given, list(tokens[i + 1:])
        spec, inline = _split_flag(token) if token.startswith("--") else (None, None)
        if spec is None:
            if token.startswith("-"):
                raise ConfigError(f"unknown launcher option {shown(token)} before the training script "
                                  "(the script's own options go after it)")
            return given, list(tokens[i:])
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
        given[spec.name] = _convert(spec, text, token.partition("=")[0])
        i += 1
    return given, []


def parse_invocation(argv: Sequence[str], environ: Mapping[str, str]) -> Invocation:
    """Split ``argv`` into the launcher's options, the training script and the script's args.

    Raises :class:`ConfigError` for an unknown option before the script (plain form) or one a
    platform's own form rejects, a missing value, a value of the wrong type or out of bounds,
    or no usable script.
    """
    tokens = list(argv)
    pairs = platforms.read_argv(tokens, [spec.name for spec in SPECS])
    given, rest = _from_pairs(pairs) if pairs is not None else _parse_plain(tokens)

    values: dict[str, object] = {}
    for spec in SPECS:
        if spec.name in given:
            values[spec.name] = given[spec.name]
        elif any(environ.get(env, "") != "" for env in spec.envs):
            env = next(env for env in spec.envs if environ.get(env, "") != "")
            values[spec.name] = _convert(spec, environ[env], env)
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
                          "(hyperparameter 'train-script')")
    if not script:
        raise ConfigError("invalid value for --train-script: '' (expected a path)")
    if script.startswith("-"):
        raise ConfigError(f"the training script cannot start with '-': {shown(script)} (torchrun would "
                          "take it for one of its own options; write ./ before the name)")
    return Invocation(options, script, script_args)


def option_rows() -> list[tuple[str, str, str]]:
    """``(flag and value, environment variable, meaning)`` per option: the help and docs/options.md tables."""
    rows = []
    for spec in SPECS:
        flag = spec.flags[0] if spec.is_bool else f"{spec.flags[0]} {spec.metavar}"
        default = f" (default {spec.default:g})" if isinstance(spec.default, (int, float)) and \
            not isinstance(spec.default, bool) else ""
        rows.append((flag, spec.env, spec.help + default))
    return rows


def help_text(manual: str, rows: Sequence[tuple[str, str]], forms: Sequence[str] = ()) -> str:
    """``--help``: the command's manual, the options, each platform's own argv form (``forms``) and the
    platforms (``rows``: name and what it reads), from the parser's and the platforms' own tables."""
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
    for form in forms:
        lines += ["", *textwrap.wrap(form, 100)]
    lines += ["", "Platforms, in detection order (the first whose variables or files are present wins):", ""]
    lines += table(list(rows))
    return "\n".join(lines) + "\n"
