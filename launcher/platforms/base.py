"""The interface every cluster module implements, and the small readers they share.

A platform module defines one subclass of :class:`Platform` and one instance of it, ``PLATFORM``.
Only :meth:`Platform.detect` and :meth:`Platform.resolve` are required; the rest are the few things
that differ between clusters, with defaults for a cluster that offers nothing special.

A platform reads the cluster and nothing else: the environment, and the :class:`HostView` the caller
gives it (device and sysfs directories, the host's name, and how to wait for something the cluster
publishes late). It never sees the launcher's options: ``--nproc-per-node`` and the rest are applied
by :mod:`launcher.command`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple, Optional

from launcher.cluster import MAX_NPROC, Cluster
from launcher.errors import ConfigError, digits_value, shown
from launcher.filereader import MAX_CONFIG_BYTES, read_bounded
from launcher.platforms.devices import count_gpus

#: One look at something the cluster publishes late: ``(value, state)``; ``None``: not there yet, and
#: ``state`` says what is missing.
Attempt = Callable[[], tuple[Optional[Any], str]]

#: Where the kubelet reads a container's termination message (``terminationMessagePath``'s default).
TERMINATION_LOG = "/dev/termination-log"
_ADDRESS = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")
#: No count or index a platform publishes (hosts, node ranks, pods, devices) is larger: a typo or garbage.
#: Only for counts: an identifier (a job id) or a port has its own domain (:func:`whole_number`'s bounds).
MAX_COUNT = 1_000_000
MAX_PORT = 65535


def look_once(attempt: Attempt, what: str, why: str = "not waiting") -> Any:
    """A wait that does not wait: one look, and a :class:`ConfigError` if the value is not there yet."""
    value, state = attempt()
    if value is None:
        raise ConfigError(f"{what}: {state} ({why})")
    return value


class HostView(NamedTuple):
    """What a platform may look at on this host besides the environment; the caller supplies it.

    ``wait(attempt, what)`` calls ``attempt`` until it returns a value and returns that value, or
    raises a one-line :class:`ConfigError` naming ``what``: a dry run looks once, a run waits up to the
    rendezvous timeout (:func:`launcher.cli.host_view`). ``hostname`` empty: the kernel's host name.
    """

    dev_dir: str = "/dev"
    sys_dir: str = "/sys"
    hostname: str = ""
    wait: Callable[[Attempt, str], Any] = look_once

    @property
    def name(self) -> str:
        """This host's name: the given one, else the kernel's (no DNS look-up)."""
        return self.hostname or this_host()


class ArgvPairs(NamedTuple):
    """The launcher's options as a platform's own argv form carries them, and the script's words."""

    options: tuple[tuple[str, str, Optional[str]], ...]  # (option name, key as written, value; None: none given)
    rest: tuple[str, ...]


