"""The work directory: one SageMaker ``/opt/ml`` tree per host, the source tarball, each host's command."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from launcher.errors import ConfigError
from launcher.platforms.sagemaker import bundle, hyperparameters
from launcher.simulate.config import Config
from launcher.simulate.environment import caller_environment, estimator_environment, host_environment
from launcher.simulate.sagemaker_files import (
    checkpoint_config,
    encode_hyperparameters,
    input_data_config,
    resource_config,
    sdk_entries,
)


@dataclass(frozen=True)
class HostSpec:
    """One simulated host: its name, its /opt/ml, and exactly how it is started."""

    name: str
    base_dir: str
    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str]


def write_json(path: str, data: Any) -> None:
    """``data`` as indented JSON with a final newline (the config files and ``summary.json``)."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


def pack_source(config: Config) -> str:
    """Stage the bundle and pack it as ``DIR/sourcedir.tar.gz``, as SDK v2 uploads it."""
    target = os.path.join(config.workdir, "sourcedir.tar.gz")
    with tempfile.TemporaryDirectory(prefix="simulate-bundle-") as tmp:
        source = bundle.stage_bundle(config.script, os.path.join(tmp, "source"))
        with tarfile.open(target, "w:gz", dereference=True) as tar:
            for name in sorted(os.listdir(source)):
                tar.add(os.path.join(source, name), arcname=name)
    return target


def _host_tree(config: Config, host: str, submit: str) -> tuple[str, dict[str, Any]]:
    """Write one host's /opt/ml; returns its path and the content of its config files."""
    base = os.path.join(config.workdir, host)
    for sub in ("input/config", "input/data", "code", "model", "output/data", "checkpoints"):
        os.makedirs(os.path.join(base, sub))
    raw = encode_hyperparameters({**config.user_hyperparameters,
                                  **sdk_entries(config.job_name, submit, bundle.ENTRY_POINT)})
    files = {"resource": resource_config(config.hosts, host, config.instance_type),
             "data": input_data_config(config.channels), "hps": raw}
    conf = os.path.join(base, "input", "config")
    write_json(os.path.join(conf, "resourceconfig.json"), files["resource"])
    write_json(os.path.join(conf, "hyperparameters.json"), raw)
    write_json(os.path.join(conf, "inputdataconfig.json"), files["data"])
    write_json(os.path.join(conf, "checkpointconfig.json"), checkpoint_config(base, config.job_name))
    for name, path in config.channels.items():
        os.symlink(path, os.path.join(base, "input", "data", name))
    if not config.toolkit:  # what the toolkit's files.download_and_extract would do
        with tarfile.open(submit, "r:gz") as tar:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(os.path.join(base, "code"), **safe)
    return base, files


def host_argv(config: Config, raw_hps: Mapping[str, str]) -> tuple[str, ...]:
    """The host's command: ``python launch.py <AWS's argv>``, or the toolkit's ``train``."""
    if config.toolkit:
        return tuple(config.toolkit)
    rendered = hyperparameters.render_args(hyperparameters.user_hyperparameters(
        hyperparameters.decode(raw_hps)))
    return (sys.executable, bundle.ENTRY_POINT, *rendered)


def make_tree(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write the work directory; on any error remove what was made and raise :class:`ConfigError`."""
    created = _first_missing(config.workdir)
    try:
        os.makedirs(config.workdir, exist_ok=True)
        submit = pack_source(config)
        common = {**caller_environment(environ), **estimator_environment(config, port)}
        specs = []
        for host in config.hosts:
            base, files = _host_tree(config, host, submit)
            specs.append(HostSpec(host, base, host_argv(config, files["hps"]),
                                  os.path.join(base, "code"),
                                  host_environment(config, base, files, submit, common)))
        return specs
    except (OSError, tarfile.TarError) as exc:
        _undo(config.workdir, created)
        raise ConfigError(f"cannot write the work directory {config.workdir!r}: {exc}") from None


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
