"""Shared test helpers: free ports, the repository's paths, and proof that no process is left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import IO, Optional

import pytest

from launcher.cluster import Cluster
from launcher.options import Options, parse_invocation
from launcher.platforms.base import Platform

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
TRAIN_SCRIPTS = os.path.join(REPO, "train_scripts")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (an exited process nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def assert_gone(pids: Iterable[int], within: float = 10.0) -> float:
    """Wait until none of ``pids`` is alive; fail naming the survivors. Returns the wait."""
    pids = [int(p) for p in pids]
    assert pids, "no PIDs were recorded: the test cannot prove that nothing is left"
    start = time.monotonic()
    while True:
        alive = [p for p in pids if is_alive(p)]
        if not alive:
            return time.monotonic() - start
        if time.monotonic() - start > within:
            pytest.fail(f"processes still alive {within} s later: {alive}")
        time.sleep(0.05)


def resolve_cluster(environ: Mapping[str, str], options: Optional[Options] = None, dev_dir: str = "/nonexistent",
                    hostname: str = "", platform: Optional[Platform] = None) -> Cluster:
    """The cluster as the launcher reads it: the platform (``platform``, else ``--platform``, else
    detected) reads ``environ`` on a host with devices in ``dev_dir``, then the options apply."""
    from launcher import cli, command, platforms

    options = options or parse_invocation(["train.py"], {}).options
    chosen = platform or platforms.choose(environ, options.platform).platform
    host = cli.host_view(options, dev_dir)._replace(hostname=hostname)
    return command.cluster_for(chosen, environ, host, options)


def launcher_env(**extra: str) -> dict[str, str]:
    """The environment for a launcher started by a test: the repository importable, no SM_* leaks."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SM_", "LAUNCHER_", "SAGEMAKER_", "TORCHELASTIC_", "PET_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class LiveProcess:
    """A process started by a test, its stdout and stderr read line by line as they come.

    Subclasses say how to end it when a test gives up on it (:meth:`abort`).
    """

    def __init__(self, argv: list[str], cwd: str, env: Optional[dict[str, str]] = None) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=str(cwd), env=env if env is not None else launcher_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream: IO[bytes], lines: list[str]) -> None:
        for raw in iter(stream.readline, b""):
            lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    @property
    def stdout(self) -> str:
        return "\n".join(self.out)

    @property
    def stderr(self) -> str:
        return "\n".join(self.err)

    def abort(self) -> None:
        """End the process tree after a test gave up on it."""
        raise NotImplementedError

    def wait_for(self, text: str, timeout: float = 90.0) -> None:
        """Block until a line of stdout contains ``text``; abort and fail if it never comes."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self.out)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                if self.proc.poll() is None:
                    self.abort()
                pytest.fail(f"never saw {text!r}; output:\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}")
            time.sleep(0.02)

    def join_readers(self) -> None:
        for reader in self.readers:
            reader.join(timeout=10)


# --- Tiers: what a test starts decides its marker ------------------------------------------------------------
# ``make test-fast`` runs the tests that start no real training job, lab or notebook
# (``-m "not job and not lab and not notebook"``). A test marks what it starts; the guard below samples the
# processes every test starts and fails a test that started one of these without its marker, so a slow test
# cannot slip into the fast tier unseen.
TIERS = {
    "job": "starts a real training job: torchrun (python -m torch.distributed.run) or a script of train_scripts/",
    "lab": "starts a lab: the SLURM cluster (slurmctld, slurmd) or simulated hosts in network namespaces",
    "notebook": "executes a notebook in a Jupyter kernel",
}
_TAG = "DDP_LAUNCHER_TEST_TAG"  # inherited by what a test starts, so the guard knows whose process it sees
_SAMPLE_EVERY = 0.2  # s: torchrun and a training script import torch (seconds); a kernel, slurmd or the lab live longer


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def _tiers_of(argv: list[bytes]) -> set[str]:
    """The tiers a process with this command line belongs to (empty: none)."""
    words = [os.path.basename(a) for a in argv[:1]] + argv[1:]
    found = set()
    if b"torch.distributed.run" in argv or any(b"/train_scripts/" in a and a.endswith(b".py") for a in argv[1:3]):
        found.add("job")
    if words and words[0] in (b"slurmctld", b"slurmd"):
        found.add("lab")
    if argv[-1:] == [b"hold"] and any(a.endswith(b"netns.py") for a in argv):  # the network lab's holder
        found.add("lab")
    if any(b"ipykernel" in a for a in argv):
        found.add("notebook")
    return found


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return int(stat[stat.rfind(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _tag_of(pid: int) -> Optional[bytes]:
    """The test tag a process was started with (``_TAG=value``), or None (none, or unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            entries = fh.read().split(b"\0")
    except OSError:
        return None
    prefix = _TAG.encode() + b"="
    return next((e[len(prefix):] for e in entries if e.startswith(prefix)), None)


# This pytest process as /proc names it (os.getpid() differs where pytest runs in a PID namespace of its own
# under the machine's /proc), and a value no other pytest process can have: the tests' tags start with it.
_ME = int(os.readlink("/proc/self"))
_SESSION = f"{os.getpid()}-{os.urandom(6).hex()}"


def _started_by(pid: int, tag: bytes, me: int = _ME, session: str = _SESSION) -> bool:
    """True if the test whose tag is ``tag`` started ``pid``.

    The process, then each of its ancestors in turn: one that carries the tag, or this pytest process
    itself, says yes (a process that cleared its environment still descends from its test; a daemon that
    left the tree keeps its tag). One that carries another tag of this session says no: an earlier test
    left it running here (a module's lab, a thread), and what it starts is not this test's. Tags of other
    pytest processes (a pytest that a test started) are walked through; a process of another user, or one
    that neither descends from us nor carries our tag (another lab on the machine), is not ours.
    """
    own_session = session.encode() + b":"
    for _ in range(64):
        if pid <= 0:
            return False
        if pid == me:
            return True
        found = _tag_of(pid)
        if found == tag:
            return True
        if found is not None and found.startswith(own_session):
            return False
        pid = _parent(pid)
    return False


def left_running(me: int = _ME, session: str = _SESSION) -> list[int]:
    """The live processes this pytest run started: every process below ``me`` and every one carrying a tag
    of ``session`` (a daemon that left the tree keeps its tag). One that left the tree and cleared its
    environment cannot be told from another user's and is not counted."""
    own_session = session.encode() + b":"
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = ancestor = int(entry.name)
        for _ in range(64):
            tag = _tag_of(ancestor)
            if ancestor == me or (tag is not None and tag.startswith(own_session)):
                if is_alive(pid):
                    found.append(pid)
                break
            ancestor = _parent(ancestor)
            if ancestor <= 0:
                break
    return sorted(found)


@pytest.fixture(scope="session", autouse=True)
def nothing_outlives_the_tests():
    """After the last test and every other fixture's tear-down (a module's kernel, server or lab): nothing that
    this run started still runs. Each test proves its own processes gone; this catches what a fixture or a
    library kept (a kernel nbclient did not shut down lived until pytest exited). Fails naming them."""
    yield
    deadline = time.monotonic() + 10
    while (left := left_running()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        lines = []
        for pid in left:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    argv = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
                lines.append(f"{pid}: {argv[:200]}")
            except OSError:
                lines.append(f"{pid}: (gone while read)")
        pytest.fail("processes this test run started outlived every test and fixture:\n" + "\n".join(lines))


class TierGuard:
    """Samples the processes a test starts, in a thread, and keeps the tiers they belong to."""

    def __init__(self, tag: str) -> None:
        self.tag = tag.encode()  # the value of _TAG that this test's processes inherit
        self.found: dict[str, str] = {}  # tier -> one command line that shows it
        self.checked: set[int] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in self.checked:
                continue
            pid = int(entry.name)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    argv = fh.read().split(b"\0")[:-1]
            except OSError:
                continue
            tiers = _tiers_of(argv)
            if not tiers:
                continue
            self.checked.add(pid)
            if _started_by(pid, self.tag):
                for tier in tiers:
                    self.found.setdefault(tier, b" ".join(argv).decode("utf-8", "replace")[:200])

    def _run(self) -> None:
        while not self.stop.wait(_SAMPLE_EVERY):
            self._sample()

    def __enter__(self) -> TierGuard:
        # What already runs belongs to an earlier test (a module-scoped kernel or lab descends from pytest
        # too): only processes started from now on are this test's.
        self.checked = {int(e.name) for e in os.scandir("/proc") if e.name.isdigit()}
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.stop.is_set():
            self.stop.set()
            self.thread.join()
            self._sample()


_guards: dict[str, TierGuard] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]):
    """Run the test (set-up, call, tear-down) under a :class:`TierGuard`; its tear-down report says
    whether the test started something its markers do not admit (:func:`pytest_runtest_makereport`)."""
    tag = f"{_SESSION}:{item.nodeid}"
    os.environ[_TAG] = tag
    with TierGuard(tag) as _guards[item.nodeid]:
        yield
    os.environ.pop(_TAG, None)
    _guards.pop(item.nodeid, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """After tear-down: fail a test that started a job, lab or notebook without that marker."""
    outcome = yield
    guard = _guards.get(item.nodeid)
    if call.when != "teardown" or guard is None:
        return
    guard.__exit__()
    marked = {t for t in TIERS if item.get_closest_marker(t)}
    record = os.environ.get("DDP_LAUNCHER_TEST_TIERS")  # a file: one JSON line per test (how the marks were found)
    if record:
        with open(record, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"test": item.nodeid, "tiers": sorted(guard.found), "marked": sorted(marked)}) + "\n")
    # A test with any tier mark is already outside make test-fast: an incomplete set of marks only narrows
    # `-m job|lab|notebook` selections, so it is failed only where it would slip into the fast tier.
    missing = {} if marked else {t: argv for t, argv in guard.found.items() if t not in marked}
    report = outcome.get_result()
    if missing and report.outcome == "passed" and not record:
        report.outcome = "failed"
        report.longrepr = "\n".join(
            f"started {argv!r} but is not marked {t!r} ({TIERS[t]}): add @pytest.mark.{t} "
            f"(make test-fast must not run it)" for t, argv in sorted(missing.items()))


