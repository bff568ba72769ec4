"""Shipping the launcher: ``ddp-launcher.pyz`` and the wheel, run where the repository is not.

The stock ``pytorch/pytorch`` image is a Python with torch and nothing of ours. Its stand-in here is a
fresh virtual environment whose site-packages hold only torch and its dependencies (linked from the
environment running the tests: no download, built once per module in about a second). There the pyz
and the installed wheel each run a 2-host simulated job; a Python without torch and Pythons older than
3.9 (pyenv's, where present) are refused in one line, with nothing started or written.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import shutil
import subprocess
import time
import zipfile

import pytest
from conftest import PYTHON, REPO, LiveProcess, launcher_env
from packaging.requirements import Requirement
from test_simulate import assert_nothing_left, rank_records

from launcher import proctree
from launcher.entry import SUPPORTED
from launcher.platforms.sagemaker import bundle

SCRIPT = os.path.join(REPO, "tests", "scripts", "ddp_allreduce.py")
# pyenv's Pythons older than the launcher supports (2.7, 3.6, 3.7, 3.8 on the project's machine), by their names
OLD_PYTHONS = sorted(p for p in glob.glob("/root/.pyenv/versions/[23].*/bin/python")
                     if tuple(int(n) for n in p.split("/")[-3].split(".")[:2]) < SUPPORTED)
RUN_TIMEOUT = 240.0


def torch_and_its_dependencies() -> list[importlib.metadata.Distribution]:
    """torch and every distribution it needs on this machine (markers evaluated), from the running Python."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = ["torch"]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in found:
            continue
        dist = importlib.metadata.distribution(name)
        found[key] = dist
        todo += [r.name for r in map(Requirement, dist.requires or [])
                 if r.marker is None or r.marker.evaluate({"extra": ""})]
    return list(found.values())


def make_venv(path: str, with_torch: bool) -> str:
    """A new virtual environment (no pip); with torch: torch and its dependencies linked into its
    site-packages, nothing else. Returns its python."""
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", path], check=True, capture_output=True, timeout=120)
    site = glob.glob(os.path.join(path, "lib", "python*", "site-packages"))[0]
    if with_torch:
        for dist in torch_and_its_dependencies():
            top = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
            for name in sorted(top - {"__pycache__"}):
                source, target = str(dist.locate_file(name)), os.path.join(site, name)
                if os.path.exists(source) and not os.path.lexists(target):
                    os.symlink(source, target)
    return os.path.join(path, "bin", "python")


def pip_install(python: str, wheel: str) -> None:
    """Install the wheel into the environment of ``python`` (pip runs from the tests' environment)."""
    subprocess.run([PYTHON, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index",
                    wheel], check=True, capture_output=True, timeout=300)


