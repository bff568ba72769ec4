"""simulate's command line: its options, the checks of bad input (exit 2), and the resulting neutral job
description (:class:`~launcher.simulate.job.Config`). It names no platform: each builder of
:mod:`launcher.simulate.hosts` declares and checks its own options (``add_options``, ``check_options``:
the builder protocol in that package's docstring) and gives its own
:class:`~launcher.simulate.job.PlatformOptions`, as TorchX's schedulers declare their ``run_opts``.

Nothing here writes or starts anything: :func:`build_config` parses and checks, or raises
:class:`~launcher.errors.ConfigError`.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import time
from collections.abc import Sequence
from types import ModuleType

from launcher.command import torch_missing
from launcher.errors import ConfigError, shown
from launcher.simulate.hosts import BUILDERS, DEFAULT, builder
from launcher.simulate.job import (
    DEFAULT_DEADLINE,
    MAX_HOSTS,
    NETWORK_FAULTS,
    TRANSIENT_FAULTS,
    Config,
    Fault,
    PlatformOptions,
    plain_script,
)

PROG = "ddp-launcher simulate"
DEFAULT_GRACE_PERIOD = 5.0
NETWORKS = ("netns", "loopback")
NETNS_FAULTS = ("partition", "blip")  # they take a host's link down: only a host of its own has one
MAX_FAULT_SECONDS = 86400.0
JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
# An option of one builder given with another --platform (a builder's WRONG_PLATFORM says it otherwise).
WRONG_PLATFORM = "{option} needs --platform {name}, not {platform!r}"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is a one-line :class:`ConfigError` (exit 2, nothing started).

    ``owners``: ``--option`` -> the platform whose builder declared it (an option every platform has: none)."""

    owners: dict[str, str]

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def builders() -> dict[str, ModuleType]:
    """Every platform's builder module, by ``--platform`` name."""
    return {name: builder(name) for name in BUILDERS}


def _epilog(found: dict[str, ModuleType]) -> str:
    """The words after ``--``, and each platform's hosts (its builder's ``HOSTS_HELP``, else the first line of
    its docstring)."""
    words = "".join(f"  ({b.SCRIPT_WORDS})" for b in found.values() if hasattr(b, "SCRIPT_WORDS"))
    lines = [f"then: -- script.py args...{words}", "",
             "platforms (each host gets what the platform gives a real node; the manual: "
             "launcher/simulate/__init__.py):"]
    for name, module in found.items():
        text = getattr(module, "HOSTS_HELP", None) or (module.__doc__ or "").strip().split("\n")[0]
        first, *rest = text.splitlines() or [""]
        lines += [f"  {name:<12} {first}", *(" " * 15 + line for line in rest)]
    return "\n".join(lines)


def build_parser() -> _Parser:
    """simulate's options, each builder's own in a group of its own (the script comes after ``--``)."""
    found = builders()
    p = _Parser(prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Run N hosts of a cluster platform as N launcher processes on this machine.",
                epilog=_epilog(found))
    instead = " or ".join(b.HOSTS_OPTION for b in found.values() if hasattr(b, "HOSTS_OPTION"))
    p.add_argument("--platform", choices=list(BUILDERS), default=DEFAULT,
                   help=f"the platform the hosts are given the variables and files of (default {DEFAULT})")
    p.add_argument("--hosts", type=int, default=None,
                   help=f"number of hosts, 1-{MAX_HOSTS} (required unless {instead} gives them)" if instead
                   else f"number of hosts, 1-{MAX_HOSTS} (required)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per host (the platform's own field where it has one, else "
                        "LAUNCHER_NPROC_PER_NODE; default: the platform's or the launcher's, 1 on CPU)")
    p.add_argument("--workdir", default=None, help="where the hosts' trees go (default ./runs/JOB)")
    p.add_argument("--job-name", default=None,
                   help="the job's name, in its host names and the platform's job variables (default "
                        "simulate-<time>)")
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
                        f"the default platform's own maximum run time)")
    p.owners = {}
    for name, module in found.items():
        if hasattr(module, "add_options"):
            known = set(vars(p.parse_args([])))
            module.add_options(p)
            p.owners.update({dest: name for dest in vars(p.parse_args([])) if dest not in known})
    return p