class Platform:
    """One kind of cluster: how to recognise it and how to read this node's place in it."""

    name: str = ""
    #: One line for ``--help``: what the platform reads.
    reads: str = ""
    #: The default ``--grace-period``: the platform kills the job this long after its stop signal,
    #: so the launcher's own deadline sits a few seconds inside that window.
    grace_period: float = 25.0
    fixed_port: bool = False  # the platform publishes the rendezvous port (a restart reuses it: launcher/restart.py)
    #: How much of the failure report the platform shows (characters); 0: the report goes to stderr only.
    report_limit: int = 0
    #: For ``--help``: how the launcher's options are written in the platform's own argv form ("": none).
    argv_help: str = ""

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        """The variables or files that show this platform (empty: not this platform). Pure."""
        raise NotImplementedError

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        """This node's view of the cluster, with the platform's own process count and the evidence for
        each value. Raises :class:`ConfigError` on bad input."""
        raise NotImplementedError

    def resolve_groups(self, environ: Mapping[str, str], host: HostView, groups: Sequence[str]) -> Cluster:
        """:meth:`resolve` where ``--instance-groups`` names the groups of hosts that train; the other
        hosts run the script once (:class:`~launcher.cluster.Role`). A platform without groups refuses it."""
        raise ConfigError(f"--instance-groups {shown(','.join(groups))}: {self.name} jobs have no instance groups")

    def report_path(self, environ: Mapping[str, str]) -> Optional[str]:
        """Where the platform looks for a failure report (None: stderr only). In a Kubernetes pod
        (``KUBERNETES_SERVICE_HOST`` set), whatever the platform (a JobSet or a Volcano job runs the env
        platform): the container's termination message, ``/dev/termination-log``, when it is writable."""
        if environ.get("KUBERNETES_SERVICE_HOST") and os.access(TERMINATION_LOG, os.W_OK):
            return TERMINATION_LOG
        return None

    def outcome_path(self, environ: Mapping[str, str]) -> Optional[str]:
        """Where the outcome file goes without ``--outcome-file`` (None: nowhere): beside the job's output."""
        return None

    def fabric_env(self, cluster: Cluster, host: HostView) -> dict[str, str]:
        """Network or fabric variables this platform's hosts need (a variable the user set wins)."""
        return {}

    def names_to_wait_for(self, cluster: Cluster) -> tuple[str, ...]:
        """Host names torchrun will need (several nodes: the master, this node's own address), which
        may resolve only after the job started: the launcher waits for them (bounded, see
        :func:`launcher.preflight.wait_for_names`) before it starts torchrun. One node needs none."""
        if cluster.nnodes < 2:
            return ()
        names = (cluster.master_addr, cluster.local_addr)
        return tuple(dict.fromkeys(n for n in names if n and not is_address(n)))

    def read_argv(self, argv: Sequence[str], names: Sequence[str]) -> Optional[ArgvPairs]:
        """The launcher's options (``names``) in this platform's own argv form; None: ``argv`` is not in
        it. A platform whose jobs cannot carry the launcher's flags as written (SageMaker renders
        hyperparameters) defines one; it is recognised on any platform, from the argv alone."""
        return None

    def prepare_argv(self, argv: Sequence[str], environ: Mapping[str, str], notes: list[str]) -> list[str]:
        """The launcher's argv as the platform meant it (a platform may repair what it damaged)."""
        return list(argv)


def is_address(text: str) -> bool:
    """True for an IPv4 or IPv6 address (nothing to resolve), False for a host name."""
    return bool(_ADDRESS.match(text)) or ":" in text


