"""SageMaker SDK 3.x (``ModelTrainer``): each host ``algo-i`` runs the job the way a v3 job runs.

What a ``ModelTrainer(source_code=SourceCode(source_dir=..., entry_script=...))`` job gives a
container (``sagemaker-train`` 1.27: ``model_trainer.py``, ``constants.py``, ``templates.py`` and
``container_drivers/``):

- two extra input channels: ``code`` (the source directory's files, loose) at
  ``/opt/ml/input/data/code`` and ``sm_drivers`` at ``/opt/ml/input/data/sm_drivers``: the SDK's
  ``container_drivers/`` tree, its generated ``sm_train.sh``, ``sourcecode.json`` and
  ``distributed.json``;
- ``hyperparameters.json`` with every value as the SDK's ``safe_serialize`` wrote it (a text as is,
  anything else ``json.dumps``), in the order given;
- the container command ``/bin/bash -c "chmod +x .../sm_train.sh && .../sm_train.sh"``
  (:data:`CONTAINER_COMMAND`): ``sm_train.sh`` runs ``scripts/environment.py`` (it reads
  ``/opt/ml/input/config/*.json`` and writes the ``SM_*`` variables into
  ``/opt/ml/input/sm_training.env``), sources them, ``cd``\\ s into the code channel and runs
  ``distributed_drivers/basic_script_driver.py``, which starts ``python <entry_script> --key value ...``.

Those drivers hard-code ``/opt/ml``. Each host therefore runs in a mount namespace of its own
(``unshare --mount`` as root, else ``unshare --user --map-root-user --mount``) in which
:mod:`launcher.simulate.become` binds a copy of ``/opt`` (its entries bound in again) holding the host's
tree as ``ml`` over ``/opt``, and the job's hosts file over ``/etc/hosts`` (every ``algo-i`` at
127.0.0.1), so the SDK's files run unchanged. The machine's ``/opt`` and ``/etc/hosts`` are never
touched; the mounts end with the host. Where neither namespace is permitted, ``--sdk v3`` is refused
(exit 2) before anything is written.

The drivers and ``sm_train.sh`` are never written here: ``--sm-drivers DIR`` names the ``sm_drivers``
channel the SDK uploaded (or wrote, see :mod:`launcher.simulate.hosts.sagemaker_v3_drivers`).
``--code DIR`` names the ``code`` channel; without it the bundle is staged from the script.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from typing import Any

from launcher import proctree
from launcher.platforms.sagemaker import bundle
from launcher.simulate import become
from launcher.simulate.hosts.base import HostSpec, caller_environment, in_namespaces, make_workdir, write_json
from launcher.simulate.hosts.sagemaker_env import estimator_environment
from launcher.simulate.hosts.sagemaker_files import input_data_config, resource_config
from launcher.simulate.job import Config

CONTAINER_BASE = "/opt/ml"
DRIVERS_CHANNEL, CODE_CHANNEL = "sm_drivers", "code"
TRAIN_SCRIPT = f"{CONTAINER_BASE}/input/data/{DRIVERS_CHANNEL}/sm_train.sh"
# ModelTrainer's DEFAULT_CONTAINER_ENTRYPOINT + DEFAULT_CONTAINER_ARGUMENTS (sagemaker.train.constants).
CONTAINER_COMMAND = ("/bin/bash", "-c", f"chmod +x {TRAIN_SCRIPT} && {TRAIN_SCRIPT}")
NAMESPACES = become.unshare_forms("--mount")


def safe_serialize(value: Any) -> str:
    """A hyperparameter as ``ModelTrainer`` writes it (``common.utils.safe_serialize``): text as is, else JSON."""
    import json

    return value if isinstance(value, str) else json.dumps(value)


def host_argv(command: tuple[str, ...], tree: str, stage: str, hosts: str,
              argv: tuple[str, ...]) -> tuple[str, ...]:
    """``argv`` run with ``tree`` as ``/opt/ml`` (``stage``: the new ``/opt``) and ``hosts`` as
    ``/etc/hosts``, in a new mount namespace."""
    return become.command(argv, binds=[(hosts, "/etc/hosts")], opt=(tree, stage), prefix=command)


def namespace_command() -> tuple[str, ...]:
    """The ``unshare`` command that gives a host its own ``/opt/ml`` here, or ConfigError (exit 2)."""
    import tempfile

    from launcher.errors import ConfigError

    def works(form: tuple[str, ...]) -> bool:
        with tempfile.TemporaryDirectory(prefix="simulate-v3-probe-") as tmp:
            tree = os.path.join(tmp, "tree")
            os.mkdir(tree)
            return become.probe_succeeds(host_argv(form, tree, os.path.join(tmp, "opt"), "/etc/hosts",
                                                   ("/bin/sh", "-c", f"test -d {CONTAINER_BASE}")))
    command = become.first_permitted(NAMESPACES, works)
    if command is not None:
        return command
    raise ConfigError("--sdk v3 needs a mount namespace per host for its /opt/ml: 'unshare --mount' (root) or "
                      "'unshare --user --map-root-user --mount' is not permitted here")


def launcher_pids(root: int) -> list[int]:
    """The host's launcher (``python launch.py``) under the drivers; a stop signal goes there.

    Only the topmost such process: the launcher's watchdog is a fork of it, with the same command line.
    """
    parents = proctree.parent_map()
    found: list[int] = []
    for pid in proctree.descendants([root], parents):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                words = fh.read().split(b"\0")
        except OSError:
            continue
        if len(words) > 1 and os.path.basename(words[1].decode(errors="replace")) == bundle.ENTRY_POINT:
            found.append(pid)
    return [pid for pid in found if parents.get(pid) not in found]


def _code_dir(config: Config, scratch: str) -> str:
    """The ``code`` channel: ``--code DIR`` as given, else the bundle staged from the script."""
    if config.options.code_dir:
        return config.options.code_dir
    return bundle.stage_bundle(config.script, os.path.join(scratch, "code"))


def _host_tree(config: Config, host: str, code: str, hps: Mapping[str, str]) -> str:
    """Write one host's ``/opt/ml``: config files, the channels, model/, output/, checkpoints/."""
    options = config.options
    base = os.path.join(config.workdir, host)
    for sub in ("input/config", "input/data", "model", "output/data", "checkpoints"):
        os.makedirs(os.path.join(base, sub))
    channels = {**options.channels, CODE_CHANNEL: code, DRIVERS_CHANNEL: options.drivers_dir}
    conf = os.path.join(base, "input", "config")
    write_json(os.path.join(conf, "resourceconfig.json"), resource_config(config.hosts, host, options.instance_type,
                                                                               groups=options.instance_groups))
    write_json(os.path.join(conf, "hyperparameters.json"), dict(hps))
    write_json(os.path.join(conf, "inputdataconfig.json"), input_data_config(channels))
    write_json(os.path.join(conf, "checkpointconfig.json"),
               {"LocalPath": f"{CONTAINER_BASE}/checkpoints",
                "S3Uri": f"s3://simulated-bucket/{config.job_name}/checkpoints"})
    for name, path in options.channels.items():
        os.symlink(path, os.path.join(base, "input", "data", name))
    for name in (CODE_CHANNEL, DRIVERS_CHANNEL):  # SageMaker downloads a copy onto every instance
        shutil.copytree(channels[name], os.path.join(base, "input", "data", name), symlinks=True)
    return base


