"""`pip install .` gives the `ddp-launcher` command and `python -m launcher`, with no dependencies."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from conftest import REPO


def test_pip_install_gives_a_working_command(tmp_path):
    prefix = tmp_path / "prefix"
    # --ignore-installed: without it pip first uninstalls the copy installed in this environment (make demo's
    # editable install in .venv), and the environment would be left without the project. pip says when it
    # uninstalls ("Attempting uninstall", "Successfully uninstalled"); the session check in conftest.py compares
    # the environment before and after the whole run (here, others may change a shared environment meanwhile).
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                           "--ignore-installed", "--prefix", str(prefix), REPO], check=True, capture_output=True,
                          text=True, cwd=str(tmp_path))
    assert "uninstall" not in (done.stdout + done.stderr).lower(), done.stdout
    site = glob.glob(str(prefix / "lib" / "python*" / "site-packages"))[0]
    command = prefix / "bin" / "ddp-launcher"
    assert command.exists()
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": site, "HOME": str(tmp_path)}
    for argv in ([str(command)], [sys.executable, "-m", "launcher"]):
        out = subprocess.run([*argv, "--dry-run", "--json", "--nproc-per-node", "2", "train.py", "--x", "1"],
                             env=env, cwd=str(tmp_path), check=True, capture_output=True, text=True).stdout
        plan = json.loads(out)
        assert plan["platform"] == "local"
        assert plan["argv"][-3:] == ["train.py", "--x", "1"]
    # the installed package is the launcher alone: no tests, scripts or notebooks
    installed = sorted(os.listdir(site))
    assert "launcher" in installed and not {"tests", "train_scripts", "notebooks"} & set(installed)


def _imports(path: str, skip: str = "") -> set[str]:
    """The modules a file imports, anywhere in it but the function named ``skip``."""
    import ast

    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    skipped = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and fn.name == skip
               for node in ast.walk(fn)}
    nodes = [node for node in ast.walk(tree) if id(node) not in skipped]
    found = {node.module for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
    return found | {a.name for node in nodes if isinstance(node, ast.Import) for a in node.names}


def test_the_launcher_imports_only_the_standard_library():
    """The launcher's process imports nothing but the standard library. One import runs elsewhere: a worker of a
    generation started ahead (launcher/ahead.py) imports torch in launcher/bootstrap.py's ``hold``, in the worker's
    process, as its script's first lines would."""
    allowed = set(sys.stdlib_module_names) | {"launcher"}
    bootstrap = os.path.join(REPO, "launcher", "bootstrap.py")
    for path in glob.glob(os.path.join(REPO, "launcher", "**", "*.py"), recursive=True):
        foreign = {m for m in _imports(path, "hold" if path == bootstrap else "") if m.split(".")[0] not in allowed}
        assert not foreign, f"{path} imports {foreign}"
    assert _imports(bootstrap) - _imports(bootstrap, "hold") == {"torch"}


def test_failure_analysis_does_not_depend_on_the_process_supervisor():
    # The report, its root cause and exit code are pure functions of torchrun's outcome and files.
    for name in ("failure.py", "outcome.py", "command.py", "cluster.py"):
        assert not {m for m in _imports(os.path.join(REPO, "launcher", name))
                    if m in ("launcher.supervise", "launcher.proctree", "subprocess")}, name
