"""launcher/simulate/become.py: a process takes a host's name and files, in namespaces of its own only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from launcher.simulate import become

SCRIPT = os.path.join(REPO, "launcher", "simulate", "become.py")
CAN_UNSHARE = os.geteuid() == 0 and shutil.which("unshare") is not None


def machine() -> tuple[str, str]:
    with open("/etc/hosts", encoding="utf-8", errors="replace") as fh:
        return os.uname().nodename, fh.read()


@pytest.mark.parametrize("options", [["--hostname", "not-this-machine"], ["--bind", "/dev/null", "/etc/hosts"],
                                     ["--opt", "/nonexistent", "/nonexistent-stage"]])
def test_outside_namespaces_of_its_own_it_changes_nothing_and_says_so(options: list[str]) -> None:
    before = machine()
    done = subprocess.run([sys.executable, "-I", "-S", SCRIPT, *options, "--", "true"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1 and "namespace of its own" in done.stderr, done.stderr
    assert machine() == before


def test_no_program_is_one_line_and_exit_1() -> None:
    done = subprocess.run([sys.executable, "-I", "-S", SCRIPT, "--hostname", "x"], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, len(done.stderr.splitlines())) == (1, 1), done.stderr
    assert "no program" in done.stderr


@pytest.mark.skipif(not CAN_UNSHARE, reason="needs root and unshare(1)")
def test_in_its_own_namespaces_the_program_is_the_host_with_the_same_pid(tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(become.hosts_file_text("", ["node7", "node8"]))
    before = machine()
    argv = become.command([sys.executable, "-c", "import os; print(os.getpid(), os.uname().nodename); "
                           "print(open('/etc/hosts').read(), end='')"],
                          hostname="node7", binds=[(str(hosts), "/etc/hosts")],
                          prefix=become.unshare_forms("--uts", "--mount")[0])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    first, *rest = out.splitlines()
    assert proc.returncode == 0
    assert first == f"{proc.pid} node7"  # unshare and become exec: the host's PID is the program's
    assert rest == ["127.0.0.1 node7", "127.0.0.1 node8"]
    assert machine() == before
