"""No process is left however the launcher (or simulate) ends, and a stop stops, also with restarts.

Each test records the PIDs of the job (launcher, torchrun, workers, their daemons and orphans) and the
job's marker variable, then proves with ``assert_gone`` and a ``/proc`` scan that none of them is left,
and that the run directory is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Optional

import pytest
from conftest import PYTHON, REPO, assert_gone, free_port, is_alive, launcher_env
from test_launcher_processes import make_host, records, wait_for_records
from test_simulate import SCRIPT as ALLREDUCE
from test_simulate import Simulate, ancestors_of_test, processes_inside, rank_records

from launcher import cli, codes, proctree, rundir
from launcher.errors import ConfigError

WORKER = os.path.join(REPO, "tests", "scripts", "launcher_worker.py")
FORKING = os.path.join(REPO, "tests", "scripts", "forking_worker.py")
HANG_WORKER = os.path.join(REPO, "tests", "scripts", "hang_worker.py")
LONG_RUN = ["--steps", "100000", "--step-sleep", "0.05"]
STUBBORN = """import json, os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
json.dump({'rank': int(os.environ['RANK']), 'pid': os.getpid(), 'ppid': os.getppid(), 'steps_done': 1},
          open(os.path.join(os.environ['WORKER_RECORD_DIR'], 'rank%s.json' % os.environ['RANK']), 'w'))
time.sleep(600)
"""


STARTED: list[int] = []  # the launchers and simulates a test started


@pytest.fixture(autouse=True)
def end_what_a_failed_test_left():
    """A test that fails half-way leaves its job running: kill its trees by PID (watchdogs end theirs)."""
    yield
    for pid in STARTED:
        if is_alive(pid):
            proctree.kill_tree([pid])
    STARTED.clear()


def start(base, args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=None, **env):
    """A one-host launcher in a session of its own (so a test can kill its process group)."""
    environ = launcher_env(SAGEMAKER_BASE_DIR=str(base), WORKER_RECORD_DIR=str(base / "records"),
                           LAUNCHER_MASTER_PORT=str(free_port()), LAUNCHER_RESOLVE="algo-1=127.0.0.1", **env)
    proc = subprocess.Popen([PYTHON, "-m", "launcher", "--nproc-per-node", "2", *args], env=environ,
                            cwd=str(base), stdout=stdout, stderr=stderr, start_new_session=True,
                            preexec_fn=preexec_fn)
    STARTED.append(proc.pid)
    return proc


def proc_environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return []


def markers_of(pid: int) -> list[bytes]:
    """The job markers in a process's environment (the launcher's, simulate's)."""
    return [e for e in proc_environ(pid) if e.startswith((b"DDP_LAUNCHER_JOB=", b"DDP_LAUNCHER_SIMULATION="))]


def with_marker(marker: bytes) -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and marker in proc_environ(int(n))
            and is_alive(int(n))]


def stat_of(pid: int) -> Optional[list[str]]:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()


def children(pid: int, state: Optional[str] = None) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        fields = stat_of(int(name)) if name.isdigit() else None
        if fields and int(fields[1]) == pid and (state is None or fields[0] == state):
            found.append(int(name))
    return found


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def run_dir_of(torchrun: int) -> str:
    """The run directory, from torchrun's ``--log-dir <run dir>/logs``."""
    with open(f"/proc/{torchrun}/cmdline", "rb") as fh:
        argv = fh.read().decode().split("\0")
    return os.path.dirname(argv[argv.index("--log-dir") + 1])


