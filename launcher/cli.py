"""ddp-launcher (python -m launcher): start one torchrun on this host of a training cluster.

Usage:

    ddp-launcher [options] train.py [script args...]
    ddp-launcher --train-script train.py [--key value ...]  # SageMaker form: AWS's pairs (see options)
    ddp-launcher simulate --hosts 2 [...] -- train.py [script args...]             # see simulate --help
    ddp-launcher bundle train.py --out DIR       # stage what a SageMaker estimator uploads
    ddp-launcher zipapp --out ddp-launcher.pyz   # the launcher as one file (python ddp-launcher.pyz ...)

The launcher runs once on every host. It finds the platform (below), works out the number of nodes,
this node's rank, the master and the processes per node, and starts one torchrun with the script
and its arguments untouched. What it would start, and why, is printed by --dry-run.

Exit codes, by class (launcher/codes.py; the outcome file names the class, see --outcome-file):
  0      success        every worker succeeded
  N      worker_exit    the root-cause worker's own code (sys.exit(N); 1 for an exception), kept when
                        it then crashed in interpreter teardown
  128+N  worker_signal  the root-cause worker died of signal N (not the OOM killer's)
  137    out_of_memory  the kernel's OOM killer killed it (its cgroup's oom_kill count rose meanwhile)
  137    host_lost      another host went silent or vanished (several nodes: the job watch)
  124    hang           no rank made progress for the hang timeout
  93     no_progress    --max-restarts: a restart did not help (the same failure again, no progress)
  75     rendezvous     the hosts never completed the rendezvous
  128+N  stopped        the launcher got signal N and the workers did not finish cleanly (or had
                        not started: it came while the launcher waited for names or files)
  2      bad_input      bad files, variables or options; nothing was started
  70     internal       the launcher's own error
Retry host_lost, rendezvous and stopped; never the others. With several nodes the launchers watch
each other (launcher/jobwatch/): when another host fails, every host exits with that root cause's
code and its report starts with it.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Optional

from launcher import codes, groups, hangtimeout, platforms, report, rundir, streams
from launcher.cluster import Cluster
from launcher.command import (
    build_launch,
    cluster_for,
    job_identity,
    master_port,
    torch_missing,
    watch_ports,
    watch_secret,
)
from launcher.errors import ConfigError, Stopped, shown
from launcher.options import Options, help_text, parse_invocation
from launcher.plan import Plan, Switch
from launcher.platforms.base import Attempt, HostView, look_once
from launcher.report import Clock, Verdict

PROG = "ddp-launcher"
RENDEZVOUS_MARGIN = 10.0  # seconds past --rdzv-timeout before a torchrun with no worker is ended
JOB_MARKER = "DDP_LAUNCHER_JOB"  # in torchrun's environment, so in everything the job starts


def log(message: str) -> None:
    """One line of the launcher's own, on stderr. Never fails (stderr may be closed or a dead pipe)."""
    streams.write(sys.stderr, f"[{PROG}] {message}\n")


def _check_script(script: str) -> None:
    if not os.path.isfile(script):
        raise ConfigError(f"training script not found: {shown(script)} (in {os.getcwd()})")
    if not os.access(script, os.R_OK):
        raise ConfigError(f"training script is not readable: {shown(script)}")


def host_view(options: Options, dev_dir: str = "/dev", sys_dir: str = "/sys") -> HostView:
    """This host as the platforms see it; what the cluster publishes late is waited for up to
    ``--rdzv-timeout`` (with progress lines), and a dry run looks once and does not wait."""
    timeout = float(options.rdzv_timeout)

    def wait(attempt: Attempt, what: str) -> object:
        if options.dry_run:
            return look_once(attempt, what, f"dry run: not waiting; a run waits up to {timeout:g} s")
        from launcher.preflight import wait_for

        return wait_for(attempt, what, timeout)

    return HostView(dev_dir=dev_dir, sys_dir=sys_dir, wait=wait)


