"""Each host's environment: the ``SM_*`` variables AWS's toolkit computes (sagemaker_training.environment),
the estimator's ``LAUNCHER_*`` for a local run, and the caller's own variables minus another job's.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

from launcher.platforms.sagemaker import argv as aws_argv
from launcher.platforms.sagemaker import bundle
from launcher.simulate.hosts.base import ADDRESS, in_namespaces
from launcher.simulate.hosts.sagemaker_files import GROUP, LOG_LEVEL, REGION
from launcher.simulate.job import Config

# sagemaker_training.params.SAGEMAKER_HYPERPARAMETERS and the flags that make a group distributed.
TOOLKIT_KEYS = frozenset({"sagemaker_program", "sagemaker_submit_directory", "sagemaker_region",
                          "sagemaker_enable_cloudwatch_metrics", "sagemaker_container_log_level",
                          "sagemaker_job_name", "default_user_module_name", "_tuning_objective_metric",
                          "sagemaker_s3_output"})
DISTRIBUTION_FLAGS = ("sagemaker_mpi_enabled", "sagemaker_parameter_server_enabled",
                      "sagemaker_distributed_dataparallel_enabled", "sagemaker_pytorch_ddp_enabled",
                      "sagemaker_pytorch_xla_multi_worker_enabled",
                      "sagemaker_multi_worker_mirrored_strategy_enabled",
                      "sagemaker_torch_distributed_enabled")


def _env_value(value: Any) -> str:
    """``mapping.to_env_vars``'s value format: text as is, None empty, the rest compact JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _distribution_hosts(resource: Mapping[str, Any], framework: Mapping[str, Any]) -> tuple[list, list]:
    """The toolkit's distribution instance groups and their hosts (empty unless a flag says so)."""
    group = resource.get("current_group_name", GROUP)
    groups = framework.get("sagemaker_distribution_instance_groups",
                           [group] if any(framework.get(f, False) for f in DISTRIBUTION_FLAGS) else [])
    configured = resource.get("instance_groups", [])
    hosts = [h for g in configured if g["instance_group_name"] in groups for h in g["hosts"]]
    return groups, (hosts if configured else list(resource["hosts"]))


def training_env(base: str, resource: Mapping[str, Any], data_config: Mapping[str, Any],
                 raw_hps: Mapping[str, str], job_name: str) -> dict[str, Any]:
    """``dict(Environment())``: every property of AWS's toolkit environment for this host."""
    decoded = aws_argv.decode(raw_hps)
    sagemaker = {k: v for k, v in decoded.items() if k in TOOLKIT_KEYS or k.startswith("sagemaker_")}
    framework = {k: v for k, v in sagemaker.items() if k not in TOOLKIT_KEYS}
    groups = resource.get("instance_groups", [])
    current_group = resource.get("current_group_name", GROUP)
    dist_groups, dist_hosts = _distribution_hosts(resource, framework)
    master = dist_hosts[0] if dist_hosts else list(resource["hosts"])[0]
    program = sagemaker.get("sagemaker_program")
    module = str(program)
    return {
        "additional_framework_parameters": framework,
        "channel_input_dirs": {c: os.path.join(base, "input", "data", c) for c in data_config},
        "current_host": resource["current_host"],
        "current_instance_group": current_group,
        "current_instance_group_hosts": next((g["hosts"] for g in groups
                                              if g["instance_group_name"] == current_group), []),
        "current_instance_type": resource.get("current_instance_type", "local"),
        "distribution_hosts": dist_hosts, "distribution_instance_groups": dist_groups,
        "framework_module": None, "hosts": resource["hosts"],
        "hyperparameters": {k: v for k, v in decoded.items() if k not in sagemaker},
        "input_config_dir": os.path.join(base, "input", "config"),
        "input_data_config": dict(data_config), "input_dir": os.path.join(base, "input"),
        "instance_groups": [g["instance_group_name"] for g in groups],
        "instance_groups_dict": {g["instance_group_name"]: g for g in groups},
        "is_hetero": len(groups) > 1, "is_master": resource["current_host"] == master,
        "is_modelparallel_enabled": None,
        "is_smddpmprun_installed": shutil.which("smddpmprun") is not None,
        "is_smddprun_installed": shutil.which("smddprun") is not None,
        "job_name": job_name, "log_level": sagemaker.get("sagemaker_container_log_level", LOG_LEVEL),
        "master_hostname": master, "model_dir": os.path.join(base, "model"),
        "module_dir": str(sagemaker.get("sagemaker_submit_directory", os.path.join(base, "code"))),
        "module_name": module[:-3] if module.endswith(".py") else module,
        "network_interface_name": resource.get("network_interface_name", "eth0"),
        "num_cpus": os.cpu_count() or 1, "num_gpus": 0, "num_neurons": 0,
        "output_data_dir": os.path.join(base, "output", "data"),
        "output_dir": os.path.join(base, "output"),
        "output_intermediate_dir": os.path.join(base, "output", "intermediate"),
        "resource_config": dict(resource), "topology": resource.get("topology", []),
        "user_entry_point": program,
    }