def read_json(path: str) -> Any:
    """Load a JSON file; unreadable, not a regular file, too large, empty, not UTF-8 or malformed is a
    :class:`ConfigError` naming it (read by :func:`launcher.filereader.read_bounded`: never blocks)."""
    data = read_bounded(path, MAX_CONFIG_BYTES, "") or b""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{shown(path)} is not UTF-8 text: byte {data[exc.start]:#04x} at offset {exc.start}") \
            from None
    if not text.strip():
        raise ConfigError(f"{shown(path)} is empty (expected JSON)")
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigError(f"malformed JSON in {shown(path)}: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and an integer of more digits than Python converts
        raise ConfigError(f"malformed JSON in {shown(path)}: {exc}") from None


def parse_json(text: str, name: str, expects: str) -> Any:
    """A variable's JSON value; malformed is a :class:`ConfigError` naming the variable."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigError(f"{name} is not {expects}: nested too deeply") from None
    except ValueError:
        raise ConfigError(f"{name} is not {expects}: {shown(text)}") from None


def whole_number(environ: Mapping[str, str], name: str, minimum: int = 0,
                 maximum: int = MAX_COUNT, rule: str = "") -> Optional[int]:
    """A variable holding a whole number (None when unset or empty); anything else is a ConfigError.

    The default bound is for counts and indices (:data:`MAX_COUNT`); an identifier or a port passes its
    own domain as ``minimum``/``maximum``, and ``rule`` (e.g. ``"SLURM job ids are unsigned 32-bit"``)
    says in the error where that domain comes from.
    """
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name} is not a whole number: {shown(environ[name])}") from None
    if not minimum <= value <= maximum:
        bound = f">= {minimum}" if value < minimum and maximum == MAX_COUNT else f"{minimum}-{maximum}"
        raise ConfigError(f"{name} must be {bound}{f' ({rule})' if rule else ''}: {shown(environ[name])}")
    return value


def port_number(environ: Mapping[str, str], name: str) -> Optional[int]:
    """A variable holding a TCP port, 1-65535 (None when unset or empty)."""
    return whole_number(environ, name, minimum=1, maximum=MAX_PORT, rule="a TCP port")


def node_rank_in(nnodes: int, rank: Optional[int], rank_name: str, count_name: str) -> int:
    """Check a node rank against the node count; both must be known."""
    if rank is None:
        raise ConfigError(f"{rank_name} is not set (needed with {count_name}={nnodes})")
    if not 0 <= rank < nnodes:
        raise ConfigError(f"{rank_name}={rank} is not a node of {count_name}={nnodes} (0-{nnodes - 1})")
    return rank


def nproc_per_node(host: HostView, evidence: list[str],
                   platform_counts: Sequence[tuple[str, Optional[int]]] = ()) -> int:
    """Processes per node: the platform's first non-zero count, else the GPUs, else 1.

    ``platform_counts`` are ``(variable, value)`` pairs the platform publishes (e.g. SageMaker's
    ``SM_NUM_GPUS``); a zero counts as absent (SageMaker writes 0 on CPU instances).
    """
    dev_dir = host.dev_dir
    for name, value in platform_counts:
        if value is not None and value > MAX_NPROC:
            raise ConfigError(f"{name}={value} is more processes per node than {MAX_NPROC}: not a device count")
        if value:
            evidence.append(f"{name}={value}")
            return value
        if value == 0:
            evidence.append(f"{name}=0")
    gpus = count_gpus(dev_dir)
    if gpus:
        evidence.append(f"{gpus} GPU device(s) in {dev_dir}")
        return gpus
    evidence.append("no GPU device: 1 process (CPU, gloo)")
    return 1


def torchrun_nproc(word: str, name: str, host: HostView, evidence: list[str]) -> int:
    """Processes per node from a value in torchrun's ``--nproc-per-node`` language.

    A whole number, or torchrun's words (``torch/distributed/run.py`` ``determine_local_world_size``):
    ``gpu`` = the GPUs (none is an error), ``cpu`` = the usable CPUs, ``auto`` = the GPUs, else the CPUs.
    """
    dev_dir = host.dev_dir
    text = word.strip().lower()
    if text.isdigit():
        value = digits_value(text)
        if value is None or not 1 <= value <= MAX_NPROC:
            raise ConfigError(f"{name} must be 1-{MAX_NPROC}, auto, gpu or cpu: {shown(word)}")
        evidence.append(f"{name}={value}")
        return value
    if text not in ("auto", "gpu", "cpu"):
        raise ConfigError(f"{name} is not a whole number, auto, gpu or cpu: {shown(word)}")
    gpus = count_gpus(dev_dir) if text != "cpu" else 0
    if gpus:
        evidence.append(f"{name}={text}: {gpus} GPU device(s) in {dev_dir}")
        return gpus
    if text == "gpu":
        raise ConfigError(f"{name}=gpu but this host has no GPU device in {dev_dir}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    evidence.append(f"{name}={text}: {cpus} usable CPU(s) (torchrun's meaning of {text!r} without a GPU)")
    return cpus


def node_count(environ: Mapping[str, str], name: str) -> Optional[int]:
    """A node count: a whole number >= 1, or an elastic range ``MIN:MAX`` whose ends are equal."""
    text = environ.get(name, "").strip()
    if ":" not in text:
        return whole_number(environ, name, minimum=1)
    low, high = (digits_value(part) for part in text.partition(":")[::2])
    if low is None or high is None or high > MAX_COUNT:
        raise ConfigError(f"{name} is not a node count or MIN:MAX: {shown(environ[name])}")
    if low != high or low < 1:
        raise ConfigError(f"{name}={text} is an elastic range: the launcher's static rendezvous needs a "
                          "fixed node count (set min and max replicas equal)")
    return low


def first_set(environ: Mapping[str, str], names: Sequence[str]) -> Optional[str]:
    """The first of ``names`` that is set and not empty; another one set to a different value is an error."""
    chosen = None
    for name in names:
        value = environ.get(name, "").strip()
        if not value:
            continue
        if chosen is None:
            chosen = name
        elif value != environ[chosen].strip():
            raise ConfigError(f"{chosen}={shown(environ[chosen])} and {name}={shown(environ[name])} disagree")
    return chosen


def host_and_port(address: str, source: str) -> tuple[str, int]:
    """``host:port`` -> its parts; anything else is a :class:`ConfigError` naming ``source``."""
    host, sep, port = address.strip().rpartition(":")
    number = digits_value(port, 5)
    if not sep or not host or number is None or not 1 <= number <= MAX_PORT:
        raise ConfigError(f"{source}: not HOST:PORT (port 1-{MAX_PORT}): {shown(address)}")
    return host, number


def this_host() -> str:
    """This machine's host name, as the kernel has it (no DNS look-up)."""
    return os.uname().nodename
