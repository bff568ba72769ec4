"""A :class:`Cluster` and the options become the exact torchrun command: a value, printable first.

Several nodes use torchrun's static rendezvous (``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``), the only one where ``--node-rank`` decides placement, so global rank 0 is always
on the first host. One node uses ``--standalone`` (a free port, no master needed).

Every input torchrun takes is passed as a flag, and inherited ``PET_*``/``TORCHELASTIC_*`` variables
(torchrun reads ``PET_<FLAG>`` for any flag not given) are removed from its environment, so nothing
changes what torchrun does behind the dry run's back.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Optional

from launcher.cluster import Cluster, bad_host
from launcher.errors import ConfigError, shown
from launcher.filereader import read_bounded
from launcher.options import Options
from launcher.platforms.base import HostView, Platform

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap.py")
EXIT_DIR_VARIABLE = "DDP_LAUNCHER_EXIT_DIR"  # as launcher/bootstrap.py reads it
DEFAULT_MASTER_PORT = 29500  # torchrun's own default
INHERITED_PREFIXES = ("PET_", "TORCHELASTIC_")
WATCH_BASE, WATCH_SPAN, WATCH_STRIDE, WATCH_CANDIDATES = 61000, 4500, 1129, 4  # the job watch's ports
GENERATION_VARIABLE = "DDP_LAUNCHER_GENERATION"  # the restart count, as launcher/bootstrap.py reads it
SECRET_VARIABLE = "LAUNCHER_JOB_SECRET"  # the job watch's shared secret (see watch_secret)


class Launch(NamedTuple):
    """What would be started: argv, the environment changes, and where torchrun leaves its files."""

    argv: tuple[str, ...]
    env_changes: Mapping[str, str]
    env_removed: tuple[str, ...]
    run_dir: str
    error_file: str
    log_dir: str
    notes: tuple[str, ...] = ()
    nproc_per_node: int = 1  # torchrun's workers on this host: two log files each
    first_rank: int = 0  # this host's first global rank, with as many workers on every host

    @property
    def exit_dir(self) -> str:
        """Where :mod:`launcher.bootstrap` records the code each worker asked for (``<pid>.json``)."""
        return os.path.join(self.run_dir, "exits")

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with the changes applied: the environment torchrun gets."""
        env = {k: v for k, v in base.items() if k not in self.env_removed}
        env.update(self.env_changes)
        return env


def cluster_for(platform: Platform, environ: Mapping[str, str], host: HostView, options: Options) -> Cluster:
    """The cluster this launch uses: the platform's reading, then the options that override it.

    The one place where options and platform facts meet: ``--instance-groups`` tells the platform
    which groups train; ``--nproc-per-node`` replaces the platform's process count (the evidence keeps
    what the platform said). Every host name the platform read must be a host name or an IP address
    (:func:`launcher.cluster.is_host_name`).
    """
    groups = options.instance_groups
    cluster = platform.resolve(environ, host) if groups is None else platform.resolve_groups(environ, host, groups)
    bad = bad_host(cluster)
    if bad is not None:  # a platform's own check names its variable; this one holds for every platform
        role, name = bad
        holders = sorted(environ, key=lambda k: environ[k] != name)  # the variable holding exactly it first
        source = next((k for k in holders if name in environ[k]), None)
        where = source or (f"{platform.name}: {shown(cluster.evidence[0], 120)}" if cluster.evidence else platform.name)
        raise ConfigError(f"{where}: the {role} {shown(name)} is not a host name or IP address")
    nproc = options.nproc_per_node
    if nproc is None:
        return cluster
    evidence = (*cluster.evidence, f"--nproc-per-node {nproc} (instead of the platform's {cluster.nproc_per_node})")
    return cluster._replace(nproc_per_node=nproc, evidence=evidence)


def address_of(host: str, resolve: Mapping[str, str]) -> str:
    """The address to use for a host name: the ``--resolve`` map's, else the name itself."""
    return resolve.get(host, host)


def _setdefault(changes: dict[str, str], environ: Mapping[str, str], name: str, value: str,
                notes: list[str]) -> None:
    """Set ``name`` unless the user already did: a variable the user set always wins."""
    if name in environ:
        if environ[name] != value:
            notes.append(f"kept {name}={environ[name]} (set by the user) instead of {value}")
    else:
        changes[name] = value


def master_port(cluster: Cluster, options: Options) -> int:
    """The rendezvous port: the option, else the platform's, else torchrun's default."""
    return options.master_port or cluster.master_port or DEFAULT_MASTER_PORT


def generation_port(cluster: Cluster, options: Options, fixed: bool, generation: int) -> int:
    """The rendezvous port of a generation (0: the first start, N: the Nth restart).

    A port the user or the platform fixed (``--master-port``; ``fixed``: the platform publishes it, e.g.
    Kubeflow's ``MASTER_PORT`` behind a Service) is reused: every host confirmed its old torchrun gone,
    so the old store is closed, before any host starts the next generation. Otherwise each generation
    takes the next port (wrapping inside 1024-65535), so that nothing of an old store can be met.
    """
    port = master_port(cluster, options)
    if fixed or options.master_port is not None or generation == 0:
        return port
    return 1024 + (port - 1024 + generation) % (65536 - 1024)