def plan(argv: Sequence[str], environ: Mapping[str, str], run_dir: Optional[str] = None) -> Plan:
    """Read the options, the platform's files and variables; decide the launch. Starts nothing.

    The run directory (``$TMPDIR/ddp-launcher-<pid>-<random hex>``) and the job's marker variable
    (``DDP_LAUNCHER_JOB=<pid>-<random hex>``, the same token) are new for every run: no run can
    read an earlier one's files or be mistaken for it. :func:`launcher.rundir.make_run_dir` creates it.
    """
    notes: list[str] = []
    # The detected platform repairs the argv first: a split argv is not AWS's --key value pairs.
    detected = platforms.choose(environ)
    argv = detected.platform.prepare_argv(argv, environ, notes)
    invocation = parse_invocation(argv, environ)
    options = invocation.options
    choice = platforms.choose(environ, options.platform, detected.matches) if options.platform else detected
    host = host_view(options)
    cluster = cluster_for(choice.platform, environ, host, options)
    _check_script(invocation.script)
    outside = groups.outside(cluster)  # a host outside the training world: the script once, no torchrun
    missing = None if outside else torch_missing()
    if missing and not options.dry_run:
        raise ConfigError(missing)
    if missing:
        notes.append(f"{missing}: a run would stop here (exit code 2)")
    if run_dir is None:
        rundir.check_tmpdir(environ)
    token = f"{os.getpid()}-{os.urandom(8).hex()}"
    run_dir = run_dir or rundir.path_for(os.environ, token)
    if outside:
        launch = groups.script_launch(cluster, options, invocation.script, invocation.script_args,
                                      environ, run_dir)
    else:
        launch = build_launch(cluster, invocation.options, invocation.script, invocation.script_args,
                              environ, run_dir, choice.platform.fabric_env(cluster, host))
    launch = launch._replace(env_changes={**launch.env_changes, JOB_MARKER: token})
    watch, hangs, restarts, verdict = decide(cluster, options)
    if watch.on:  # the watch's settings, checked first
        watch_ports(cluster, options, "0")
        watch_secret(options, environ)
    rule = None
    if restarts.on and not hangs.on:  # progress beats tell a restart whether it helped
        from launcher.progress import BEAT_ENV, beat_address

        if BEAT_ENV not in environ:
            launch = launch._replace(env_changes={**launch.env_changes, BEAT_ENV: beat_address(run_dir)})
    if hangs.on:
        from launcher.platforms.devices import count_gpus

        gpus = count_gpus(host.dev_dir)
        rule = hangtimeout.policy(options.hang_timeout, options.hang_start_timeout, gpus, environ)
        changes, hang_notes = hangtimeout.worker_env(environ, run_dir, gpus)
        launch = launch._replace(env_changes={**launch.env_changes, **changes}, notes=(*launch.notes, *hang_notes))
    grace = invocation.options.grace_period or choice.platform.grace_period
    # torchrun's store client can wait for ever on a port another program holds: a bound, with margin
    bound = options.rdzv_timeout + RENDEZVOUS_MARGIN if cluster.nnodes > 1 and not outside else None
    return Plan(invocation, choice, cluster, launch, grace, tuple(notes) + launch.notes, rule, watch, hangs, restarts,
                verdict, outside, bound)


def decide(c: Cluster, options: Options) -> tuple[Switch, Switch, Switch, Switch]:
    """The job watch, hang detection, job-wide restarts and who names the root cause, for this host, each on or
    off with its reason. Pure."""
    several = groups.watch_place(c)[1] > 1
    if not several:
        watch = Switch(False, "one node: nothing to watch")
    elif options.no_job_watch:
        watch = Switch(False, "off (--no-job-watch): a failed or lost host does not stop the others")
    else:
        watch = Switch(True, "a host that fails, or falls silent, stops every host")
    if options.hang_timeout == 0:
        hangs = Switch(False, "off (--hang-timeout 0)")
    elif c.nnodes > 1 and not watch.on:
        hangs = Switch(False, "off: with several hosts it needs the job watch (--no-job-watch)")
    else:
        hangs = Switch(True, "node 0 decides for every host" if several else "this host decides")
    budget = options.max_restarts
    if not budget:
        restarts = Switch(False, "off (--max-restarts 0)")
    elif groups.outside(c):
        restarts = Switch(False, "off: this host does not train")
    elif groups.training_nodes(c) is not None:
        restarts = Switch(False, "off: only some hosts of this job train (a restart needs every host)")
    elif c.nnodes > 1 and not watch.on:
        restarts = Switch(False, "off: with several hosts they need the job watch (node 0 decides for every host)")
    else:
        restarts = Switch(True, f"up to {budget} job-wide restart(s) in place, after a failure of class "
                                f"{', '.join(options.restart_on)}; the workers resume from their checkpoint")
    if not watch.on:
        verdict = Switch(False, "this host's own failure (no job watch)")
    elif groups.outside(c) or groups.training_nodes(c) is not None:
        verdict = Switch(False, "the first failure the job watch relays (only some hosts train)")
    else:
        verdict = Switch(True, "node 0 names the root cause for every host: the first failure in time that the "
                               "job watch did not cause")
    return watch, hangs, restarts, verdict


