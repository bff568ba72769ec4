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
import shlex
import shutil
import socket
import subprocess
import time
import zipfile

import pytest
from conftest import PYTHON, REPO, LiveProcess, launcher_env
from packaging.requirements import Requirement
from test_simulate import assert_nothing_left, rank_records

from launcher import proctree, pyz
from launcher.entry import SUPPORTED
from launcher.platforms.sagemaker import bundle

SCRIPT = os.path.join(REPO, "tests", "scripts", "ddp_allreduce.py")
# pyenv's Pythons older than the launcher supports (2.7, 3.6, 3.7, 3.8 on the project's machine), by their names
OLD_PYTHONS = sorted(p for p in glob.glob("/root/.pyenv/versions/[23].*/bin/python")
                     if tuple(int(n) for n in p.split("/")[-3].split(".")[:2]) < SUPPORTED)
RUN_TIMEOUT = 240.0
JOBWATCH = ("__init__", "watch", "hub", "client", "messages", "restarts")  # the job watch package: all shipped


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
        names_of_wheel = whl.namelist()
        tops = {n.split("/")[0] for n in names_of_wheel}
        entry_points = next(whl.read(n).decode() for n in whl.namelist() if n.endswith("entry_points.txt"))
    assert {t for t in tops if not t.endswith(".dist-info")} == {"launcher"}
    assert {f"launcher/jobwatch/{m}.py" for m in JOBWATCH} <= set(names_of_wheel), names_of_wheel
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
    assert "cli.py" in files and {f"jobwatch/{m}.py" for m in JOBWATCH} <= set(files), files
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


