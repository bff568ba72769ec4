"""The files SageMaker writes into a host's ``input/config/``, in AWS's formats (contents only, no I/O)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

GROUP = "homogeneousCluster"
INTERFACE = "lo"  # every host is 127.0.0.1 (--network loopback)
NETNS_INTERFACE = "eth0"  # a host's own interface on the bridge (--network netns), as on SageMaker
REGION = "us-east-1"
LOG_LEVEL = 20  # logging.INFO, the SDK's default container_log_level


def sdk_entries(job_name: str, submit_dir: str, program: str) -> dict[str, Any]:
    """What SDK v2's ``_script_mode_hyperparam_update`` adds to the user's hyperparameters."""
    return {"sagemaker_submit_directory": submit_dir, "sagemaker_program": program,
            "sagemaker_container_log_level": LOG_LEVEL, "sagemaker_job_name": job_name,
            "sagemaker_region": REGION}


def encode_hyperparameters(decoded: Mapping[str, Any]) -> dict[str, str]:
    """``hyperparameters.json`` as SDK v2 writes it: every value JSON-encoded."""
    return {str(key): json.dumps(value) for key, value in decoded.items()}


def resource_config(hosts: Sequence[str], current: str, instance_type: str, interface: str = INTERFACE,
                    groups: Sequence[tuple[str, str, Sequence[str]]] = ()) -> dict[str, Any]:
    """``resourceconfig.json``: ``hosts`` sorted; the current group first, its host list current host first
    (not sorted). ``groups`` (name, instance type, hosts): a heterogeneous job; else one group of every host."""
    if not groups:
        groups = [(GROUP, instance_type, hosts)]
    mine = next(g for g in groups if current in g[2])
    listed = [{"instance_group_name": name, "instance_type": kind,
               "hosts": [current] + [h for h in members if h != current] if current in members else list(members)}
              for name, kind, members in [mine] + [g for g in groups if g is not mine]]
    return {"current_host": current, "current_instance_type": mine[1],
            "current_group_name": mine[0], "hosts": sorted(hosts),
            "instance_groups": listed,
            "network_interface_name": interface}


def input_data_config(channels: Mapping[str, str]) -> dict[str, Any]:
    """``inputdataconfig.json``: one File-mode, fully replicated entry per channel."""
    return {name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                   "RecordWrapperType": "None"} for name in channels}


def checkpoint_config(base: str, job_name: str) -> dict[str, str]:
    """``checkpointconfig.json``; nothing is synced: the URI only shows the format."""
    return {"LocalPath": os.path.join(base, "checkpoints"),
            "S3Uri": f"s3://simulated-bucket/{job_name}/checkpoints"}