def _block(label: str, items: Sequence[str]) -> list[str]:
    return [(f"{label + ':':<11}" if i == 0 else " " * 11) + item for i, item in enumerate(items)]


def _watch_line(p: Plan) -> str:
    if not p.watch.on:
        return p.watch.why
    c, options = p.cluster, p.invocation.options
    ports = "/".join(map(str, watch_ports(c, options, job_identity(c.job_name or "", c.master_addr or "",
                                                                  master_port(c, options), c.nnodes))))
    node, _nnodes, hub = groups.watch_place(c)
    where = f"listens on port {ports}" if node == 0 else f"connects to {hub}:{ports}"
    return f"this host {where} (the first free); a host that fails, or is silent for {options.loss_timeout:g} s, " \
           "stops every host"


def describe(p: Plan, as_json: bool) -> str:
    """The dry run's text: platform and why, evidence, cluster, torchrun argv, environment changes."""
    c = p.cluster
    if as_json:
        return json.dumps({"platform": c.platform, "why": p.choice.why,
                           "matched": {name: list(ev) for name, ev in p.choice.matches},
                           "evidence": list(c.evidence), "cluster": c.to_dict(), "argv": list(p.launch.argv),
                           "env": dict(p.launch.env_changes), "env_removed": list(p.launch.env_removed),
                           "grace_period": p.grace_period, "notes": list(p.notes),
                           "hang_timeout": p.hang.describe() if p.hang else "off",
                           **{name: {"on": switch.on, "why": switch.why} for name, switch in
                              (("job_watch", p.watch), ("hangs", p.hangs), ("restarts", p.restarts),
                                                               ("root_cause", p.verdict))}}, indent=2)
    port = master_port(c, p.invocation.options)
    master = f"{c.master_addr}:{port}" if c.nnodes > 1 else "(standalone)"
    lines = [f"platform:  {c.platform}: {p.choice.why}",
             *_block("matched", [f"{name}: {'; '.join(ev)}" for name, ev in p.choice.matches]),
             *_block("evidence", list(c.evidence)),
             f"cluster:   host {c.current_host}, outside the training world of {c.nnodes} node(s), master {master}"
             if p.outside else
             f"cluster:   host {c.current_host}, node {c.node_rank} of {c.nnodes}, master {master}, "
             f"{c.nproc_per_node} process(es) per node, world size {c.nnodes * c.nproc_per_node}",
             *groups.describe_lines(c),
             f"command:   {shlex.join(p.launch.argv)}",
             *_block("env", [f"{k}={v}" for k, v in p.launch.env_changes.items()]),
             *_block("removed", [f"{k} (inherited; torchrun would read it)" for k in p.launch.env_removed]),
             f"stop:      grace period {p.grace_period:g} s after SIGTERM/SIGINT/SIGHUP",
             f"hangs:     {p.hang.describe() if p.hang else p.hangs.why}",
             f"restarts:  {'on: ' if p.restarts.on else ''}{p.restarts.why}",
             *(["cause:     " + p.verdict.why] if groups.watch_place(c)[1] > 1 else []),
             *_block("watch", [_watch_line(p)] if groups.watch_place(c)[1] > 1 else []),
             *[f"note:      {n}" for n in p.notes]]
    return "\n".join(printable(line) for line in lines)


def printable(line: str) -> str:
    """``line`` with control characters escaped (``\\n``, ``\\x1b``): a value cannot forge a line of output."""
    if line.isprintable():
        return line
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in line)


