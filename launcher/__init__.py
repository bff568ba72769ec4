"""Start PyTorch DDP (torchrun) on managed training clusters.

The package reads the platform's description of the cluster (SageMaker first), works out the
nodes, this node's rank, the master and the processes per node, and supervises one
``python -m torch.distributed.run`` per host. It uses only the Python standard library and never
imports torch in its own process.

Map of the modules, in the order a launch goes through them (``tests/test_structure.py`` checks that it
names every module and only modules that exist):

- ``entry``: the front door (``ddp-launcher``, ``python -m launcher``, the zipapp): parses on Python 2.7+ and refuses
  a Python older than 3.9 in one line, then runs ``cli``.
- ``cli``: ties it together (``python -m launcher``, ``ddp-launcher``): ``plan()`` decides everything once (the
  launch, and whether the job watch, hang detection and restarts are on, with why), ``run()`` starts.
- ``plan``: what ``plan()`` decides, as data (``Plan``, and each capability's ``Switch``: on or off, and why).
- ``options``: the launcher's own options (flags, ``LAUNCHER_*``, a platform's own argv form) and ``--help``.
- ``errors``: ``ConfigError`` (bad input: exit 2, one line), how a bad value is quoted, bounded numbers.
- ``filereader``: every input file read as a regular file, bounded, never blocking (FIFOs, devices refused).
- ``filewriter``: the failure report and the outcome file written atomically (the old file or the whole new one).
- ``platforms/``: the registry of cluster types in detection order, and ``choose()``.

  - ``platforms/base``: the ``Platform`` interface, ``HostView`` and the small readers platforms share.
  - ``platforms/devices``: GPUs and RDMA devices, from device files and sysfs.
  - ``platforms/hostlist``: SLURM's compressed host lists, expanded.
  - ``platforms/sagemaker/``: SageMaker jobs (``resourceconfig.json``, ``SM_*``).
  - ``platforms/sagemaker/argv``: AWS's rendering of hyperparameters, its repair, the SageMaker form.
  - ``platforms/sagemaker/bundle``: what an estimator uploads (``ddp-launcher bundle``).
  - ``platforms/sagemaker/groups``: heterogeneous clusters: which instance groups train.
  - ``platforms/slurm``, ``platforms/pbs``, ``platforms/kubeflow``, ``platforms/vertex``, ``platforms/oci``,
    ``platforms/env``, ``platforms/local``: one cluster type each.

- ``cluster``: the ``Cluster`` value every platform produces.
- ``groups``: hosts outside the training world: the script once, without torchrun, supervised.
- ``command``: platform + options -> the ``Cluster`` (``cluster_for``), then torchrun's exact argv and env.
- ``rundir``: the run directory under ``$TMPDIR``: made private and locked, removed, dead ones cleaned.
- ``preflight``: bounded waits for host names and files the cluster publishes late.
- ``bootstrap``: what torchrun runs for each worker: the script as ``python script.py``, and the code it asked for;
  with hang detection on, a thread that samples the main thread (moved, or went round a loop) and beats.
- ``runcontext``: a started run's context (``Run``: the plan, environment, log, watchdog, job watch and hang
  detection), which ``supervise``, ``generations`` and ``report`` take.
- ``supervise``: starts torchrun, streams its output, forwards signals, leaves no process behind.
- ``streams``: standard streams that are always there, and writes that never fail.
- ``workerlogs``: the workers' output, copied from torchrun's log files to our streams, each line with its rank.
- ``logspace``: the worker logs' disk use under ``$TMPDIR`` kept bounded while torchrun runs; a full disk named.
- ``proctree``: finding and ending the processes the launcher started (the watchdog).
- ``jobwatch/``: the launchers of one job watch each other; a failed or lost host stops the job; the job's root
  cause is handed over as an ``Event``; ``start()`` and ``for_cluster()``.
  - ``jobwatch/watch``: framing, tags (HMAC), connections and the loop that hub and client share.
  - ``jobwatch/hub``: node 0's side; ``jobwatch/client``: every other node's.
  - ``jobwatch/messages``: the typed messages, with the table of every one (the wire protocol).
  - ``jobwatch/restarts``: restarts' generation messages and state, an extension of the watch.
- ``progress``: when each rank was last heard and last stepped (beats, sampled main threads, lines of ranks
  with neither).
- ``hangtimeout``: the hang timeout in force and why: the start's bound, fixed, or learned from the steps.
- ``hangwatch``: no progress anywhere for the hang timeout: every rank's stacks, the culprit named.
- ``hang``: reading stack dumps: each rank's innermost user frame, the odd one out, the sentence.
- ``stacks``: a hung host's stacks taken in bounded time: each worker's dump read from its own stderr file.
- ``restart``: job-wide restarts in place: a generation's end, node 0's rules (budget, classes, no progress).
- ``generations``: this host's generations of a restarted job: supervise, tell node 0, start the next one.
- ``ahead``: the next generation, started while the current one trains and held before the script until a restart.
- ``deaths``: when, how and which rank each of torchrun's workers ended, by the kernel's word (a pidfd each).
- ``failuretime``: when a worker failed, by its exit record and its death, and which of two failures came first.
- ``outcome``: how torchrun ended, as the supervisor hands it on.
- ``codes``: the classes of a run's outcome and their exit codes.
- ``oom``: the kernel's OOM-kill counters (the cgroup's, else the machine's): out of memory told apart from a SIGKILL.
- ``failure``: torchrun's evidence: the root cause, the code the worker asked for, the report's text and file.
- ``report``: the verdict: class, exit code (one rule for a torchrun end, ``torchrun_end()``) and report (the job
  watch's cause first, one limit per platform), the no-rendezvous diagnosis, and the outcome file
  (``docs/outcome.schema.json``).
- ``pyz``: the launcher as one file (``ddp-launcher zipapp``, ``make dist``): the zipapp and how it unpacks.
- ``simulate/``: N hosts of a platform as N launcher processes on one machine (``ddp-launcher simulate``).

  - ``simulate/job``: simulate's neutral job description (``Config``, ``Fault``, ``PlatformOptions``),
    which the builders import;
  - ``simulate/config``: simulate's command line and its checks, giving a ``Config``;
    each builder declares and checks its own options.
  - ``simulate/run``: starts the hosts, streams their output, fires the faults.
  - ``simulate/summary``: what happened to each host.
  - ``simulate/netns``: each host its own network namespace (``--network netns``).
  - ``simulate/become``: how a host's first process takes the host's name and files (the one place).
  - ``simulate/slurm_lab``: a real SLURM cluster on this machine (the tests' and ``tools/slurm_lab.py``'s).
  - ``simulate/faults``: the transient faults' deeds (stopped processes, a CPU quota, busy loops).
  - ``simulate/hosts/``: the registry of host builders (``BUILDERS``).
  - ``simulate/hosts/base``: what every builder shares (``HostSpec``, the job environment, the workdir).
  - ``simulate/hosts/kubernetes``: what Kubernetes gives every container, and the job name it takes (both
    Kubeflow builders).
  - ``simulate/hosts/sagemaker``, ``simulate/hosts/sagemaker_env``, ``simulate/hosts/sagemaker_files``,
    ``simulate/hosts/sagemaker_v3``, ``simulate/hosts/sagemaker_groups``: SageMaker hosts (SDK v2
    toolkit and SDK v3; ``--instance-groups``); ``simulate/hosts/sagemaker_options``: SageMaker's options
    and their checks (instance type, channels, hyperparameters and their limits, SDK v3's channels).
  - ``simulate/hosts/slurm``, ``simulate/hosts/pbs``, ``simulate/hosts/kubeflow``,
    ``simulate/hosts/kubeflow_v2``, ``simulate/hosts/vertex``, ``simulate/hosts/oci``,
    ``simulate/hosts/env``: one platform's hosts each.
"""

__version__ = "0.1.0"
