"""SageMaker: one ``/opt/ml`` tree per host ``algo-i``, the source tarball, and each host's command.

The files and variables are AWS's: ``resourceconfig.json`` and the rest in the formats of
:mod:`launcher.simulate.hosts.sagemaker_files`, the ``SM_*`` variables AWS's toolkit computes
(:mod:`launcher.simulate.hosts.sagemaker_env`); the tests hold them against AWS's own packages.
"""

from __future__ import annotations

import os
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from typing import Any

from launcher import proctree
from launcher.platforms.sagemaker import argv as aws_argv
from launcher.platforms.sagemaker import bundle
from launcher.simulate.hosts.base import HostSpec, caller_environment, in_namespaces, make_workdir, write_json
from launcher.simulate.hosts.sagemaker_env import estimator_environment, host_environment
from launcher.simulate.hosts.sagemaker_files import (
    INTERFACE,
    NETNS_INTERFACE,
    checkpoint_config,
    encode_hyperparameters,
    input_data_config,
    resource_config,
    sdk_entries,
)

# The builder's own options and their checks (the builder protocol: launcher/simulate/hosts/__init__.py).
from launcher.simulate.hosts.sagemaker_options import (  # noqa: F401
    HOSTS_OPTION,
    SCRIPT_WORDS,
    WRONG_PLATFORM,
    SageMakerOptions,
    add_options,
    check_options,
    count_hosts,
)
from launcher.simulate.job import Config

NAME = "sagemaker"
SUMMARY_NOTE = "SageMaker would merge every host's model/ into one model.tar.gz"
HOSTS_HELP = "algo-1..algo-N: /opt/ml tree (resourceconfig.json ...) and SM_* variables"


def host_names(job_name: str, count: int) -> tuple[str, ...]:
    """``algo-1`` .. ``algo-N``, as SageMaker names its instances."""
    return tuple(f"algo-{i}" for i in range(1, count + 1))


def uploaded_files(script: str) -> list[str]:
    """The other files of an uploaded source directory the script is in (``launch.py`` and ``launcher/``
    beside it, e.g. a job's unpacked ``sourcedir.tar.gz``): they go into the bundle again."""
    folder = os.path.dirname(os.path.abspath(script))
    if not (os.path.isfile(os.path.join(folder, bundle.ENTRY_POINT))
            and os.path.isdir(os.path.join(folder, bundle.PACKAGE))):
        return []
    skip = {bundle.ENTRY_POINT, os.path.basename(script), bundle.HELPER_MODULE}
    return sorted(os.path.join(folder, name) for name in os.listdir(folder)
                  if name not in skip and not name.startswith(".") and os.path.isfile(os.path.join(folder, name)))


def pack_source(config: Config) -> str:
    """Stage the bundle and pack it as ``DIR/sourcedir.tar.gz``, as SDK v2 uploads it."""
    target = os.path.join(config.workdir, "sourcedir.tar.gz")
    with tempfile.TemporaryDirectory(prefix="simulate-bundle-") as tmp:
        source = bundle.stage_bundle(config.script, os.path.join(tmp, "source"), uploaded_files(config.script))
        with tarfile.open(target, "w:gz", dereference=True) as tar:
            for name in sorted(os.listdir(source)):
                tar.add(os.path.join(source, name), arcname=name)
    return target


def _host_tree(config: Config, host: str, submit: str) -> tuple[str, dict[str, Any]]:
    """Write one host's /opt/ml; returns its path and the content of its config files."""
    options: SageMakerOptions = config.options
    base = os.path.join(config.workdir, host)
    for sub in ("input/config", "input/data", "code", "model", "output/data", "checkpoints"):
        os.makedirs(os.path.join(base, sub))
    raw = encode_hyperparameters({**options.hyperparameters,
                                  **sdk_entries(config.job_name, submit, bundle.ENTRY_POINT)})
    interface = NETNS_INTERFACE if in_namespaces(config) else INTERFACE
    files = {"resource": resource_config(config.hosts, host, options.instance_type, interface,
                                         options.instance_groups),
             "data": input_data_config(options.channels), "hps": raw}
    conf = os.path.join(base, "input", "config")
    write_json(os.path.join(conf, "resourceconfig.json"), files["resource"])
    write_json(os.path.join(conf, "hyperparameters.json"), raw)
    write_json(os.path.join(conf, "inputdataconfig.json"), files["data"])
    write_json(os.path.join(conf, "checkpointconfig.json"), checkpoint_config(base, config.job_name))
    for name, path in options.channels.items():
        os.symlink(path, os.path.join(base, "input", "data", name))
    if not options.toolkit:  # what the toolkit's files.download_and_extract would do
        with tarfile.open(submit, "r:gz") as tar:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(os.path.join(base, "code"), **safe)
    return base, files


def host_argv(config: Config, raw_hps: Mapping[str, str]) -> tuple[str, ...]:
    """The host's command: ``python launch.py <AWS's argv>``, or the toolkit's ``train``."""
    if config.options.toolkit:
        return tuple(config.options.toolkit)
    rendered = aws_argv.render_args(aws_argv.user_hyperparameters(
        aws_argv.decode(raw_hps)))
    return (sys.executable, bundle.ENTRY_POINT, *rendered)


def make_hosts(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write the work directory; on any error remove what was made and raise :class:`ConfigError`.

    ``--sdk v3``: :mod:`launcher.simulate.hosts.sagemaker_v3` (ModelTrainer's drivers) writes the hosts.
    """
    if config.options.sdk == "v3":
        from launcher.simulate.hosts import sagemaker_v3

        return sagemaker_v3.make_hosts(config, environ, port)
    def write() -> list[HostSpec]:
        submit = pack_source(config)
        common = {**caller_environment(environ), **estimator_environment(config, port)}
        specs = []
        for host in config.hosts:
            base, files = _host_tree(config, host, submit)
            specs.append(HostSpec(host, base, host_argv(config, files["hps"]), os.path.join(base, "code"),
                                  host_environment(config, base, files, submit, common),
                                  model_dir=os.path.join(base, "model"),
                                  failure_file=os.path.join(base, "output", "failure"),
                                  signal_targets=proctree.children_of if config.options.toolkit else None))
        return specs
    return make_workdir(config.workdir, write, (OSError, tarfile.TarError))