def run(p: Plan, environ: Mapping[str, str], clock: Optional[Clock] = None) -> int:
    """Start and supervise torchrun; report the outcome. Returns the launcher's exit code.

    The run directory (:func:`launcher.rundir.make_run_dir`) is removed at the end, or by the watchdog
    after it killed the job if the launcher itself is killed. The outcome file is written at the end
    of every run (:mod:`launcher.report`), also when the launcher itself failed.
    """
    clock = clock or Clock(time.time())
    text = ""
    try:
        verdict, clock, text = _run(p, environ, clock)
    except Exception as exc:  # the launcher's own error: said, classed and written down like any other end
        import traceback

        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        streams.write(sys.stderr, trace)
        verdict = Verdict(codes.INTERNAL, codes.INTERNAL_CODE, root_cause=f"{p.cluster.current_host}: the launcher "
                          f"failed (exit code {codes.INTERNAL_CODE})", exception=trace.splitlines()[-1])
    c = p.cluster
    report.deliver(verdict, text, clock, outcome_path(p.invocation.options, p.choice.platform, environ),
                   p.choice.platform.report_path(environ), p.choice.platform.report_limit,
                   (c.current_host, c.node_rank, c.nnodes, c.platform))
    return verdict.code


def _run(p: Plan, environ: Mapping[str, str], clock: Clock) -> tuple[Verdict, Clock, str]:
    from launcher import failure, oom, proctree  # not needed by --dry-run: imported here to keep start-up short
    from launcher.runcontext import Run
    from launcher.supervise import supervise

    c = p.cluster
    for note in p.notes:
        log(note)
    log(f"platform {c.platform}: {p.choice.why}")
    watchdog = proctree.Watchdog(log)  # forked before any pipe exists: it holds none of them
    watch = hangs = None
    try:  # every end from here on removes the run directory (the watchdog does, if this process is killed)
        watchdog.kill_marked(f"{JOB_MARKER}={p.launch.env_changes[JOB_MARKER]}")
        watchdog.remove_dir(p.launch.run_dir)
        options = p.invocation.options
        names = p.choice.platform.names_to_wait_for(c)
        if names:
            from launcher.preflight import wait_for_names

            try:
                wait_for_names(names, options.resolve, float(options.rdzv_timeout), log)
            except ConfigError as exc:
                streams.write(sys.stderr, f"{PROG}: error: {exc}\n")
                return Verdict(codes.BAD_INPUT, codes.BAD_INPUT_CODE, root_cause=str(exc)), clock, ""
            except Stopped as exc:
                verdict = _stopped(exc, c.current_host)
                return verdict, clock, verdict.root_cause
        if p.outside:
            log(f"{c.platform} host {c.current_host}: group {c.role.group}, outside the training world "  # type: ignore[union-attr]
                f"(master {c.master_addr}): running the script once; {shlex.join(p.launch.argv)}")
        else:
            log(f"{c.platform} host {c.current_host}: node {c.node_rank} of {c.nnodes}, "
                f"{c.nproc_per_node} process(es) per node; {shlex.join(p.launch.argv)}")
        if p.watch.on:
            from launcher import jobwatch  # several nodes only

            watch = jobwatch.for_cluster(c, options, log, watch_secret(options, environ))
        if p.hang is not None:  # several hosts: node 0 decides
            from launcher import hangwatch

            log(f"hang timeout: {p.hang.describe()}")
            hangs = hangwatch.for_cluster(c, p.hang, p.launch.run_dir, log, watch,
                                          worker_env=p.launch.environment(environ), remake=[p.launch.exit_dir])
        elif options.hang_timeout != 0:
            log(f"hang detection {p.hangs.why}")
        if options.max_restarts and not p.outside:
            log(f"restarts {'on: ' if p.restarts.on else ''}{p.restarts.why}")
        run = Run(p, environ, log, watchdog, watch, hangs)
        memory = oom.snapshot()  # the kernel's OOM-kill count before: a worker's SIGKILL is then told apart
        clock = clock._replace(torchrun=time.time())
        if p.restarts.on or p.verdict.on:  # node 0 decides at the end of each generation (one, without restarts)
            from launcher.generations import run_generations

            outcome, run, last = run_generations(run)
            hangs = run.hangs
        else:
            last = None
            outcome = supervise(run, p.launch)
        if hangs is not None:
            hangs.close()  # a hang being decided is finished first
        clock = clock._replace(first_worker=failure.first_worker_start(p.launch.exit_dir))
        if last is not None:
            memory = last.memory  # the last generation's count before it started
        verdict, text = report.judge(run, outcome, memory)
        if last is not None:
            verdict, text = last.verdict(verdict, text, p.choice.platform.report_limit or report.DEFAULT_LIMIT, log)
        if p.outside and verdict.code == 0 and watch is not None and watch.training_ended:
            log("the training world has ended and this host's script with it")
        elif verdict.code == 0 and outcome.stop_signal is not None:
            log("stopped by a signal; every worker finished cleanly")
        return verdict, clock, text
    finally:
        if watch is not None:
            watch.close()
        if hangs is not None:
            hangs.close()
        import shutil  # only at the end

        shutil.rmtree(p.launch.run_dir, ignore_errors=True)
        watchdog.release()
        proctree.reap_children()


