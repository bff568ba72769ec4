"""One host builder per platform: each writes, for every simulated host, the variables and files that
platform gives a real node, and says how the host is started (:class:`~launcher.simulate.hosts.base.HostSpec`).

A builder module defines ``NAME``, ``SUMMARY_NOTE`` (the summary's last words on where outputs go),
``host_names(job_name, count)`` and ``make_hosts(config, environ, port)``. Builders are imported
only when chosen, so ``simulate --help`` and bad input stay fast.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# --platform NAME -> the builder's module; SageMaker first: the default.
BUILDERS = {
    "sagemaker": "launcher.simulate.hosts.sagemaker",
    "kubeflow": "launcher.simulate.hosts.kubeflow",
    "kubeflow-v2": "launcher.simulate.hosts.kubeflow_v2",
    "oci": "launcher.simulate.hosts.oci",
    "vertex": "launcher.simulate.hosts.vertex",
    "env": "launcher.simulate.hosts.env",
    "slurm": "launcher.simulate.hosts.slurm",
    "pbs": "launcher.simulate.hosts.pbs",
}
DEFAULT = "sagemaker"


def builder(platform: str) -> ModuleType:
    """The builder module for ``platform`` (one of :data:`BUILDERS`)."""
    return importlib.import_module(BUILDERS[platform])