def site_of(python: str) -> str:
    return glob.glob(os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "python*", "site-packages"))[0]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, str]:
    """``make dist`` on a copy of the sources: the pyz (``ddp-launcher zipapp``), the sdist and the wheel
    (``python -m build``). Returns their paths."""
    root = tmp_path_factory.mktemp("dist")
    src, out = root / "src", root / "dist"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    shutil.copytree(os.path.join(REPO, "launcher"), src / "launcher", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([PYTHON, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                           capture_output=True, text=True, timeout=300, cwd=str(root))
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    pyz = str(out / "ddp-launcher.pyz")
    made = subprocess.run([PYTHON, "-m", "launcher", "zipapp", "--out", pyz], capture_output=True, text=True,
                          timeout=60, env=launcher_env(), cwd=str(root))
    assert made.returncode == 0 and made.stdout == f"{pyz}\n", made.stderr
    (wheel,) = glob.glob(str(out / "ddp_launcher-*-py3-none-any.whl"))
    (sdist,) = glob.glob(str(out / "ddp_launcher-*.tar.gz"))
    return {"pyz": pyz, "wheel": wheel, "sdist": sdist, "root": str(root)}


@pytest.fixture(scope="module")
def stock(dist, tmp_path_factory) -> dict[str, str]:
    """The stock image's Python (torch only), one with the wheel installed too, and one without torch
    that has the wheel installed."""
    root = tmp_path_factory.mktemp("venvs")
    torch_only = make_venv(str(root / "torch-only"), with_torch=True)
    with_wheel = make_venv(str(root / "torch-and-wheel"), with_torch=True)
    no_torch = make_venv(str(root / "no-torch"), with_torch=False)
    for python in (with_wheel, no_torch):
        pip_install(python, dist["wheel"])
    return {"torch_only": torch_only, "with_wheel": with_wheel, "no_torch": no_torch}


def clean_env(tmp_path, **extra: str) -> dict[str, str]:
    """The caller's environment without the repository on the path, HOME (the pyz's cache) in ``tmp_path``."""
    env = launcher_env(HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"))
    for name in ("PYTHONPATH", "XDG_CACHE_HOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    env.update(extra)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return env


def run(argv: list[str], tmp_path, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=str(cwd or tmp_path), env=env or clean_env(tmp_path), capture_output=True,
                          text=True, timeout=120)


def test_the_wheel_and_sdist_hold_the_launcher_alone(dist, stock, tmp_path):
    import tarfile

    with zipfile.ZipFile(dist["wheel"]) as whl:
        tops = {n.split("/")[0] for n in whl.namelist()}
        entry_points = next(whl.read(n).decode() for n in whl.namelist() if n.endswith("entry_points.txt"))
    assert {t for t in tops if not t.endswith(".dist-info")} == {"launcher"}
    assert "ddp-launcher = launcher.entry:main" in entry_points
    with tarfile.open(dist["sdist"]) as sdist:
        names = [n.split("/", 1)[1] for n in sdist.getnames() if "/" in n]
    assert "launcher/cli.py" in names and "setup.cfg" in names and not [n for n in names if n.startswith("tests/")]
    # the wheel's command, installed into a Python that has torch: its own copy, not the repository's
    command = os.path.join(os.path.dirname(stock["with_wheel"]), "ddp-launcher")
    proc = run([command, "--dry-run", "--json", SCRIPT, "--steps", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["argv"][0] == stock["with_wheel"]
    assert plan["argv"][plan["argv"].index(SCRIPT) - 1].startswith(site_of(stock["with_wheel"]))  # its bootstrap


@pytest.mark.job
@pytest.mark.parametrize("form", ["pyz", "wheel"])
def test_a_two_host_job_runs_in_a_python_that_has_only_torch(form, dist, stock, tmp_path):
    """The stock image's case: ``python ddp-launcher.pyz simulate ...`` and the installed ``ddp-launcher``."""
    home = tmp_path / "home"
    workdir = str(tmp_path / "job")
    if form == "pyz":
        command = [stock["torch_only"], dist["pyz"]]
    else:
        command = [os.path.join(os.path.dirname(stock["with_wheel"]), "ddp-launcher")]
    sim = LiveProcess([*command, "simulate", "--hosts", "2", "--nproc-per-node", "1", "--workdir", workdir,
                       "--job-name", f"ship-{form}", "--", SCRIPT, "--steps", "2", "--step-sleep", "0.01"],
                      str(tmp_path), clean_env(tmp_path))
    try:
        code = sim.proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proctree.kill_tree([sim.proc.pid])
        sim.proc.wait()
        pytest.fail("the job ran over its bound:\n" + sim.stderr[-3000:])
    sim.join_readers()
    assert code == 0, sim.stderr[-3000:]
    assert_nothing_left(sim, workdir, 2)  # type: ignore[arg-type]
    records = rank_records(workdir, 2)
    assert [r["rank"] for host in ("algo-1", "algo-2") for r in records[host]] == [0, 1]
    # Each host ran the SageMaker bundle that simulate staged from the shipped copy: the pyz's unpacked
    # files, or the wheel's site-packages.
    if form == "pyz":
        (shipped,) = glob.glob(str(home / ".cache" / "ddp-launcher" / "*"))
    else:
        shipped = site_of(stock["with_wheel"])
    files = bundle.package_files(os.path.join(shipped, "launcher"))
    assert "cli.py" in files
    for host, ranks in records.items():
        code = os.path.join(workdir, host, "code")
        for rec in ranks:
            assert rec["world_size"] == 2 and rec["sum"] == 3.0 and rec["steps"] == 2
            assert rec["env"]["PYTHONPATH"].split(os.pathsep)[0] == code
        for rel in files:
            with open(os.path.join(code, "launcher", rel), "rb") as ours, \
                    open(os.path.join(shipped, "launcher", rel), "rb") as theirs:
                assert ours.read() == theirs.read(), rel
    print(f"\n{form}: 2 hosts in a torch-only Python: {time.monotonic() - sim.started:.1f} s")


def test_a_python_without_torch_gets_one_line_and_nothing_starts(dist, stock, tmp_path):
    python = stock["no_torch"]
    command = os.path.join(os.path.dirname(python), "ddp-launcher")
    script = tmp_path / "train.py"
    script.write_text("import torch\n")
    for form in ([python, dist["pyz"]], [command]):
        for args in (["train.py", "--x", "1"], ["simulate", "--hosts", "2", "--workdir", "w", "--", "train.py"]):
            proc = run([*form, *args], tmp_path)
            assert proc.returncode == 2 and proc.stdout == "", (form, args, proc.stderr)
            lines = proc.stderr.splitlines()
            assert len(lines) == 1 and "torch is not installed" in lines[0] and repr(python) in lines[0], lines
            assert os.listdir(tmp_path / "tmp") == [] and not (tmp_path / "w").exists()  # no run dir, no hosts
        # what needs no torch: the help and the dry run (which says a run would stop)
        assert run([*form, "--help"], tmp_path).returncode == 0
        dry = run([*form, "--dry-run", "--json", "train.py"], tmp_path)
        assert dry.returncode == 0, dry.stderr
        assert any("torch is not installed" in note for note in json.loads(dry.stdout)["notes"])


@pytest.mark.parametrize("python", OLD_PYTHONS or [pytest.param("", marks=pytest.mark.skip("no pyenv Pythons"))])
def test_an_old_python_gets_one_line_naming_it(python, dist, tmp_path):
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    site = tmp_path / "site"  # the wheel's files, as an old Python would find them on its path
    with zipfile.ZipFile(dist["wheel"]) as whl:
        whl.extractall(site)
    for argv, extra in (([python, dist["pyz"], "--help"], {}), ([python, dist["pyz"], "train.py"], {}),
                        ([python, "-m", "launcher", "train.py"], {"PYTHONPATH": str(site)})):
        proc = run(argv, tmp_path, clean_env(tmp_path, **extra))
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        lines = proc.stderr.splitlines()
        assert lines == [f"ddp-launcher: error: Python 3.9 or newer is needed; {python} is Python "
                         f"{lines[0].split(' is Python ')[1].split(' ')[0]} (start the launcher with a newer "
                         "Python, the one that has torch)"], proc.stderr
        assert lines[0].split(" is Python ")[1].startswith(version + ".")
        assert not (tmp_path / "home").exists() and os.listdir(tmp_path / "tmp") == []  # nothing unpacked


def test_the_pyz_is_reproducible_and_rebuilds_itself(dist, stock, tmp_path):
    again = tmp_path / "again.pyz"
    made = run([PYTHON, "-m", "launcher", "zipapp", "--out", str(again)], tmp_path, launcher_env())
    assert made.returncode == 0, made.stderr
    itself = tmp_path / "itself.pyz"
    made = run([stock["torch_only"], dist["pyz"], "zipapp", "--out", str(itself)], tmp_path)
    assert made.returncode == 0, made.stderr
    with open(dist["pyz"], "rb") as a, open(again, "rb") as b, open(itself, "rb") as c:
        first = a.read()
        assert first == b.read() == c.read()
    assert first.startswith(b"#!/usr/bin/env python3\n") and os.access(dist["pyz"], os.X_OK)
    # bad --out: one line, exit 2, nothing written
    for out, needle in ((str(tmp_path), "is a directory"), (str(tmp_path / "no" / "x.pyz"), "no such directory")):
        proc = run([PYTHON, "-m", "launcher", "zipapp", "--out", out], tmp_path, launcher_env())
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and needle in proc.stderr, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["again.pyz", "home", "itself.pyz", "tmp"]  # home: the pyz's cache


def test_the_pyz_unpacks_once_into_tmpdir_when_home_is_not_writable(dist, stock, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = clean_env(tmp_path, HOME=str(blocker / "home"))  # under a file: no cache can be made there
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    for _ in range(2):
        proc = run([stock["torch_only"], dist["pyz"], "--dry-run", "train.py"], tmp_path, env)
        assert proc.returncode == 0, proc.stderr
    unpacked = glob.glob(str(tmp_path / "tmp" / f"ddp-launcher-{os.getuid()}" / "*"))
    assert len(unpacked) == 1 and os.path.isfile(os.path.join(unpacked[0], ".unpacked"))
    assert sorted(os.listdir(os.path.dirname(unpacked[0]))) == [os.path.basename(unpacked[0])]  # no leftovers
    assert os.path.isfile(os.path.join(unpacked[0], "launcher", "bootstrap.py"))
