"""One host builder per platform: each writes, for every simulated host, the variables and files that
platform gives a real node, and says how the host is started (:class:`~launcher.simulate.hosts.base.HostSpec`).

A builder module defines ``NAME``, ``SUMMARY_NOTE`` (the summary's last words on where outputs go),
``host_names(job_name, count)`` and ``make_hosts(config, environ, port)``, and may define:

- ``HOSTS_HELP``: its line of ``simulate --help``'s platform list (default: its docstring's first line);
  ``SCRIPT_WORDS``: what the words after ``--`` are, when more than ``script.py args...``;
- its own command-line options, as TorchX's schedulers declare ``run_opts``: ``add_options(parser)``
  adds them as an argument group, each with a default that means "not given" (None, False or []);
  ``check_options(args, hosts, job_name, words, cwd)`` checks them (a ``ConfigError`` is exit 2) and
  returns ``(script, script_args, options)``: the training script from the words after ``--``, the
  words the script gets, and a frozen subclass of :class:`launcher.simulate.job.PlatformOptions`
  that ``make_hosts`` reads as ``config.options`` (without it: ``-- script.py args...`` and no options).
  ``WRONG_PLATFORM``: how one of its options given with another ``--platform`` is refused (default
  ``"{option} needs --platform {name}, not {platform!r}"``). ``HOSTS_OPTION`` and
  ``count_hosts(args)``: an option that gives the number of hosts instead of ``--hosts``.

:mod:`launcher.simulate.config` names no platform: it asks every builder for its options, so a new
platform's options need no line outside its builder.
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