def split_at_dashes(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """simulate's own options, and the words after the first ``--``."""
    words = list(argv)
    if "--" in words:
        i = words.index("--")
        return words[:i], words[i + 1:]
    return words, []


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


def default_job_name() -> str:
    """``simulate-2024-05-01-12-00-00-123``, as the SDK names jobs from a base name."""
    now = time.time()
    return f"simulate-{time.strftime('%Y-%m-%d-%H-%M-%S', time.localtime(now))}-{int(now * 1000) % 1000:03d}"


def _check_counts(args: argparse.Namespace) -> None:
    if not 1 <= args.hosts <= MAX_HOSTS:
        raise ConfigError(f"--hosts must be 1-{MAX_HOSTS}: {args.hosts}")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1: {args.nproc_per_node}")
    if not args.grace_period > 0:
        raise ConfigError(f"--grace-period must be > 0 seconds: {args.grace_period:g}")
    if not 0 < args.deadline < float("inf"):
        raise ConfigError(f"--deadline must be > 0 seconds: {args.deadline:g}")


def _refuse_other_platforms(parser: _Parser, args: argparse.Namespace) -> None:
    """An option that another platform's builder declared, given: refused in that builder's words."""
    for dest, owner in parser.owners.items():
        if owner != args.platform and getattr(args, dest) not in (None, False, []):
            template = getattr(builder(owner), "WRONG_PLATFORM", WRONG_PLATFORM)
            option = "--" + dest.replace("_", "-")
            raise ConfigError(template.format(option=option, name=owner, platform=args.platform))


def _host_count(args: argparse.Namespace, chosen: ModuleType) -> int:
    """``--hosts``, or the number the platform's own option gives (its builder's ``count_hosts``)."""
    given = chosen.count_hosts(args) if hasattr(chosen, "count_hosts") else None
    if given is not None:
        return given
    if args.hosts is None:
        instead = "".join(f" (or {b.HOSTS_OPTION})" for b in builders().values() if hasattr(b, "HOSTS_OPTION"))
        raise ConfigError(f"the following arguments are required: --hosts{instead}")
    return args.hosts


def _workdir(args: argparse.Namespace, job_name: str, cwd: str) -> str:
    path = os.path.abspath(os.path.join(cwd, args.workdir or os.path.join("runs", job_name)))
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConfigError(f"work directory exists and is not empty: {path!r} "
                          "(give another --workdir or --job-name)")
    return path


def build_config(argv: Sequence[str], cwd: str) -> Config:
    """Parse and check everything; raises :class:`ConfigError`. Writes and starts nothing.

    The chosen platform's builder checks its own options last (``check_options``: the script, its
    arguments and the builder's :class:`PlatformOptions`); without one, the words after ``--`` are
    ``script.py args...``."""
    own, script_words = split_at_dashes(argv)
    parser = build_parser()
    args = parser.parse_args(own)
    _refuse_other_platforms(parser, args)
    chosen = builder(args.platform)
    args.hosts = _host_count(args, chosen)
    _check_counts(args)
    job_name = args.job_name or default_job_name()
    if not JOB_NAME.match(job_name):
        raise ConfigError(f"--job-name must be 1-63 letters, digits and hyphens: {job_name!r}")
    hosts = chosen.host_names(job_name, args.hosts)
    faults = tuple(parse_fault(text, hosts) for text in args.fault)
    partition = next((f for f in faults if f.kind in NETNS_FAULTS), None)
    if partition is not None and args.network == "loopback":
        raise ConfigError(f"--fault {partition.host}:{partition.kind} needs --network netns (every host is "
                          "127.0.0.1 with --network loopback)")
    if hasattr(chosen, "check_options"):
        script, script_args, options = chosen.check_options(args, hosts, job_name, script_words, cwd)
    else:
        (script, script_args), options = plain_script(script_words, cwd), PlatformOptions()
    missing = torch_missing()  # every host's launcher would refuse: said once, before any host starts
    if missing:
        raise ConfigError(missing)
    return Config(args.platform, hosts, args.nproc_per_node, _workdir(args, job_name, cwd), job_name, script,
                  faults, args.grace_period, script_args, network=args.network,
                  platform_stop=args.platform_stop == "on", deadline=args.deadline, options=options)
