"""What every host builder shares: the :class:`HostSpec` the engine starts, the caller's environment
without another job's variables, the launcher's command, and the work directory's creation and undo.

A builder plays its platform: it writes the variables and files that platform gives a real node.
It never imports the launcher's reading of that platform (``launcher.platforms.<name>``): the two
stay independent so that the tests can hold one against the other. The one exception is AWS's side
of SageMaker, which the launcher also carries: the SageMaker builders use
``launcher.platforms.sagemaker.argv`` for the rendering of hyperparameters into argv that AWS's
toolkit performs, and ``launcher.platforms.sagemaker.bundle`` for the source bundle a user uploads.

A builder (a module in :data:`launcher.simulate.hosts.BUILDERS`) imports no other builder: what two
builders share lives in a helper module beside them (this one, ``kubernetes``, ``sagemaker_env``,
``sagemaker_files``, ``sagemaker_v3``) or in :mod:`launcher.simulate.become` (how a process becomes a
host). ``tests/test_structure.py`` checks both rules.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from launcher.errors import ConfigError
from launcher.simulate import netns

if TYPE_CHECKING:
    from launcher.simulate.job import Config

ADDRESS = "127.0.0.1"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# What the caller's environment must not pass to a host: another job's, platform's or run's variables.
FOREIGN_PREFIXES = ("SM_", "SAGEMAKER_", "TORCHELASTIC_", "PET_", "OCI__", "KUBERNETES_", "AIP_", "SLURM_",
                    "SLURMD_", "PBS_")
FOREIGN_NAMES = frozenset({"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                           "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "TRAINING_JOB_NAME",
                           "CURRENT_HOST", "NODE_RANK", "NODE_COUNT", "NNODES", "INITIAL_CLUSTER_SIZE",
                           "CLUSTER_NODES_METADATA_FILE", "CLUSTER_SPEC", "TF_CONFIG", "JOB_RUN_OCID",
                           "JOB_OCID", "MAIN_JOB_RUN_OCID", "CLOUD_ML_JOB_ID", "LAUNCHER_TRAIN_SCRIPT",
                           "LAUNCHER_DRY_RUN", "LAUNCHER_PLATFORM", "LAUNCHER_RESOLVE",
                           "LAUNCHER_MASTER_PORT"})


@dataclass(frozen=True)
class HostSpec:
    """One simulated host: its name, its directory, exactly how it is started, and where it reports.

    ``on_start`` runs right after the host's process started (a platform that fills a file in as
    hosts start, such as OCI's node metadata, does it there). ``aliases`` are the host's other names
    (``--network netns`` maps them to its address too). ``signal_targets``: given the host's PID, the
    launcher process(es) a fault's signal goes to (None: the host's process itself).
    """

    name: str
    base_dir: str
    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str]
    model_dir: Optional[str] = None
    failure_file: Optional[str] = None
    on_start: Optional[Callable[[], None]] = None
    aliases: tuple[str, ...] = ()
    signal_targets: Optional[Callable[[int], list[int]]] = None  # the launcher(s) under the host's pid


def in_namespaces(config: Config) -> bool:
    """True when every host has its own network namespace (``--network netns``)."""
    return config.network == "netns"


def host_address(config: Config, index: int) -> str:
    """Host ``index``'s address: its own on the lab's bridge with ``--network netns``, else 127.0.0.1."""
    return netns.host_address(index) if in_namespaces(config) else ADDRESS


def job_number(job_name: str) -> int:
    """A scheduler's job number (SLURM's job id, PBS's sequence number): fixed for a job name, six
    digits, as a cluster's counter would have reached."""
    return 100_000 + zlib.crc32(job_name.encode()) % 900_000


def write_json(path: str, data: Any) -> None:
    """``data`` as indented JSON with a final newline (the config files and ``summary.json``)."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


def write_json_atomically(path: str, data: Any) -> None:
    """Replace ``path`` in one step: a reader sees the old content or the new, never half of it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    write_json(tmp, data)
    os.replace(tmp, path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((ADDRESS, 0))
        return sock.getsockname()[1]


def caller_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment without another job's or platform's variables."""
    return {k: v for k, v in environ.items()
            if not k.startswith(FOREIGN_PREFIXES) and k not in FOREIGN_NAMES}


def job_environment(environ: Mapping[str, str], grace_period: float,
                    names: Sequence[str] = ()) -> dict[str, str]:
    """What every non-SageMaker host starts with: the caller's variables, this repository's launcher
    importable, and what the job spec's ``env`` would carry for a run on one machine.

    ``names`` are host names the machine cannot resolve: ``LAUNCHER_RESOLVE`` maps them to 127.0.0.1
    (none with ``--network netns``: each host's ``/etc/hosts`` knows every name).
    ``PYTHONUNBUFFERED=1`` keeps the live prefixes live (Kubeflow sets it on every pod itself).
    """
    env = caller_environment(environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({"LAUNCHER_GRACE_PERIOD": f"{grace_period:g}", "PYTHONUNBUFFERED": "1"})
    if names:
        env["LAUNCHER_RESOLVE"] = ",".join(f"{name}={ADDRESS}" for name in names)
    return env


def launcher_argv(script: str, script_args: Sequence[str]) -> tuple[str, ...]:
    """The job's command on every platform but SageMaker: ``python -m launcher script.py args...``."""
    return (sys.executable, "-m", "launcher", script, *script_args)


def plain_hosts(config: Config, environ: Mapping[str, str],
                variables: Callable[[int, str], Mapping[str, str]], resolve: Sequence[str] = (),
                on_start: Optional[Callable[[int], Callable[[], None]]] = None) -> list[HostSpec]:
    """The hosts of a platform whose job command is ``python -m launcher script.py args...``.

    Each host ``i`` gets its own directory ``DIR/<name>`` (its working directory), the common job
    environment (:func:`job_environment`) and the platform's ``variables(i, its directory)``;
    ``on_start(i)``, if given, is what happens when host ``i`` has started. ``resolve`` are the names
    the hosts are reached by; a name ``<host>.<domain>`` is one of that host's aliases.
    """
    def write() -> list[HostSpec]:
        common = job_environment(environ, config.grace_period, () if in_namespaces(config) else resolve)
        argv = launcher_argv(config.script, config.script_args)
        specs = []
        for i, name in enumerate(config.hosts):
            base = os.path.join(config.workdir, name)
            os.makedirs(base)
            aliases = tuple(n for n in resolve if n.startswith(name + "."))
            specs.append(HostSpec(name, base, argv, base, {**common, **variables(i, base)},
                                  on_start=on_start(i) if on_start else None, aliases=aliases))
        return specs
    return make_workdir(config.workdir, write)


def make_workdir(workdir: str, write: Callable[[], list[HostSpec]],
                 errors: tuple[type[Exception], ...] = (OSError,)) -> list[HostSpec]:
    """Create ``workdir`` and run ``write``; on ``errors`` remove what was made and raise ConfigError."""
    created = _first_missing(workdir)
    try:
        os.makedirs(workdir, exist_ok=True)
        return write()
    except errors as exc:
        _undo(workdir, created)
        raise ConfigError(f"cannot write the work directory {workdir!r}: {exc}") from None


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
