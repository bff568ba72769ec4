"""The source bundle (launcher/platforms/sagemaker/bundle.py): exactly what a SageMaker estimator must upload.

Exactly: ``launch.py`` + the launcher's ``.py`` files + the script + its helper, byte for byte,
and nothing AWS's toolkit would act on (requirements.txt, setup.py) or that only weighs (caches).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from conftest import PYTHON, REPO, launcher_env

from launcher.platforms.sagemaker import bundle

PACKAGE_DIR = os.path.join(REPO, "launcher")
SCRIPT = "import sys\nprint('METRIC epoch=1 train_loss=0.5', sys.argv[1:])\n"
HELPER = "METRIC_DEFINITIONS = []\n"


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _repo_package_files() -> list[str]:
    """The launcher's .py files as the repository holds them, less simulate/ (walked independently)."""
    found = []
    for root, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = [d for d in dirs
                   if d != "__pycache__" and os.path.join(root, d) != os.path.join(PACKAGE_DIR, "simulate")]
        found += [os.path.relpath(os.path.join(root, f), PACKAGE_DIR) for f in files if f.endswith(".py")]
    return sorted(found)


@pytest.fixture
def scripts(tmp_path):
    """A script directory as train_scripts/ looks: the script, its helper and things not to ship."""
    d = tmp_path / "scripts"
    (d / "__pycache__").mkdir(parents=True)
    (d / "train_x.py").write_text(SCRIPT)
    (d / "ddp_utils.py").write_text(HELPER)
    (d / "requirements.txt").write_text("torch==2.0\n")
    (d / "other_script.py").write_text("print('not shipped')\n")
    (d / "__pycache__" / "ddp_utils.cpython-311.pyc").write_bytes(b"\0" * 64)
    return d


def _expected(script_names, package_files) -> list[str]:
    package = ("launcher/" + p.replace(os.sep, "/") for p in package_files)
    return sorted(["launch.py", *script_names, *package])


def test_contents_exactly_as_expected(scripts, tmp_path):
    dest = tmp_path / "bundle"
    assert bundle.stage_bundle(str(scripts / "train_x.py"), str(dest)) == str(dest)
    listed = bundle.list_bundle(str(dest))
    assert listed == _expected(["train_x.py", "ddp_utils.py"], _repo_package_files())
    # The package as the repository has it, sub-packages included, byte for byte.
    for must in ("launcher/__init__.py", "launcher/cli.py", "launcher/platforms/sagemaker/bundle.py",
                 "launcher/platforms/__init__.py", "launcher/platforms/sagemaker/__init__.py"):
        assert must in listed
    assert not [n for n in listed if n.startswith("launcher/simulate/")]  # never runs inside a job
    for rel in _repo_package_files():
        assert _read(os.path.join(dest, "launcher", rel)) == _read(os.path.join(PACKAGE_DIR, rel)), rel
    assert _read(dest / "train_x.py") == SCRIPT.encode()
    assert _read(dest / "ddp_utils.py") == HELPER.encode()
    assert not [n for n in listed if "requirements" in n or "setup" in n or n.endswith(".pyc")]
    assert sum(os.path.getsize(dest / n) for n in listed) < 700_000  # the launcher's source, uncompressed (602 kB)