def for_generation(launch: Launch, port: int, generation: int) -> Launch:
    """``launch`` for a generation: its rendezvous port, the generation in the workers' environment, and after
    the first a log directory of its own (``logs-g<N>``: the next generation's torchrun may start before the
    last one's logs are read, :mod:`launcher.ahead`)."""
    argv = list(launch.argv)
    own = argv[:argv.index("--")] if "--" in argv else argv  # torchrun's flags, never the script's arguments
    if "--master-port" in own:
        argv[own.index("--master-port") + 1] = str(port)
    log_dir = launch.log_dir if generation == 0 else os.path.join(launch.run_dir, f"logs-g{generation}")
    if "--log-dir" in own:
        argv[own.index("--log-dir") + 1] = log_dir
    return launch._replace(argv=tuple(argv), env_changes={**launch.env_changes, GENERATION_VARIABLE: str(generation)},
                           log_dir=log_dir)


def job_identity(job_name: str, master: str, port: int, nnodes: int) -> str:
    """The job's identity for the job watch, from what every host of it knows (the platform's job name,
    the rendezvous endpoint, the node count): 16 hex digits."""
    return hashlib.sha256(f"{job_name}\n{master}:{port}\n{nnodes}".encode()).hexdigest()[:16]


def watch_ports(cluster: Cluster, options: Options, job: str) -> tuple[int, ...]:
    """The job watch's candidate ports (:mod:`launcher.jobwatch`), in order: ``--watch-port``, else
    :data:`WATCH_CANDIDATES` ports in 61000-65499 derived from the job's identity ``job`` (hex): above
    Linux's ephemeral ports and far from every platform's rendezvous ports, never a neighbour's.

    Raises :class:`ConfigError` when ``--watch-port`` is the rendezvous port.
    """
    if options.watch_port is not None:
        if options.watch_port == master_port(cluster, options):
            raise ConfigError(f"--watch-port {options.watch_port} is the rendezvous port (--master-port): "
                              "the job watch would take torchrun's port; choose another")
        return (options.watch_port,)
    start = int(job, 16)
    return tuple(WATCH_BASE + (start + k * WATCH_STRIDE) % WATCH_SPAN for k in range(WATCH_CANDIDATES))


def watch_secret(options: Options, environ: Mapping[str, str]) -> Optional[bytes]:
    """The job watch's shared secret: ``--job-secret-file``'s content, else ``LAUNCHER_JOB_SECRET``,
    else None. Raises :class:`ConfigError` for a file that cannot be read or is empty."""
    path = options.job_secret_file
    if path:
        secret = (read_bounded(path, 65536, "--job-secret-file") or b"").strip()  # a FIFO never blocks
        if not secret:
            raise ConfigError(f"--job-secret-file {shown(path)} is empty")
        return secret
    text = environ.get(SECRET_VARIABLE, "")
    return text.encode() if text else None


def torch_missing() -> Optional[str]:
    """Why this Python cannot run torchrun (torch is not importable here), or None. torch is looked up
    (``importlib.util.find_spec``), never imported: the launcher's process stays free of it."""
    if importlib.util.find_spec("torch") is not None:
        return None
    version = ".".join(map(str, sys.version_info[:3]))
    return (f"torch is not installed in the Python that would run torchrun: {shown(sys.executable)} "
            f"(Python {version}); install torch there, or start the launcher with the Python that has it")


def build_launch(cluster: Cluster, options: Options, script: str, script_args: Sequence[str],
                 environ: Mapping[str, str], run_dir: str, fabric: Optional[Mapping[str, str]] = None,
                 python: Optional[str] = None) -> Launch:
    """The torchrun argv and environment for this host. Pure: starts and writes nothing.

    torchrun runs :data:`BOOTSTRAP` with the script and its arguments: it runs the script as
    ``python script.py`` would and records the exit code the script asked for (:mod:`launcher.bootstrap`).

    ``fabric`` holds the platform's network variables; a variable the user set always wins.
    """
    log_dir = os.path.join(run_dir, "logs")
    error_file = os.path.join(run_dir, "torchrun_error.json")
    argv = [python or sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(cluster.nnodes),
            "--nproc-per-node", str(cluster.nproc_per_node)]
    if cluster.nnodes > 1:
        master = address_of(cluster.master_addr or "", options.resolve)
        argv += ["--node-rank", str(cluster.node_rank),
                 "--master-addr", master,
                 "--master-port", str(master_port(cluster, options)),
                 "--rdzv-backend", "static",
                 "--rdzv-id", cluster.job_name or "ddp-launcher",
                 "--rdzv-conf", f"timeout={options.rdzv_timeout}"]
        if cluster.local_addr:
            argv += ["--local-addr", address_of(cluster.local_addr, options.resolve)]
    else:
        argv += ["--standalone"]
    argv += ["--max-restarts", "0",  # restarts are job-wide, the launcher's (launcher/restart.py)
             "--log-dir", log_dir,
             "--redirects", "3",  # the workers' output to files, which the launcher copies (launcher/workerlogs.py)
             # "--": what follows is torchrun's script and its arguments, whatever they look like (without it
             # torchrun's parser takes a script argument that abbreviates two of its options, e.g. --start, for
             # its own and exits 2: "ambiguous option")
             "--", BOOTSTRAP, script, *script_args]

    notes: list[str] = []
    changes = {"TORCHELASTIC_ERROR_FILE": error_file, EXIT_DIR_VARIABLE: os.path.join(run_dir, "exits")}
    _setdefault(changes, environ, "PYTHONUNBUFFERED", "1", notes)
    for name, value in (fabric or {}).items():
        _setdefault(changes, environ, name, value, notes)
    removed = tuple(sorted(k for k in environ if k.startswith(INHERITED_PREFIXES) and k not in changes))
    return Launch(tuple(argv), changes, removed, run_dir, error_file, log_dir, tuple(notes),
                  cluster.nproc_per_node, cluster.node_rank * cluster.nproc_per_node)
