"""What Kubernetes gives every container, shared by the two Kubeflow builders (not a builder itself)."""

from __future__ import annotations

from launcher.simulate.hosts.base import ADDRESS

SUMMARY_NOTE = "on Kubernetes each pod's files go with the pod unless the job mounts a volume"


def kubernetes_variables(pod: str) -> dict[str, str]:
    """What the kubelet gives every container: its pod name and the ``kubernetes`` service's link
    variables (the API server; 127.0.0.1 here, and nothing contacts it)."""
    tcp = f"tcp://{ADDRESS}:443"
    return {"HOSTNAME": pod, "KUBERNETES_SERVICE_HOST": ADDRESS, "KUBERNETES_SERVICE_PORT": "443",
            "KUBERNETES_SERVICE_PORT_HTTPS": "443", "KUBERNETES_PORT": tcp, "KUBERNETES_PORT_443_TCP": tcp,
            "KUBERNETES_PORT_443_TCP_PROTO": "tcp", "KUBERNETES_PORT_443_TCP_PORT": "443",
            "KUBERNETES_PORT_443_TCP_ADDR": ADDRESS}