def test_without_helper_and_with_extras(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train_y.py").write_text(SCRIPT)
    (src / "model_def.py").write_text("X = 1\n")
    dest = tmp_path / "b"
    bundle.stage_bundle(str(src / "train_y.py"), str(dest), [str(src / "model_def.py")])
    assert bundle.list_bundle(str(dest)) == _expected(["train_y.py", "model_def.py"], _repo_package_files())


def test_the_entry_point_runs_the_launcher_from_the_bundle_alone(scripts, tmp_path):
    """As AWS's toolkit calls it: ``python launch.py --epochs 1 --train-script train_x.py`` in code/."""
    dest = tmp_path / "code"
    bundle.stage_bundle(str(scripts / "train_x.py"), str(dest))
    env = launcher_env(SM_HOSTS='["algo-1","algo-2"]', SM_CURRENT_HOST="algo-2", SM_NUM_GPUS="0",
                       LAUNCHER_DRY_RUN="true", LAUNCHER_JSON="true")
    env.pop("PYTHONPATH")  # the repository is not importable: the bundle must be enough
    proc = subprocess.run([PYTHON, "launch.py", "--epochs", "1", "--train-script", "train_x.py"],
                          cwd=dest, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["platform"] == "sagemaker"
    assert plan["cluster"]["nnodes"] == 2 and plan["cluster"]["node_rank"] == 1
    assert plan["argv"][-3:] == ["train_x.py", "--epochs", "1"]


def test_works_from_an_installed_copy(scripts, tmp_path):
    """pip-install the project elsewhere, then bundle from that copy, away from the repository."""
    src, site = tmp_path / "src", tmp_path / "site"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml"):
        shutil.copy(os.path.join(REPO, name), src / name)
    shutil.copytree(PACKAGE_DIR, src / "launcher", ignore=shutil.ignore_patterns("__pycache__"))
    pip = subprocess.run([PYTHON, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(site), str(src)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    installed = site / "launcher"
    env = launcher_env(PYTHONPATH=str(site))
    out = tmp_path / "out"
    command = [PYTHON, "-m", "launcher", "bundle", str(scripts / "train_x.py"), "--out"]
    proc = subprocess.run([*command, str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    # Running from the installed copy wrote its __pycache__ there; the bundle must not carry it.
    assert (installed / "__pycache__").is_dir()
    files = bundle.package_files(str(installed))
    assert files == _repo_package_files()
    expected = _expected(["train_x.py", "ddp_utils.py"], files)
    assert proc.stdout.split() == bundle.list_bundle(str(out)) == expected
    for rel in files:
        assert _read(out / "launcher" / rel) == _read(installed / rel)
    assert "entry_point='launch.py'" in proc.stderr

    # A bundle directory inside the package it copies is refused, and nothing is written.
    inside = installed / "bundle_here"
    proc = subprocess.run([*command, str(inside)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "inside the launcher package" in proc.stderr
    assert not inside.exists()


def _bad_cases(scripts, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "old").write_text("x")
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "req").mkdir()
    (tmp_path / "req" / "requirements.txt").write_text("torch\n")
    (tmp_path / "dup").mkdir()
    (tmp_path / "dup" / "train_x.py").write_text("x = 1\n")
    (tmp_path / "launch.py").write_text(SCRIPT)
    s = str(scripts / "train_x.py")
    return {
        "missing script": ([str(tmp_path / "nope.py"), "--out", "o"], "training script not found"),
        "script is a directory": ([str(scripts), "--out", "o"], "training script not found"),
        "out not empty": ([s, "--out", str(full)], "not empty"),
        "out is a file": ([s, "--out", str(afile)], "is a file"),
        "missing extra": ([s, "--out", "o", "--extra", "gone.py"], "extra file not found"),
        "requirements.txt": ([s, "--out", "o", "--extra", str(tmp_path / "req" / "requirements.txt")],
                             "pip-install"),
        "name clash": ([s, "--out", "o", "--extra", str(tmp_path / "dup" / "train_x.py")], "two files named"),
        "hides the entry point": ([str(tmp_path / "launch.py"), "--out", "o"], "launch.py"),
        "no --out": ([s], "--out"),
        "unknown option": ([s, "--out", "o", "--bogus"], "--bogus"),
        "no script": ([], "script"),
    }


CASES = ["missing script", "script is a directory", "out not empty", "out is a file", "missing extra",
         "requirements.txt", "name clash", "hides the entry point", "no --out", "unknown option",
         "no script"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exit_2_with_one_line(case, scripts, tmp_path):
    args, needle = _bad_cases(scripts, tmp_path)[case]
    work = tmp_path / "work"
    work.mkdir()
    before = sorted(os.listdir(tmp_path))
    proc = subprocess.run([PYTHON, "-m", "launcher", "bundle", *args], cwd=work, env=launcher_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp-launcher bundle: error: "), proc.stderr
    assert needle in lines[0]
    assert os.listdir(work) == [] and sorted(os.listdir(tmp_path)) == before  # nothing written
    assert os.listdir(tmp_path / "full") == ["old"]


def test_api_refuses_before_writing(scripts, tmp_path):
    dest = tmp_path / "never"
    with pytest.raises(FileNotFoundError):
        bundle.stage_bundle(str(scripts / "missing.py"), str(dest))
    with pytest.raises(bundle.BundleError, match="pip-install"):
        bundle.stage_bundle(str(scripts / "train_x.py"), str(dest), [str(scripts / "requirements.txt")])
    assert not dest.exists()


def test_staging_again_replaces_the_earlier_bundle(scripts, tmp_path):
    """A notebook cell run twice: the same directory, now with another extra file and a changed script."""
    dest = tmp_path / "bundle"
    extra = tmp_path / "model_def.py"
    extra.write_text("X = 1\n")
    bundle.stage_bundle(str(scripts / "train_x.py"), str(dest), [str(extra)])
    assert "model_def.py" in bundle.list_bundle(str(dest))
    (dest / "launcher" / "stale.py").write_text("# a module the package no longer has\n")
    (scripts / "train_x.py").write_text(SCRIPT + "# changed\n")
    for _ in range(2):
        assert bundle.stage_bundle(str(scripts / "train_x.py"), str(dest)) == str(dest)
        assert bundle.list_bundle(str(dest)) == _expected(["train_x.py", "ddp_utils.py"], _repo_package_files())
        assert _read(dest / "train_x.py") == (SCRIPT + "# changed\n").encode()
    # the command line too: the same --out twice
    for _ in range(2):
        proc = subprocess.run([PYTHON, "-m", "launcher", "bundle", str(scripts / "train_x.py"), "--out", str(dest)],
                              cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == bundle.list_bundle(str(dest))


@pytest.mark.parametrize("added", ["data.csv", "subdir", "launch.py edited"])
def test_a_bundle_with_files_added_by_hand_is_not_replaced(added, scripts, tmp_path):
    dest = tmp_path / "bundle"
    bundle.stage_bundle(str(scripts / "train_x.py"), str(dest))
    if added == "subdir":
        (dest / "subdir").mkdir()
    elif added == "data.csv":
        (dest / "data.csv").write_text("1,2\n")
    else:
        (dest / "launch.py").write_text("print('mine')\n")
    before = {n: _read(dest / n) for n in bundle.list_bundle(str(dest))}
    with pytest.raises(FileExistsError, match="did not stage|no bundle staged"):
        bundle.stage_bundle(str(scripts / "train_x.py"), str(dest))
    assert {n: _read(dest / n) for n in bundle.list_bundle(str(dest))} == before  # nothing removed