def installed_here(cwd: str) -> str:
    """What this environment has installed of the project, seen from ``cwd`` outside the checkout: where
    ``import launcher`` finds it and which distribution the environment holds (or why neither)."""
    probe = ("import importlib.metadata as m\n"
             "try:\n    import launcher; print(launcher.__file__)\nexcept ImportError as e: print(e)\n"
             "try:\n    d = m.distribution('ddp-launcher'); print(d.version, d._path)\n"
             "except m.PackageNotFoundError as e: print('not installed', e)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", probe], env=env, cwd=cwd, capture_output=True, text=True,
                          check=True).stdout


_installed_at_start: Optional[str] = None


def pytest_sessionstart(session: pytest.Session) -> None:
    """Note what the environment has installed of the project (once: not in xdist's workers)."""
    global _installed_at_start
    if not hasattr(session.config, "workerinput"):
        _installed_at_start = installed_here(os.path.dirname(REPO))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if the project was installed in this environment when it started and is no longer, or
    is another copy now (a test that uninstalled or replaced it). One installed meanwhile is not a test's doing."""
    if _installed_at_start is None or "not installed" in _installed_at_start:
        return
    now = installed_here(os.path.dirname(REPO))
    if now != _installed_at_start:
        session.config.get_terminal_writer().line(
            f"the tests changed what this environment has installed of the project:\nbefore: "
            f"{_installed_at_start}after: {now}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


OUTCOME_SCHEMA = os.path.join(REPO, "docs", "outcome.schema.json")


def outcome_files(root: str) -> list[str]:
    """Every outcome file under ``root``: ``outcome.json`` (SageMaker's default place) or ``*.outcome.json``."""
    found = []
    for directory, _dirs, files in os.walk(root):
        found += [os.path.join(directory, f) for f in files if f == "outcome.json" or f.endswith(".outcome.json")]
    return found


def validate_outcome(path: str) -> dict:
    """The outcome file at ``path``, checked against docs/outcome.schema.json (fails the test if it is not)."""
    import json

    import jsonschema  # the tests' requirement; the launcher itself is stdlib only

    with open(OUTCOME_SCHEMA) as fh:
        schema = json.load(fh)
    with open(path) as fh:
        data = json.load(fh)
    try:
        jsonschema.validate(data, schema)
    except jsonschema.ValidationError as exc:
        pytest.fail(f"{path} does not match docs/outcome.schema.json: {exc.message}")
    return data


@pytest.fixture(autouse=True)
def every_outcome_file_matches_the_schema(request: pytest.FixtureRequest):
    """After every test that used ``tmp_path``: every outcome file its real runs wrote is valid."""
    yield
    tmp = (getattr(request.node, "funcargs", None) or {}).get("tmp_path")
    if tmp is not None and os.path.isdir(tmp):
        for path in outcome_files(str(tmp)):
            validate_outcome(path)
