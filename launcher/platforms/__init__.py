"""One module per cluster type; :func:`resolve_cluster` picks the one this host is on.

Each platform module has ``detect(environ) -> bool`` and ``resolve(...) -> Cluster``; ``local`` is
the fallback when no cluster manager is found.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from launcher.cluster import Cluster
from launcher.errors import ConfigError
from launcher.platforms import local, sagemaker


def resolve_cluster(environ: Mapping[str, str], requested_nproc: Optional[int] = None,
                    dev_dir: str = "/dev") -> Cluster:
    """The cluster this host is part of, from its files and environment variables."""
    if environ.get("TORCHELASTIC_RUN_ID") and environ.get("LOCAL_RANK"):
        raise ConfigError("already inside a torchrun worker (TORCHELASTIC_RUN_ID="
                          f"{environ['TORCHELASTIC_RUN_ID']!r}, LOCAL_RANK={environ['LOCAL_RANK']!r}): "
                          "run the training script directly instead of launching again")
    if sagemaker.detect(environ):
        return sagemaker.resolve(environ, requested_nproc, dev_dir)
    return local.resolve(requested_nproc, dev_dir)
