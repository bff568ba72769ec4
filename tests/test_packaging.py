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
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--prefix", str(prefix), REPO], check=True, capture_output=True, cwd=str(tmp_path))
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
