"""Shared test helpers: free ports, the repository's paths, and proof that no process is left."""

from __future__ import annotations

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
    tmp = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if tmp is not None and os.path.isdir(tmp):
        for path in outcome_files(str(tmp)):
            validate_outcome(path)