class Job:
    """What a running job consists of, read from its records and /proc before it is ended."""

    def __init__(self, launcher: int, base) -> None:
        found = records(base)
        self.launcher = launcher
        self.workers = sorted(r["pid"] for r in found.values())
        self.torchrun = sorted({r["ppid"] for r in found.values()})
        assert len(self.torchrun) == 1, found
        self.markers = sorted({m for w in self.workers for m in markers_of(w)})
        assert any(m.startswith(b"DDP_LAUNCHER_JOB=") for m in self.markers), self.markers
        self.run_dir = run_dir_of(self.torchrun[0])
        self.watchdogs = [c for c in children(launcher) if comm(c) == "ddp-watchdog"]
        assert len(self.watchdogs) == 1, children(launcher)

    def assert_nothing_left(self, extra: tuple[int, ...] = ()) -> float:
        waited = assert_gone([self.launcher, *self.torchrun, *self.workers, *self.watchdogs, *extra])
        for marker in self.markers:
            assert with_marker(marker) == [], marker
        deadline = time.monotonic() + 5
        while os.path.exists(self.run_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(self.run_dir), self.run_dir
        return waited


# ------------------------------------------------------------------------------------------------
# Killed from outside: the launcher's whole process group, simulate's, the launcher alone
# ------------------------------------------------------------------------------------------------

@pytest.mark.job
def test_group_sigkill_of_the_launcher_leaves_nothing(tmp_path):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    proc = start(base, [WORKER, *LONG_RUN])
    wait_for_records(base, 2, timeout=150, steps=1)
    job = Job(proc.pid, base)
    os.killpg(proc.pid, signal.SIGKILL)  # what `timeout -s KILL` and many schedulers do
    proc.communicate(timeout=30)
    waited = job.assert_nothing_left()
    print(f"\nprocess group SIGKILLed: the job was gone {waited:.2f} s later")


@pytest.mark.job
@pytest.mark.lab
def test_group_sigkill_of_simulate_leaves_nothing(tmp_path):
    workdir = str(tmp_path / "job")
    sim = Simulate(["--hosts", "2", "--workdir", workdir, "--", ALLREDUCE, "--steps", "0",
                    "--step-sleep", "0.1"], str(tmp_path))  # in a session of its own
    STARTED.append(sim.proc.pid)
    sim.wait_for("[algo-2] [rank1]:step=2")
    found = rank_records(workdir, 2)
    skip = ancestors_of_test() | {sim.proc.pid}
    pids = {p for recs in found.values() for r in recs for p in [r["pid"], *r["ancestors"]] if p not in skip}
    markers = {m for p in pids for m in markers_of(p)}
    assert {m.split(b"=")[0] for m in markers} == {b"DDP_LAUNCHER_JOB", b"DDP_LAUNCHER_SIMULATION"}
    torchruns = [r["ancestors"][0] for recs in found.values() for r in recs[:1]]
    run_dirs = [run_dir_of(t) for t in torchruns]
    watchdogs = [c for p in pids | {sim.proc.pid} for c in children(p) if comm(c) == "ddp-watchdog"]
    assert len(watchdogs) == 3  # simulate's and each host launcher's
    os.killpg(sim.proc.pid, signal.SIGKILL)
    sim.finish()
    waited = assert_gone([sim.proc.pid, *pids, *watchdogs])
    assert processes_inside(workdir) == []
    for marker in markers:
        assert with_marker(marker) == [], marker
    time.sleep(0.5)
    assert not any(os.path.exists(d) for d in run_dirs), run_dirs
    print(f"\nsimulate's process group SIGKILLed: {len(pids)} processes gone {waited:.2f} s later")


@pytest.mark.job
def test_sigkill_of_the_launcher_takes_a_workers_double_forked_daemon(tmp_path):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    proc = start(base, [FORKING, "daemon"])
    wait_for_records(base, 2, timeout=150)
    deadline = time.monotonic() + 30
    while len(list((base / "records" / "forks").glob("daemon*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    daemons = [json.loads(p.read_text())["pid"] for p in (base / "records" / "forks").glob("daemon*.json")]
    assert len(daemons) == 2 and all(is_alive(d) for d in daemons)
    assert all(d not in children(r["pid"]) for d in daemons for r in records(base).values())  # out of the tree
    job = Job(proc.pid, base)
    proc.kill()
    proc.communicate(timeout=30)
    job.assert_nothing_left(tuple(daemons))


@pytest.mark.job
def test_orphans_are_reaped_while_the_job_runs(tmp_path):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    count = 10
    proc = start(base, [FORKING, "burst", str(count), "--seconds", "6"])
    deadline = time.monotonic() + 40
    while len(list((base / "records" / "forks").glob("orphan*.json"))) < 2 * count and time.monotonic() < deadline:
        time.sleep(0.05)
    orphans = [json.loads(p.read_text()) for p in (base / "records" / "forks").glob("orphan*.json")]
    assert len(orphans) == 2 * count
    assert {o["ppid"] for o in orphans} == {proc.pid}  # they were re-parented to the launcher
    job = Job(proc.pid, base)
    time.sleep(1.5)  # the launcher collects them every 0.5 s
    assert proc.poll() is None, "the job ended too soon to prove anything"
    zombies = children(proc.pid, state="Z")
    assert zombies == [], f"zombie children of the launcher while the job runs: {zombies}"
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    job.assert_nothing_left(tuple(o["pid"] for o in orphans))


# ------------------------------------------------------------------------------------------------
# Standard streams: a dead pipe reader at Ctrl-C, a stream closed from the start
# ------------------------------------------------------------------------------------------------

@pytest.mark.job
@pytest.mark.parametrize("signum,worker_args,expected", [
    (signal.SIGINT, [], 128 + signal.SIGINT),
    (signal.SIGTERM, ["--clean-stop"], 0)], ids=["SIGINT", "SIGTERM-clean-stop"])
def test_stop_signal_with_a_dead_pipe_reader(tmp_path, signum, worker_args, expected):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    read_fd, write_fd = os.pipe()
    proc = start(base, ["--grace-period", "20", WORKER, *LONG_RUN, *worker_args], stdout=write_fd, stderr=write_fd)
    os.close(write_fd)
    wait_for_records(base, 2, timeout=150, steps=1)
    job = Job(proc.pid, base)
    os.close(read_fd)  # `ddp-launcher ... | tee log`: Ctrl-C kills tee first
    os.killpg(proc.pid, signum)  # the terminal's foreground group: the launcher (torchrun has its own)
    assert proc.wait(timeout=60) == expected
    job.assert_nothing_left()
    assert all(r["signals"] == (["SIGTERM"] if signum == signal.SIGTERM else []) for r in records(base).values())


def test_many_stop_requests_reach_the_workers_as_one_sigterm(tmp_path):
    """A hub hears every other host's end as an event of its own and asks again each time: the script gets
    one SIGTERM however often it is asked (a second would run its handler again, mid-checkpoint)."""
    result = subprocess.run([PYTHON, os.path.join(REPO, "tests", "scripts", "stop_requests.py"), str(tmp_path), "20"],
                            env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["returncode"] == 0 and outcome["stop_signal"] == signal.SIGTERM, outcome
    assert (tmp_path / "terms").read_text().splitlines() == ["SIGTERM"]
    assert result.stderr.count("job watch: stop request") == 1, result.stderr  # said once, as it was sent
    assert_gone([outcome["pid"], outcome["watchdog"]])


@pytest.mark.job
@pytest.mark.parametrize("fd", [0, 1, 2], ids=["stdin", "stdout", "stderr"])
def test_a_standard_stream_closed_at_start(tmp_path, fd):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    proc = start(base, [WORKER, "--steps", "3", "--exit-code", "7", "--fail-rank", "1", "--fail-at-step", "1"],
                 preexec_fn=lambda: os.close(fd))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 7, err.decode()[-2000:]
    assert (base / "output" / "failure").read_text().startswith("algo-1: rank 1 (local rank 1) exited with code 7")
    if fd != 2:
        assert "exited with code 7" in err.decode()
    assert_gone([proc.pid, *(p for r in records(base).values() for p in (r["pid"], r["ppid"]))])


# ------------------------------------------------------------------------------------------------
# The run directory: new and private for every run, never reused
# ------------------------------------------------------------------------------------------------

def test_every_run_gets_a_new_private_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    (tmp_path / "train.py").write_text("pass\n")
    env = {"PATH": os.environ.get("PATH", "")}
    plans = [cli.plan(["train.py"], env) for _ in range(3)]
    dirs = {p.launch.run_dir for p in plans}
    markers = {p.launch.env_changes["DDP_LAUNCHER_JOB"] for p in plans}
    assert len(dirs) == 3 and len(markers) == 3  # same PID, still never the same
    assert all(d.startswith(str(tmp_path / f"ddp-launcher-{os.getpid()}-")) for d in dirs)
    assert all(os.path.basename(p.launch.run_dir).endswith(p.launch.env_changes["DDP_LAUNCHER_JOB"])
               for p in plans)
    assert os.listdir(tmp_path) == ["train.py"]  # planning creates nothing
    path = plans[0].launch.run_dir
    os.close(rundir.make_run_dir(path))
    assert os.stat(path).st_mode & 0o777 == 0o700
    with pytest.raises(ConfigError, match="cannot create the run directory"):
        rundir.make_run_dir(path)  # an existing directory is never taken over


def tree(path) -> set[str]:
    """Every entry under ``path``, relative to it."""
    return {os.path.relpath(os.path.join(d, n), path) for d, dirs, files in os.walk(path) for n in dirs + files}


@pytest.mark.job
@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="systemd-tmpfiles not found (Debian's systemd)")
def test_a_tmp_cleaner_leaves_a_running_jobs_run_directory_alone(tmp_path):
    # Fedora and RHEL age /tmp out after 10 days (systemd-tmpfiles-clean.timer), a long job's run directory
    # with it: the workers' logs, their beat socket (hang detection would then see no progress) and exit
    # records. The real systemd-tmpfiles, age 0 over the job's TMPDIR while the job runs: the run directory,
    # locked by the launcher, keeps every entry, and the job ends as it should; a directory beside it that
    # nobody locks is removed by the same clean (the cleaner did run).
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    tmpdir = tmp_path / "tmp"
    (tmpdir / "unlocked" / "sub").mkdir(parents=True)
    conf = tmp_path / "tmpfiles.conf"
    conf.write_text(f"e {tmpdir} - - - 0\n")
    proc = start(base, [WORKER, *LONG_RUN, "--clean-stop"], TMPDIR=str(tmpdir))
    wait_for_records(base, 2, steps=3)
    job = Job(proc.pid, base)
    before = tree(job.run_dir)
    assert "exits" in before and any(n.endswith("/0/stdout.log") for n in before), before
    subprocess.run(["systemd-tmpfiles", "--clean", str(conf)], check=True, timeout=60, capture_output=True)
    assert not (tmpdir / "unlocked").exists()
    assert tree(job.run_dir) >= before, (before, tree(job.run_dir))
    cleaned_at = max(r["steps_done"] for r in records(base).values())
    wait_for_records(base, 2, steps=cleaned_at + 2)  # the job trains on after the clean
    os.killpg(proc.pid, signal.SIGTERM)  # the workers save and exit 0 (--clean-stop)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-3000:]
    job.assert_nothing_left()
    assert os.listdir(tmpdir) == []


def trains_on_then_stops(proc, base, steps: int) -> str:
    """Wait until every rank of a ``--clean-stop`` job has done ``steps`` while its launcher still runs (a hang
    would end it first), then stop it with SIGTERM; it must exit 0. Its stderr."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if min(r["steps_done"] for r in records(base).values()) >= steps:
            break
        time.sleep(0.1)
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)[1].decode()[-3000:]
    os.killpg(proc.pid, signal.SIGTERM)  # the workers save and exit 0 (--clean-stop)
    _out, err = proc.communicate(timeout=60)
    said = err.decode()
    assert proc.returncode == 0, said[-3000:]
    return said


@pytest.mark.job
def test_a_stop_that_comes_while_a_hangs_stacks_are_taken_reaches_the_workers_after_them(tmp_path):
    # A platform's SIGTERM (a spot interruption, a time limit) that came as the hang watch took the stacks was
    # passed on at once: SIGTERM's default action ended each worker, frozen or not, in the middle of its dump, and
    # the hang was reported with no stack. Sent here the moment the first worker's sampler holds still (the
    # freeze has begun), it is held until the stacks are read: the report names rank 1 at its read, rank 0 is
    # in its all-reduce, and the job ends as a hang (124), nothing left.
    from test_hang_jobs import line_of

    base = make_host(tmp_path, "algo-1", ["algo-1"])
    proc = start(base, ["--hang-timeout", "5", HANG_WORKER, "--mode", "read", "--rank", "1"],
                 HANG_RECORD_DIR=str(base / "records"))
    deadline = time.monotonic() + 150
    while len(records(base)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = sorted(r["pid"] for r in records(base).values())
    assert len(workers) == 2, proc.communicate(timeout=60)[1].decode()[-3000:] if proc.poll() is not None else ""
    torchrun = sorted({int((stat_of(pid) or ["", "0"])[1]) for pid in workers})
    assert len(torchrun) == 1 and torchrun[0] != proc.pid, (workers, torchrun)
    exits = os.path.join(run_dir_of(torchrun[0]), "exits")
    deadline = time.monotonic() + 120
    while not any(name.endswith(".parked") for name in os.listdir(exits)) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    said = err.decode()
    report = (base / "output" / "failure").read_text()
    assert proc.returncode == codes.HANG_CODE, said[-4000:]
    assert "received SIGTERM: forwarding it to the workers once their stacks are taken" in said, said[-4000:]
    assert report.startswith("hang: ") and f"; rank 1 (algo-1) at hang_worker.py:{line_of('read')} in " in report
    assert f"\nrank 0 (algo-1): hang_worker.py:{line_of('all_reduce')} in main, in all_reduce\n" in report, report
    assert_gone([proc.pid, *torchrun, *workers])


@pytest.mark.job
def test_a_run_directory_removed_under_the_job_is_no_hang(tmp_path):
    # A cleaner that ignores the lock (tmpwatch, a cron `find -delete`, a hand) removes the whole run directory
    # while the job trains. The workers send their progress beats to the socket's path there: without a new
    # socket no beat would arrive, and the hang watch would stop a healthy job after its timeout. It binds one
    # again (and the exit records' directory) within a second: the job trains on for well over the timeout,
    # then ends as it should, and the run directory made again is removed at the end. (Before: a hang after
    # 11 s, exit 124, and no stack, as the workers' logs had gone with the directory.)
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    tmpdir = tempfile.mkdtemp(prefix="ddp-test-")  # short: a UNIX socket's path has at most 107 bytes
    try:
        proc = start(base, ["--hang-timeout", "10", WORKER, *LONG_RUN, "--clean-stop"], TMPDIR=tmpdir)
        wait_for_records(base, 2, steps=100)  # 5 s of steps: the sampler has sent a step (the start's bound is over)
        job = Job(proc.pid, base)
        shutil.rmtree(job.run_dir)
        removed_at = max(r["steps_done"] for r in records(base).values())
        said = trains_on_then_stops(proc, base, removed_at + 300)  # 300 steps of 0.05 s: 15 s at the least
        assert f"progress beats: {job.run_dir}/progress.sock was removed (a /tmp cleaner?): bound again" in said, said
        assert "hang:" not in said, said[-3000:]
        job.assert_nothing_left()
        assert [n for n in os.listdir(tmpdir) if n.startswith("ddp-launcher-")] == []  # (torch keeps a cache there)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.job
def test_a_tmpdir_too_long_for_a_socket_path_still_hears_a_silent_job(tmp_path):
    # A TMPDIR of 80 characters: the beat socket's path would pass a UNIX socket's 107 bytes, so it gets a name
    # in the abstract namespace. The workers print nothing while they train: the sampler's beats are all the
    # progress there is. The job trains well past the start's bound and the hang timeout, then ends as it
    # should. (Before: "progress beats off", and a hang at the end of the start's bound, exit 124.)
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    tmpdir = tmp_path / ("t" * max(1, 80 - len(str(tmp_path)) - 1))
    tmpdir.mkdir()
    proc = start(base, ["--hang-timeout", "10", "--hang-start-timeout", "10", WORKER, *LONG_RUN, "--clean-stop"],
                 TMPDIR=str(tmpdir))
    wait_for_records(base, 2, steps=3)
    job = Job(proc.pid, base)
    assert sorted(os.listdir(job.run_dir)) == ["exits", "logs"]  # no socket file: its name is abstract
    said = trains_on_then_stops(proc, base, 400)  # 400 steps of 0.05 s: 20 s at the least
    assert "hang:" not in said and "progress beats off" not in said, said[-3000:]
    job.assert_nothing_left()


def test_a_run_directory_that_cannot_be_made_is_bad_input(tmp_path):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = start(base, [WORKER], TMPDIR=str(blocker))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == b""
    lines = err.decode().splitlines()
    # plan() checks TMPDIR first; make_run_dir() catches what that check cannot (a race, a full disk)
    assert len(lines) == 1 and str(blocker) in lines[0], lines
    assert "TMPDIR is not a directory" in lines[0] or "cannot create the run directory" in lines[0], lines
    assert records(base) == {}


def test_only_a_killed_launchers_unlocked_run_directory_is_removed_after_it(tmp_path):
    """What simulate does after a host's power loss (tests/test_simulate_netns.py shows it on a real one):
    the dead launchers' run directories go; a locked one (a launcher running now with a reused pid), one of
    another pid, the zipapp's cache, a link and a file of the same name, and what a link points to stay."""
    hex16 = "0123456789abcdef"
    dead = tmp_path / f"ddp-launcher-111-{hex16}"
    (dead / "exits").mkdir(parents=True)
    (dead / "exits" / "5.json").write_text("{}")
    held = rundir.make_run_dir(str(tmp_path / f"ddp-launcher-222-{hex16}"))
    other = tmp_path / f"ddp-launcher-333-{hex16}"
    other.mkdir()
    cache = tmp_path / "ddp-launcher-0"  # launcher/pyz.py's, for uid 0
    cache.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / f"ddp-launcher-444-{hex16}").symlink_to(target)
    (tmp_path / f"ddp-launcher-555-{hex16}").write_text("")
    (tmp_path / f"ddp-launcher-111-{hex16}x").mkdir()  # not a run directory's name
    try:
        removed = rundir.remove_dead_run_dirs(str(tmp_path), [0, 111, 222, 444, 555])
        assert removed == [str(dead)]
        assert sorted(os.listdir(tmp_path)) == sorted(
            ["elsewhere", "ddp-launcher-0", f"ddp-launcher-111-{hex16}x", f"ddp-launcher-222-{hex16}",
             f"ddp-launcher-333-{hex16}", f"ddp-launcher-444-{hex16}", f"ddp-launcher-555-{hex16}"])
    finally:
        os.close(held)
    assert rundir.remove_dead_run_dirs(str(tmp_path), [222]) == [str(tmp_path / f"ddp-launcher-222-{hex16}")]
    assert rundir.remove_dead_run_dirs(str(tmp_path / "missing"), [1]) == []


# ------------------------------------------------------------------------------------------------
# A stop with restarts stops: no new generation of workers
# ------------------------------------------------------------------------------------------------

class ChildWatcher:
    """Every PID that was ever a child of ``pid`` (sampled every 10 ms until stopped)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.seen, self.done = pid, set(), threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.is_set():
            self.seen.update(children(self.pid))
            time.sleep(0.01)

    def stop(self) -> set[int]:
        self.done.set()
        self.thread.join()
        return self.seen


@pytest.mark.job
@pytest.mark.parametrize("workers", ["clean-stop", "die", "ignore"])
def test_a_stop_with_restarts_starts_no_new_generation(tmp_path, workers):
    base = make_host(tmp_path, "algo-1", ["algo-1"])
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    args = {"clean-stop": [WORKER, *LONG_RUN, "--clean-stop"], "die": [WORKER, *LONG_RUN],
            "ignore": [str(script)]}[workers]
    proc = start(base, ["--max-restarts", "2", "--grace-period", "3" if workers == "ignore" else "20", *args])
    wait_for_records(base, 2, timeout=150)
    job = Job(proc.pid, base)
    watcher = ChildWatcher(job.torchrun[0])
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    stopped = time.monotonic()
    _out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - stopped
    seen = watcher.stop()
    assert seen == set(job.workers), f"torchrun started other workers after the stop: {seen - set(job.workers)}"
    assert {r["pid"] for r in records(base).values()} == set(job.workers)
    expected = 0 if workers == "clean-stop" else 128 + signal.SIGTERM
    assert proc.returncode == expected, err.decode()[-3000:]
    if workers == "clean-stop":
        assert "every worker finished cleanly" in err.decode()
        assert not (base / "output" / "failure").exists()
    else:
        assert (base / "output" / "failure").read_text().startswith("algo-1: stopped by SIGTERM")
    job.assert_nothing_left()
    print(f"\n--max-restarts 2, workers {workers}: the launcher exited {elapsed:.2f} s after SIGTERM, "
          f"code {proc.returncode}, {len(seen)} worker(s) ever")