def outcome_path(options: Optional[Options], platform: Optional[platforms.Platform],
                 environ: Mapping[str, str]) -> Optional[str]:
    """Where the outcome file goes: ``--outcome-file``, else the platform's place (None: nowhere)."""
    if options is not None and options.outcome_file:
        return options.outcome_file
    return platform.outcome_path(environ) if platform is not None else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line. Returns the exit code."""
    streams.ensure_standard_fds()
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:
        streams.settle_output()


def _main(args: list[str]) -> int:
    if args and args[0] == "simulate":
        from launcher.simulate import main as simulate_main

        return simulate_main(args[1:])
    if args and args[0] == "bundle":
        from launcher.platforms.sagemaker.bundle import main as bundle_main

        return bundle_main(args[1:])
    if args and args[0] == "zipapp":
        from launcher.pyz import main as pyz_main

        return pyz_main(args[1:])
    if args and args[0] in ("-h", "--help"):
        streams.write(sys.stdout, help_text(__doc__, platforms.help_rows(), platforms.argv_help()) + "\n")
        return 0
    environ = dict(os.environ)
    clock = Clock(time.time())
    try:
        p = plan(args, environ)
        held = None if p.invocation.options.dry_run else rundir.make_run_dir(p.launch.run_dir)
    except ConfigError as exc:
        streams.write(sys.stderr, f"{PROG}: error: {exc}\n")
        _early_outcome(args, environ, Verdict(codes.BAD_INPUT, codes.BAD_INPUT_CODE, root_cause=str(exc)), clock)
        return codes.BAD_INPUT_CODE
    except Stopped as exc:  # during a wait for the cluster's files: nothing was made yet
        streams.write(sys.stderr, f"{PROG}: {exc}\n")
        verdict = _stopped(exc, None)
        _early_outcome(args, environ, verdict, clock)
        return verdict.code
    if held is None:
        streams.write(sys.stdout, describe(p, p.invocation.options.json) + "\n")
        return 0
    try:
        return run(p, environ, clock)
    finally:
        os.close(held)  # the run directory's lock, once the directory is gone


def _stopped(exc: Stopped, host: Optional[str]) -> Verdict:
    """The verdict of a launch stopped before torchrun started: class ``stopped``, exit code 128 + N."""
    from launcher.failure import signal_name

    code = 128 + exc.signum
    return Verdict(codes.STOPPED, code, signal=signal_name(exc.signum),
                   root_cause=f"{host + ': ' if host else ''}{exc} (exit code {code})")


def _early_outcome(args: Sequence[str], environ: Mapping[str, str], verdict: Verdict, clock: Clock) -> None:
    """The outcome file of a run that ended before it had a plan (bad input, a stop while waiting), where
    it can still be placed: ``--outcome-file`` if the options parse, else ``LAUNCHER_OUTCOME_FILE``, else
    the detected platform's place."""
    platform = options = None
    try:
        platform = platforms.choose(environ).platform
        options = parse_invocation(platform.prepare_argv(args, environ, []), environ).options
    except ConfigError:
        pass
    path = outcome_path(options, platform, environ) if options else (
        environ.get("LAUNCHER_OUTCOME_FILE") or (platform.outcome_path(environ) if platform else None))
    if path:  # silently: the end was said in one line
        verdict = verdict._replace(root_cause=verdict.root_cause.split("\n", 1)[0])
        report.write_outcome(path, report.outcome_data(verdict, clock._replace(ended=time.time()), None, None,
                                                       None, platform.name if platform else None))
