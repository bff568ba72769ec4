"""Start PyTorch DDP (torchrun) on managed training clusters.

The package reads the platform's description of the cluster (SageMaker first), works out the
nodes, this node's rank, the master and the processes per node, and supervises one
``python -m torch.distributed.run`` per host. It uses only the Python standard library and never
imports torch in its own process.

Map of the modules, in the order a launch goes through them:

- ``options``: the launcher's own options (flags, SageMaker hyperparameters, ``LAUNCHER_*``).
- ``hyperparameters``: AWS's rendering of ``hyperparameters.json`` into argv, and its repair.
- ``platforms/``: one file per cluster type; each turns files and variables into a ``Cluster``.
- ``cluster``: the ``Cluster`` value every platform produces.
- ``command``: ``Cluster`` + options -> the exact torchrun argv and environment changes.
- ``supervise``: starts torchrun, streams its output, forwards signals, leaves no process behind.
- ``failure``: the root cause, the true exit code and the report for ``output/failure``.
- ``cli``: ties it together (``python -m launcher``, the ``ddp-launcher`` command).
- ``simulate``: N SageMaker hosts as N launcher processes on one machine (``ddp-launcher simulate``).
"""

__version__ = "0.1.0"
