"""What Kubernetes gives every container, shared by the two Kubeflow builders (not a builder itself)."""

from __future__ import annotations

import re

from launcher.errors import ConfigError
from launcher.simulate.hosts.base import ADDRESS

SUMMARY_NOTE = "on Kubernetes each pod's files go with the pod unless the job mounts a volume"
NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS-1035 label


def check_job_name(job_name: str, platform: str) -> None:
    """The job's name is in its pods' names: Kubernetes takes only a DNS-1035 label; else ConfigError."""
    if not NAME.match(job_name):
        raise ConfigError(f"--job-name must be a Kubernetes name (lower-case letters, digits, '-', "
                          f"starting with a letter) for --platform {platform}: {job_name!r}")


def kubernetes_variables(pod: str) -> dict[str, str]:
    """What the kubelet gives every container: its pod name and the ``kubernetes`` service's link
    variables (the API server; 127.0.0.1 here, and nothing contacts it)."""
    tcp = f"tcp://{ADDRESS}:443"
    return {"HOSTNAME": pod, "KUBERNETES_SERVICE_HOST": ADDRESS, "KUBERNETES_SERVICE_PORT": "443",
            "KUBERNETES_SERVICE_PORT_HTTPS": "443", "KUBERNETES_PORT": tcp, "KUBERNETES_PORT_443_TCP": tcp,
            "KUBERNETES_PORT_443_TCP_PROTO": "tcp", "KUBERNETES_PORT_443_TCP_PORT": "443",
            "KUBERNETES_PORT_443_TCP_ADDR": ADDRESS}
