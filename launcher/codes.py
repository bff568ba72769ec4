"""The classes of a run's outcome and the exit code each one gives.

A retry policy (SkyPilot ``recover_on_exit_codes``, a Kubernetes ``podFailurePolicy``, SLURM
``--requeue``, SageMaker's retry strategy) acts on the exit code; the outcome file names the class, so
two classes that share a code (a lost host and a worker the kernel SIGKILLed both give 137) are still
told apart in the data and in the report. So are a worker the kernel's OOM killer SIGKILLed and one
SIGKILLed otherwise (:mod:`launcher.oom`: the kernel's own count of OOM kills rose meanwhile).

=================  ==============================  =================================================
class              exit code                       meaning
=================  ==============================  =================================================
``success``        0                               every worker of every host exited 0
``worker_exit``    the worker's own code           a worker exited with a non-zero code (user error)
``worker_signal``  128 + the signal                a worker was killed by a signal (not the OOM killer's)
``out_of_memory``  137 (128 + SIGKILL)             the kernel's OOM killer killed a worker (or torchrun)
``host_lost``      137                             another host went away (power, network, preemption)
``hang``           124                             no rank made progress for the hang timeout
``no_progress``    93                              restarting did not help: a restarted generation failed
                                                   again with the same root cause and made no progress
``rendezvous``     75 (EX_TEMPFAIL)                the hosts never completed the rendezvous
``stopped``        128 + the stop signal           the platform or the user stopped the job
``bad_input``      2                               bad files, variables or options; nothing started
``internal``       70 (EX_SOFTWARE)                the launcher's own error
=================  ==============================  =================================================
"""

from __future__ import annotations

SUCCESS = "success"
WORKER_EXIT = "worker_exit"
WORKER_SIGNAL = "worker_signal"
OUT_OF_MEMORY = "out_of_memory"
HOST_LOST = "host_lost"
HANG = "hang"
NO_PROGRESS = "no_progress"
RENDEZVOUS = "rendezvous"
STOPPED = "stopped"
BAD_INPUT = "bad_input"
INTERNAL = "internal"

HOST_LOST_CODE = 137  # what platforms' retry policies already read as "the machine went away"
OUT_OF_MEMORY_CODE = 137  # 128 + SIGKILL, as the OOM killer's signal gives
HANG_CODE = 124  # coreutils timeout(1)'s "timed out"
NO_PROGRESS_CODE = 93  # as NVIDIA ft_launcher's "do not requeue": a retry would fail the same way
RENDEZVOUS_CODE = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, worth a retry
BAD_INPUT_CODE = 2  # as argparse
INTERNAL_CODE = 70  # sysexits.h EX_SOFTWARE

# Classes caused by the infrastructure rather than by the user's script: a retry policy retries these.
INFRASTRUCTURE = frozenset({HOST_LOST, RENDEZVOUS, STOPPED})