def test_hosts_that_share_a_home_unpack_the_pyz_once_at_the_same_time(dist, stock, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    env = clean_env(tmp_path)
    procs = [subprocess.Popen([stock["torch_only"], dist["pyz"], "--dry-run", "--json", "train.py"], cwd=str(tmp_path),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [code for code, _out, _err in results] == [0] * 4, [err for _code, _out, err in results]
    cache = tmp_path / "home" / ".cache" / "ddp-launcher"
    (build,) = os.listdir(cache)  # one copy, no half-unpacked leftovers
    assert os.path.isfile(cache / build / ".unpacked")
    assert {json.loads(out)["argv"][-2].startswith(str(cache / build)) for _code, out, _err in results} == {True}



def pyz_unpack():
    """The ``unpack`` of the pyz's own ``__main__.py``, as that file defines it."""
    namespace: dict = {"__name__": "pyz_main"}
    exec(pyz._MAIN % {"build": "b1", "marker": pyz.MARKER}, namespace)
    return namespace["unpack"]


@pytest.mark.parametrize("first_at", ["makedirs", "rename"])
def test_a_host_that_another_host_beats_at_any_step_of_the_unpack_uses_that_copy(first_at, tmp_path, monkeypatch):
    """Each step of the unpack where a host that shares the directory can come first: it makes the cache root
    just before this host does, or renames its whole copy into place just before this host's rename. This host
    then uses the cache root all the same (before, a lost ``makedirs`` race sent it to ``$TMPDIR``), and no
    half-unpacked copy is left."""
    archive = tmp_path / "a.pyz"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("launcher/__init__.py", "")
        zf.writestr("__main__.py", "")
    unpack, root = pyz_unpack(), tmp_path / "cache" / "ddp-launcher"
    real = {"makedirs": os.makedirs, "rename": os.rename}

    def other_host_first(*args, **kwargs):
        monkeypatch.setattr(os, first_at, real[first_at])
        if first_at == "makedirs":
            os.makedirs(root, 0o700)
        else:
            assert pyz_unpack()(str(archive), str(root)) == str(root / "b1")  # the other host's whole copy
        return real[first_at](*args, **kwargs)

    monkeypatch.setattr(os, first_at, other_host_first)
    assert unpack(str(archive), str(root)) == str(root / "b1")
    assert os.listdir(root) == ["b1"] and sorted(os.listdir(root / "b1")) == [pyz.MARKER, "launcher"]
    assert os.makedirs is real["makedirs"] and os.rename is real["rename"]  # the other host came first indeed

# --- every example's command line, run as written (a dry run) in the stock image's Python -------------------------

def container_words(command: list[str]) -> list[str]:
    """A container's command as it runs: ``bash -c "pip install ... && exec CMD"`` gives CMD's words."""
    if command[:2] == ["bash", "-c"]:
        return shlex.split(command[2].rsplit("exec ", 1)[1])
    return list(command)


class Stage:
    """The stock image's file system for the examples: the ConfigMap or volume at /opt/ddp (the pyz and the
    training scripts, as ``kubectl create configmap --from-file`` puts them), a checkout with ``dist/`` for
    the shell scripts, and the Python (``python`` on PATH) that has torch and nothing else."""

    def __init__(self, dist: dict[str, str], stock: dict[str, str], root) -> None:
        self.python = stock["torch_only"]
        self.opt = root / "opt-ddp"
        self.checkout = root / "checkout"
        self.data = root / "data"
        for directory in (self.opt, self.checkout / "dist", self.data):
            directory.mkdir(parents=True)
        for name in os.listdir(os.path.join(REPO, "train_scripts")):
            if name.endswith(".py"):
                shutil.copy(os.path.join(REPO, "train_scripts", name), self.opt / name)
        shutil.copy(dist["pyz"], self.opt / "ddp-launcher.pyz")
        shutil.copy(dist["pyz"], self.checkout / "dist" / "ddp-launcher.pyz")
        os.symlink(os.path.join(REPO, "train_scripts"), self.checkout / "train_scripts")
        self.mounts = {"/opt/ddp": str(self.opt), "/code": os.path.join(REPO, "train_scripts"),
                       "/gcs/YOUR_BUCKET/ddp": str(self.opt), "/data": str(self.data)}
        self.bin = os.path.dirname(self.python)

    def words(self, argv: list[str]) -> list[str]:
        """The argv with the image's paths placed here and ``python`` the stock Python."""
        out = []
        for word in argv:
            for mount, here in self.mounts.items():
                if word == mount or word.startswith(mount + "/"):
                    word = here + word[len(mount):]
            out.append(self.python if word == "python" else word)
        return out

    def env(self, tmp_path, platform_env: dict[str, str]) -> dict[str, str]:
        env = clean_env(tmp_path, LAUNCHER_DRY_RUN="true", LAUNCHER_JSON="true", **platform_env)
        env["PATH"] = self.bin + os.pathsep + env["PATH"]
        return env


def dry_run(argv: list[str], env: dict[str, str], cwd) -> dict:
    proc = subprocess.run(argv, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (argv, proc.stderr[-2000:])
    plan = json.loads(proc.stdout[proc.stdout.index("{"):])
    script = plan["argv"][plan["argv"].index("--") + 2]  # after the bootstrap
    assert os.path.isfile(os.path.join(str(cwd), script)), script  # the script the example names is there
    return plan


@pytest.fixture(scope="module")
def stage(dist, stock, tmp_path_factory) -> Stage:
    return Stage(dist, stock, tmp_path_factory.mktemp("stage"))


def _check(plans: list[dict], platform: str) -> None:
    assert [p["platform"] for p in plans] == [platform] * len(plans)
    assert sorted(p["cluster"]["node_rank"] for p in plans) == list(range(len(plans)))
    assert {p["cluster"]["nnodes"] for p in plans} == {len(plans)}
    for p in plans:
        assert not [n for n in p["notes"] if "instead of" in n or "torch is not installed" in n], p["notes"]


@pytest.mark.parametrize("name", ["pytorchjob-per-pod.yaml", "pytorchjob-nproc-per-node.yaml", "trainjob.yaml",
                                  "jobset-retry.yaml", "docker-compose.yaml"])
def test_each_container_example_runs_as_written_in_the_stock_image(name, stage, tmp_path):
    import test_platform_examples as spec

    job = spec.load(name)
    if name.startswith("pytorchjob"):
        replicas = job["spec"]["pytorchReplicaSpecs"]
        commands = [c["command"] for kind in ("Master", "Worker") for c in
                    replicas[kind]["template"]["spec"]["containers"] * replicas[kind]["replicas"]]
        cases = [(cmd, env, "/workspace") for cmd, env in zip(commands, spec.pytorchjob_envs(job))]
        platform = "kubeflow"
    elif name == "trainjob.yaml":
        cases = [(job["spec"]["trainer"]["command"], env, "/workspace") for env in spec.trainjob_envs(job)]
        platform = "kubeflow-v2"
    elif name == "jobset-retry.yaml":
        pod = job["spec"]["replicatedJobs"][0]["template"]["spec"]
        container = pod["template"]["spec"]["containers"][0]
        plain = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        cases = [(container["command"], {**plain, "NODE_RANK": str(i)}, "/workspace")
                 for i in range(pod["completions"])]
        platform = "env"
    else:
        services = job["services"].values()
        cases = [(svc["command"], svc["environment"], svc["working_dir"]) for svc in services]
        platform = "env"
    plans = []
    for command, env, workdir in cases:
        cwd = stage.mounts.get(workdir, str(tmp_path))  # the image's working directory
        plans.append(dry_run(stage.words(container_words(command)), stage.env(tmp_path, env), cwd))
    _check(plans, platform)


def test_vertex_runs_the_installed_source_distribution(stage, stock, tmp_path):
    import test_platform_examples as spec

    pools = spec.load("vertex-worker-pools.json")["jobSpec"]["workerPoolSpecs"]
    package = [spec_["pythonPackageSpec"] for spec_ in pools for _ in range(spec_["replicaCount"])]
    assert all(os.path.basename(p["packageUris"][0]).startswith("ddp_launcher-") for p in package)
    plans = [dry_run([stock["with_wheel"], "-m", p["pythonModule"], *stage.words(p["args"])],
                     stage.env(tmp_path, env), tmp_path) for p, env in zip(package, spec.vertex_envs(pools))]
    _check(plans, "vertex")


def test_oci_runs_the_bundle_as_its_job_artifact(stage, tmp_path):
    import test_platform_examples as spec

    group = spec.oci_group()
    artifact = tmp_path / "artifact"
    made = run([stage.python, str(stage.opt / "ddp-launcher.pyz"), "bundle", str(stage.opt / "train_digits.py"),
                "--out", str(artifact)], tmp_path)
    assert made.returncode == 0, made.stderr
    details = group["jobConfigurationDetails"]
    entry = details["environmentVariables"]["JOB_RUN_ENTRYPOINT"]
    plans = [dry_run([stage.python, entry, *shlex.split(details["commandLineArguments"])],
                     stage.env(tmp_path, env), artifact) for env in spec.oci_envs(group, tmp_path)]
    _check(plans, "oci")


STUB = "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec \"$@\"\n"  # srun/pbsdsh: run the command here


@pytest.mark.parametrize("name", ["slurm_train.sbatch", "slurm_requeue.sbatch", "skypilot-retry.yaml",
                                  "pbs_train.sh"])
def test_each_shell_example_runs_as_written_with_the_pyz(name, stage, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(STUB)
    (bin_dir / "srun").chmod(0o755)
    checkout = stage.checkout
    nodes = 2
    if name.endswith(".sbatch"):
        argv = ["bash", os.path.join(REPO, "examples", name)]
        envs = [{"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_STEP_ID": "0", "SLURM_NODEID": str(i),
                 "SLURM_PROCID": str(i), "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "node[1-2]",
                 "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1",
                 "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURMD_NODENAME": f"node{i + 1}", "PYTHON": stage.python,
                 "RUN": str(tmp_path / "run")} for i in range(nodes)]
        platform = "slurm"
    elif name == "skypilot-retry.yaml":
        import test_platform_examples as spec

        argv = ["bash", "-c", spec.load(name)["run"]]
        envs = [{"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": str(i)}
                for i in range(nodes)]
        platform = "env"
    else:  # PBS: the command each pbsdsh task runs, after its module set-up, in $PBS_O_WORKDIR
        with open(os.path.join(REPO, "examples", name), encoding="utf-8") as fh:
            line = next(t for t in fh if "ddp-launcher.pyz" in t and "&&" in t)
        checkout = tmp_path / "pbs"
        checkout.mkdir()
        shutil.copy(stage.opt / "ddp-launcher.pyz", checkout)
        (checkout / "main.py").write_text("import torch\n")  # the site's own training script
        node_file = tmp_path / "nodefile"  # this machine is the first node (its name cannot be changed here)
        node_file.write_text(f"{socket.gethostname()}\nother-node\n")
        argv = ["bash", "-c", line.split("&&", 1)[1]]
        envs = [{"PBS_JOBID": "31337.pbs01", "PBS_NODEFILE": str(node_file), "PBS_O_WORKDIR": str(checkout)}]
        platform = "pbs"
    plans = []
    for env in envs:
        full = stage.env(tmp_path, env)
        full["PATH"] = f"{bin_dir}{os.pathsep}{full['PATH']}"
        plans.append(dry_run(argv, full, checkout))
    if platform != "pbs":
        _check(plans, platform)
    else:
        (plan,) = plans
        assert (plan["platform"], plan["cluster"]["nnodes"], plan["cluster"]["node_rank"]) == ("pbs", 2, 0)
        assert plan["cluster"]["nproc_per_node"] == 2  # the job's ngpus=2, as the comment says
    if name == "slurm_train.sbatch":  # no GPU here: one process per node, the platform's own count
        assert [p["cluster"]["nproc_per_node"] for p in plans] == [1, 1]