def host_environment(config: Config, environ: Mapping[str, str], port: int) -> dict[str, str]:
    """What the container starts with: the caller's variables (less another job's), this Python first on
    ``PATH`` (``sm_train.sh`` runs ``python3``), ``TRAINING_JOB_NAME``, and the trainer's ``environment=``."""
    env = caller_environment(environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", os.defpath)
    env.update(estimator_environment(config, port))
    env.pop("LAUNCHER_RESOLVE", None)  # the host's /etc/hosts names every algo-i
    env["TRAINING_JOB_NAME"] = config.job_name
    return env


def make_hosts(config: Config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    """Write every host's tree; each runs ``CONTAINER_COMMAND`` with its tree as ``/opt/ml``."""
    command = namespace_command()
    hps = {key: safe_serialize(value) for key, value in config.options.hyperparameters.items()}

    def write() -> list[HostSpec]:
        namespaces = os.path.join(config.workdir, "namespaces")
        os.makedirs(namespaces)
        hosts_file = os.path.join(namespaces, "hosts")
        with open("/etc/hosts", encoding="utf-8", errors="replace") as fh, \
                open(hosts_file, "w", encoding="utf-8") as out:
            out.write(become.hosts_file_text(fh.read(), config.hosts))
        code = _code_dir(config, namespaces)
        env = host_environment(config, environ, port)
        specs = []
        if in_namespaces(config):  # the lab already gives each host an /etc/hosts naming every host
            hosts_file = "/etc/hosts"
        for host in config.hosts:
            base = _host_tree(config, host, code, hps)
            argv = host_argv(command, base, os.path.join(namespaces, host, "opt"), hosts_file, CONTAINER_COMMAND)
            specs.append(HostSpec(host, base, argv, base, env, model_dir=os.path.join(base, "model"),
                                  failure_file=os.path.join(base, "output", "failure"),
                                  signal_targets=launcher_pids))
        return specs
    return make_workdir(config.workdir, write, (OSError, shutil.Error))