def toolkit_env(base: str, resource: Mapping[str, Any], data_config: Mapping[str, Any],
                raw_hps: Mapping[str, str], job_name: str) -> dict[str, str]:
    """``Environment().to_env_vars()`` for this host: the ``SM_*`` variables, in AWS's format.

    CPU simulation: ``SM_NUM_GPUS`` and ``SM_NUM_NEURONS`` are 0 even on a machine with devices
    (the simulated hosts would share them).
    """
    env = training_env(base, resource, data_config, raw_hps, job_name)
    fields = {
        "hosts": env["hosts"], "network_interface_name": env["network_interface_name"],
        "hps": env["hyperparameters"], "user_entry_point": env["user_entry_point"],
        "framework_params": env["additional_framework_parameters"],
        "channels": sorted(env["channel_input_dirs"]), "training_env": env,
        "user_args": aws_argv.render_args(env["hyperparameters"]),
        **{k: env[k] for k in ("resource_config", "input_data_config", "output_data_dir",
                               "current_host", "current_instance_type", "current_instance_group",
                               "current_instance_group_hosts", "instance_groups",
                               "instance_groups_dict", "distribution_instance_groups", "is_hetero",
                               "module_name", "log_level", "framework_module", "input_dir",
                               "input_config_dir", "output_dir", "num_cpus", "num_gpus",
                               "num_neurons", "model_dir", "module_dir", "output_intermediate_dir")},
    }
    if env["topology"]:
        fields["topology"] = env["topology"]
    fields.update({f"channel_{name}": path for name, path in env["channel_input_dirs"].items()})
    fields.update({f"hp_{key}": value for key, value in env["hyperparameters"].items()})
    return {f"SM_{key.upper()}": _env_value(value) for key, value in fields.items()}


def estimator_environment(config: Config, port: int) -> dict[str, str]:
    """What a user would pass as the estimator's ``environment=`` for a local run of N hosts. With
    ``--network netns`` neither ``LAUNCHER_RESOLVE`` (each host's ``/etc/hosts`` knows the names) nor
    ``LAUNCHER_MASTER_PORT`` (each host has its own ports: the launcher takes SageMaker's, as on SageMaker)."""
    env = {"LAUNCHER_GRACE_PERIOD": f"{config.grace_period:g}",
           "PYTHONUNBUFFERED": "1"}  # AWS's framework containers set it too
    if not in_namespaces(config):
        env["LAUNCHER_MASTER_PORT"] = str(port)
        env["LAUNCHER_RESOLVE"] = ",".join(f"{h}={ADDRESS}" for h in config.hosts)
    if config.nproc_per_node is not None:
        env["LAUNCHER_NPROC_PER_NODE"] = str(config.nproc_per_node)
    return env


def host_environment(config: Config, base: str, files: Mapping[str, Any], submit: str,
                     common: Mapping[str, str]) -> dict[str, str]:
    """The full environment of one host's first process."""
    env = dict(common)
    env.update({"SAGEMAKER_BASE_DIR": base, "TRAINING_JOB_NAME": config.job_name})
    if config.options.toolkit:  # the toolkit computes SM_* itself from the tree
        env.update({"SAGEMAKER_PROGRAM": bundle.ENTRY_POINT, "SAGEMAKER_SUBMIT_DIRECTORY": submit})
        if not in_namespaces(config):  # algo-* do not resolve: skip the toolkit's DNS wait
            env["SM_STUDIO_LOCAL_MODE"] = "true"
        return env
    env.update(toolkit_env(base, files["resource"], files["data"], files["hps"], config.job_name))
    env.update({"CURRENT_HOST": files["resource"]["current_host"],
                "SAGEMAKER_JOB_NAME": config.job_name, "SAGEMAKER_REGION": REGION})
    code = os.path.join(base, "code")
    env["PYTHONPATH"] = code + (os.pathsep + common["PYTHONPATH"] if common.get("PYTHONPATH") else "")
    return env
