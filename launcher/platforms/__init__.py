"""One module per cluster type, tried in a fixed order; :func:`choose` picks the one this host is on.

Each module holds a :class:`~launcher.platforms.base.Platform` named ``PLATFORM``: ``detect(environ)``
returns the evidence it found (nothing: not this platform), ``resolve(environ, host)`` returns the
:class:`~launcher.cluster.Cluster` (``host``: a :class:`~launcher.platforms.base.HostView`).
``--platform NAME`` (``LAUNCHER_PLATFORM``) skips detection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Optional

from launcher.errors import ConfigError, shown
from launcher.platforms import env, kubeflow, local, oci, pbs, sagemaker, slurm, vertex
from launcher.platforms.base import ArgvPairs, Platform

# Detection order: the first platform whose evidence is present wins. Why each stands where it does:
ORDER: tuple[tuple[Platform, str], ...] = (
    (sagemaker.PLATFORM, "its files and SM_* variables are written by AWS alone; a SageMaker job may "
                         "also carry MASTER_ADDR-style variables a user set"),
    (slurm.PLATFORM, "SLURM_JOB_ID is set by SLURM alone and names no other platform; before the generic "
                     "MASTER_ADDR-style platforms (kubeflow, env), which a SLURM user may set by hand"),
    (pbs.PLATFORM, "PBS_JOBID/PBS_NODEFILE are set by PBS alone; after slurm only so that a SLURM job "
                   "submitted from inside a PBS job (rare) reads the inner, SLURM, allocation"),
    (kubeflow.PLATFORM, "Kubernetes' KUBERNETES_SERVICE_HOST with the training-operator's MASTER_ADDR + WORLD_SIZE "
                        "+ RANK or PET_RDZV_ENDPOINT; before kubeflow-v2: v1 pods may carry v2's PET_* names too"),
    (kubeflow.PLATFORM_V2, "Kubernetes with PET_NNODES + PET_NODE_RANK + PET_MASTER_ADDR: all that Trainer v2 injects"),
    (vertex.PLATFORM, "CLUSTER_SPEC is written by Vertex AI alone; its PyTorch containers also export "
                      "MASTER_ADDR/RANK/WORLD_SIZE, so it stands before env"),
    (oci.PLATFORM, "JOB_RUN_OCID, OCI__* and CLUSTER_NODES_METADATA_FILE are OCI's alone; its drivers also set "
                   "NODE_RANK, so it stands before env"),
    (env.PLATFORM, "MASTER_ADDR/NODE_RANK/NNODES (or PET_*) are generic: every platform above sets some of them, "
                   "so they decide only when no cluster manager was recognised"),
    (local.PLATFORM, "always matches: the fallback when no cluster manager was found"),
)
PLATFORMS: dict[str, Platform] = {platform.name: platform for platform, _ in ORDER}


class Choice(NamedTuple):
    """Which platform was chosen, why, and every platform whose evidence was found."""

    platform: Platform
    why: str
    matches: tuple[tuple[str, tuple[str, ...]], ...]  # (name, evidence) in detection order


def detect_all(environ: Mapping[str, str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Every platform whose evidence is present, in detection order, with that evidence."""
    found = []
    for platform, _ in ORDER:
        evidence = platform.detect(environ)
        if evidence:
            found.append((platform.name, evidence))
    return tuple(found)


def choose(environ: Mapping[str, str], requested: Optional[str] = None,
           matches: Optional[tuple[tuple[str, tuple[str, ...]], ...]] = None) -> Choice:
    """The platform this host is on: the one named by ``requested``, else the first detected.

    ``matches``: :func:`detect_all`'s answer when the caller already has it (detection runs once).
    """
    if environ.get("TORCHELASTIC_RUN_ID") and environ.get("LOCAL_RANK"):
        raise ConfigError("already inside a torchrun worker (TORCHELASTIC_RUN_ID="
                          f"{shown(environ['TORCHELASTIC_RUN_ID'])}, LOCAL_RANK={shown(environ['LOCAL_RANK'])}): "
                          "run the training script directly instead of launching again")
    if matches is None:
        matches = detect_all(environ)
    if requested:
        if requested not in PLATFORMS:
            raise ConfigError(f"unknown platform {shown(requested)} for --platform/LAUNCHER_PLATFORM "
                              f"(known: {', '.join(PLATFORMS)})")
        return Choice(PLATFORMS[requested], f"named by --platform {requested}", matches)
    name = matches[0][0]
    reason = next(why for platform, why in ORDER if platform.name == name)
    others = [n for n, _ in matches[1:] if n != "local"]
    why = f"first in the detection order ({reason})"
    if others:
        why += f"; also matched: {', '.join(others)} (--platform chooses another)"
    return Choice(PLATFORMS[name], why, matches)


def read_argv(argv: Sequence[str], names: Sequence[str]) -> Optional[ArgvPairs]:
    """The launcher's options in a platform's own argv form (the first platform that recognises ``argv``
    reads it, whatever platform this host is on); None: the plain form."""
    for platform, _ in ORDER:
        pairs = platform.read_argv(argv, names)
        if pairs is not None:
            return pairs
    return None


def argv_help() -> list[str]:
    """Each platform's ``--help`` line about its own argv form."""
    return [platform.argv_help for platform in PLATFORMS.values() if platform.argv_help]


def stop_and_report(platform: Platform) -> str:
    """The platform's default grace period and how much of the report it shows, from its attributes."""
    shown_where = f"its first {platform.report_limit} characters shown" if platform.report_limit else "stderr only"
    return f"grace period {platform.grace_period:g} s; failure report: {shown_where}"


def help_rows() -> list[tuple[str, str]]:
    """``--help``'s platform table: name, what it reads, its grace period and report (detection order)."""
    return [(platform.name, f"{platform.reads}; {stop_and_report(platform)}") for platform, _ in ORDER]
