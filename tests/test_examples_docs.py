"""Every command block of README.md and docs/ runs as written, or says why not.

A fenced block with a language (bash, python, yaml, json, dockerfile) is a command block. Each is run by
one test of this module (``RUN``: the block's document and first line, and the test that runs it), or
carries ``<!-- not-run: REASON -->`` on the line before its fence; :func:`test_every_command_block_is_run_or_marked`
enforces it, and docs/benchmarks.md quotes the counts. Blocks without a language are output or file trees.

Where a block's point is the command the launcher resolves, it runs with ``LAUNCHER_DRY_RUN`` (the plan
as JSON, nothing starts) in the environment the platform gives: the stock image's Python (torch only, from
tests/test_shipping.py) with the zipapp, or the installed wheel's ``ddp-launcher``; ``srun`` and ``pbsdsh``
stand-ins that run the task here as those tools do (``pbsdsh`` in the home directory: PBS starts each
task there). The users' recipes (``python3 -m launcher zipapp``, ``bundle``) run in a checkout, the
stock Python's where they say that no install is needed; ``make dist`` is the Makefile's recipe, which
the ``dist`` fixture runs on a copy of the sources (:func:`test_make_dist_is_the_dist_fixtures_recipe`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import zipfile
from typing import NamedTuple, Optional

import jsonschema
import pytest
import yaml
from conftest import PYTHON, REPO
from test_shipping import dist, stock  # noqa: F401 (the fixtures: the built pyz and wheel, the stock Pythons)

from launcher.options import parse_invocation
from launcher.simulate import config as simulate_config
from launcher.simulate.hosts import pbs as simulated_pbs

DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))),
        *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "platforms", "*.md")))]
FENCE = re.compile(r"^\s*```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!-- not-run: (\S.*?) -->$")
# What a command looks like: an untagged block must not start with one (it would be a command block).
COMMAND_WORDS = {"python", "python3", "ddp-launcher", "srun", "sbatch", "pbsdsh", "make", "kubectl", "pip", "$",
                 "#!/bin/bash"}
SRUN = "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec \"$@\"\n"
# pbsdsh(1B): each task starts in the home directory, without a login shell
PBSDSH = ("#!/bin/bash\ncd \"$HOME\" || exit 1\n"
          "while [[ $1 == -* ]]; do [[ $1 == -- ]] && { shift; break; }; shift; done\nexec \"$@\"\n")


class Block(NamedTuple):
    doc: str
    line: int  # the opening fence's line, from 1
    lang: str
    text: str
    not_run: Optional[str]  # the marker's reason

    @property
    def first(self) -> str:
        return self.text.split("\n", 1)[0]


def blocks() -> list[Block]:
    """Every fenced block of the documents, in order."""
    found = []
    for doc in DOCS:
        with open(os.path.join(REPO, doc), encoding="utf-8") as fh:
            lines = fh.read().split("\n")
        i = 0
        while i < len(lines):
            opening = FENCE.match(lines[i])
            if not opening:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]) and not FENCE.match(lines[j])[1])
            marker = NOT_RUN.match(lines[i - 1].strip()) if i else None
            found.append(Block(doc, i + 1, opening[1], "\n".join(lines[i + 1:end]), marker[1] if marker else None))
            i = end + 1
    return found


def block(doc: str, first: str) -> Block:
    """The one block of ``doc`` whose first line starts with ``first``."""
    (found,) = [b for b in blocks() if b.doc == doc and matches(b, first)]
    return found


# (document, the block's first line, or its start) -> the test of this module that runs the block
RUN = {
    ("README.md", "#SBATCH --nodes=4"): "test_slurm_blocks_resolve_the_nodes_and_gpus_they_ask_for",
    ("README.md", "pbsdsh -u --"): "test_pbs_blocks_run_in_the_submission_directory",
    ("README.md", "MASTER_ADDR=node0"): "test_env_blocks_resolve_each_node",
    ("docs/platforms/env.md", "MASTER_ADDR=node0"): "test_env_blocks_resolve_each_node",
    ("docs/platforms/slurm.md", "#!/bin/bash\n#SBATCH --job-name=ddp-train"):
        "test_slurm_blocks_resolve_the_nodes_and_gpus_they_ask_for",
    ("docs/platforms/slurm.md", "#!/bin/bash\n#SBATCH --job-name=ddp-stock"):
        "test_the_stock_python_builds_the_zipapp_in_a_checkout_and_runs_it",
    ("docs/platforms/slurm.md", "python3 -m launcher zipapp --out ~/ddp-launcher.pyz"):
        "test_the_stock_python_builds_the_zipapp_in_a_checkout_and_runs_it",
    ("docs/install.md", "python3 -m launcher zipapp --out ddp-launcher.pyz   # in a checkout: any"):
        "test_the_stock_python_builds_the_zipapp_in_a_checkout_and_runs_it",
    ("docs/platforms/sagemaker.md", "ddp-launcher bundle --out build/bundle"):
        "test_the_sagemaker_check_plans_4_processes_on_each_of_2_hosts",
    ("docs/hangs.md", "ddp-launcher --dry-run train.py"): "test_the_answer_dry_runs_state_the_rule_they_ask_for",
    ("docs/recovery.md", "ddp-launcher --dry-run --max-restarts 3"):
        "test_the_answer_dry_runs_state_the_rule_they_ask_for",
    ("docs/platforms/slurm.md", "srun --ntasks-per-node=1 bash -c"):
        "test_slurm_blocks_resolve_the_nodes_and_gpus_they_ask_for",
    ("docs/platforms/pbs.md", "#!/bin/bash"): "test_pbs_blocks_run_in_the_submission_directory",
    ("docs/platforms/kubernetes.md", "apiVersion: kubeflow.org/v1"):
        "test_kubernetes_blocks_run_the_zipapp_in_the_stock_image",
    ("docs/install.md", "containers:"): "test_kubernetes_blocks_run_the_zipapp_in_the_stock_image",
    ("docs/install.md", "\"pythonPackageSpec\""): "test_vertex_blocks_run_the_installed_package",
    ("docs/platforms/vertex.md", "{\"displayName\""): "test_vertex_blocks_run_the_installed_package",
    ("docs/install.md", "python3 -m launcher bundle train_scripts/train_digits.py"): "test_oci_blocks_run_the_artifact",
    ("docs/platforms/oci.md", "\"jobConfigurationDetails\""): "test_oci_blocks_run_the_artifact",
    ("docs/install.md", "python3 -m launcher zipapp --out ddp-launcher.pyz     # in a checkout on the shared"):
        "test_slurm_blocks_resolve_the_nodes_and_gpus_they_ask_for",
    ("docs/install.md", "ddp-launcher bundle train_scripts/train_resnet.py"): "test_bundle_blocks_write_the_bundle",
    ("docs/install.md", "from launcher.platforms.sagemaker.bundle import stage_bundle"):
        "test_bundle_blocks_write_the_bundle",
    ("docs/install.md", "ddp-launcher bundle src/train.py"): "test_bundle_blocks_write_the_bundle",
    ("docs/options.md", "ddp-launcher [options]"): "test_options_and_recovery_blocks_resolve",
    ("docs/recovery.md", "ddp-launcher --max-restarts 3"): "test_options_and_recovery_blocks_resolve",
    ("docs/hangs.md", "beat = socket.socket"): "test_the_progress_beat_snippet_sends_the_rank",
    ("docs/failures.md", "{\"schema\""): "test_the_documented_outcome_file_meets_the_schema",
    ("docs/simulate.md", "python -m launcher simulate --hosts 2 -- train_scripts/train_digits.py"):
        "test_the_simulate_answer_is_two_hosts_and_a_lost_one",
}


def matches(b: Block, first: str) -> bool:
    return b.text.startswith(first) if "\n" in first else b.first.startswith(first)


def test_every_command_block_is_run_or_marked():
    command_blocks = [b for b in blocks() if b.lang]
    problems = []
    for b in command_blocks:
        runs = [key for key in RUN if key[0] == b.doc and matches(b, key[1])]
        if bool(runs) == bool(b.not_run):
            problems.append(f"{b.doc}:{b.line}: " + ("both run by a test and marked not-run" if runs else
                                                      "neither run by a test nor marked <!-- not-run: reason -->"))
    for (doc, first), test in RUN.items():
        if len([b for b in command_blocks if b.doc == doc and matches(b, first)]) != 1:
            problems.append(f"RUN names no single block: {doc}: {first!r}")
        if not callable(globals().get(test)):
            problems.append(f"RUN names no test of this module: {test}")
    for b in blocks():
        if not b.lang and b.text.split()[0] in COMMAND_WORDS:
            problems.append(f"{b.doc}:{b.line}: a command in a block without a language")
    assert problems == []
    ran, marked = len(command_blocks) - sum(1 for b in command_blocks if b.not_run), \
        sum(1 for b in command_blocks if b.not_run)
    with open(os.path.join(REPO, "docs", "benchmarks.md"), encoding="utf-8") as fh:
        table = fh.read()
    assert f"<!--fig:doc-blocks-run-->{ran}<!--/fig-->" in table and \
        f"<!--fig:doc-blocks-not-run-->{marked}<!--/fig-->" in table, (ran, marked)


def test_the_enforcement_sees_an_unmarked_block(tmp_path, monkeypatch):
    """The marker must stand on the line right before the fence; a block without it is found."""
    doc = tmp_path / "page.md"
    doc.write_text("<!-- not-run: needs a cluster -->\n```bash\nsrun x\n```\n\ntext\n\n```bash\nsrun y\n```\n")
    monkeypatch.setitem(globals(), "REPO", str(tmp_path))
    monkeypatch.setitem(globals(), "DOCS", ["page.md"])
    found = blocks()
    assert [(b.line, b.not_run) for b in found] == [(2, "needs a cluster"), (8, None)]


# --- running blocks ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tools(tmp_path_factory, stock) -> str:  # noqa: F811 (the fixture imported above)
    """A directory with the ``srun`` and ``pbsdsh`` stand-ins, and ``ddp-launcher``/``python`` of the
    environment with the wheel installed (the stock Python plus ``pip install ddp-launcher``)."""
    bin_dir = tmp_path_factory.mktemp("tools")
    for name, text in (("srun", SRUN), ("pbsdsh", PBSDSH)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def shell_env(tmp_path, stock, tools, **extra: str) -> dict[str, str]:  # noqa: F811
    """A host's environment: no repository on the path, HOME in ``tmp_path``, the wheel's ``ddp-launcher``
    and its ``python`` first on PATH, the launcher in dry-run mode (the JSON plan on stdout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XDG_CACHE_HOME")}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), TMPDIR=str(tmp_path), LAUNCHER_DRY_RUN="true", LAUNCHER_JSON="true",
               PATH=os.pathsep.join([tools, os.path.dirname(stock["with_wheel"]), env["PATH"]]), **extra)
    return env


def plans_of(stdout: str) -> list[dict]:
    """The JSON plans a block's commands printed, in order."""
    decoder, plans, i = json.JSONDecoder(), [], stdout.find("{")
    while i >= 0:
        plan, end = decoder.raw_decode(stdout, i)
        plans.append(plan)
        i = stdout.find("{", end)
    return plans


def run_bash(text: str, env: dict[str, str], cwd) -> list[dict]:
    proc = subprocess.run(["bash", "-e", "-c", text], cwd=str(cwd), env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (text, proc.stderr[-2000:])
    return plans_of(proc.stdout)


def checkout(tmp_path, dist) -> str:  # noqa: F811
    """A checkout after ``make dist``: launcher/, dist/ with the pyz, the wheel and the sdist; train_scripts/
    and a train.py (the user's script)."""
    root = tmp_path / "checkout"
    (root / "dist").mkdir(parents=True)
    for name in ("pyz", "wheel", "sdist"):
        os.symlink(dist[name], root / "dist" / os.path.basename(dist[name]))
    os.symlink(os.path.join(REPO, "train_scripts"), root / "train_scripts")
    shutil.copytree(os.path.join(REPO, "launcher"), root / "launcher", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "train.py").write_text("import torch\n")
    return str(root)


def test_make_dist_is_the_dist_fixtures_recipe():
    """``make dist`` writes dist/ with the two commands the ``dist`` fixture (tests/test_shipping.py) runs."""
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as fh:
        recipe = fh.read().split("\ndist:", 1)[1].split("\n\n", 1)[0].split("\n")[1:]
    assert [line.strip() for line in recipe] == ["rm -rf dist", "$(PY) -m build --no-isolation --outdir dist .",
                                                 "$(PY) -m launcher zipapp --out dist/ddp-launcher.pyz"]


def slurm_env(node: int, nodes: int, **extra: str) -> dict[str, str]:
    """SLURM's variables in node ``node``'s task of a step over ``nodes`` nodes, one task each."""
    return {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": f"node[1-{nodes}]",
            "SLURM_STEP_NODELIST": f"node[1-{nodes}]", "SLURM_NNODES": str(nodes), "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_STEP_TASKS_PER_NODE": f"1(x{nodes})", "SLURMD_NODENAME": f"node{node + 1}", **extra}


def test_slurm_blocks_resolve_the_nodes_and_gpus_they_ask_for(tmp_path, stock, tools, dist):  # noqa: F811
    """README's and slurm.md's jobs (4 nodes, --gpus-per-node=8: SLURM_GPUS_ON_NODE=8), slurm.md's
    outcome-file step, install.md's zipapp step: every node's launcher, as srun starts it."""
    root = checkout(tmp_path, dist)
    cases = [(block("README.md", "#SBATCH --nodes=4").text, 4, {"SLURM_GPUS_ON_NODE": "8"}, 8),
             (block("docs/platforms/slurm.md", "#!/bin/bash\n#SBATCH --job-name=ddp-train").text, 4,
              {"SLURM_GPUS_ON_NODE": "8"}, 8),
             (block("docs/platforms/slurm.md", "srun --ntasks-per-node=1 bash -c").text, 2,
              {"OUTCOMES": str(tmp_path / "outcomes")}, 1),
             (block("docs/install.md", "python3 -m launcher zipapp --out ddp-launcher.pyz     # in a checkout on").text,
              2, {}, 1)]
    for text, nodes, extra, nproc in cases:
        assert f"--nodes={nodes}" in text or nodes == 2
        plans = [p for node in range(nodes)
                 for p in run_bash(text, shell_env(tmp_path, stock, tools, **slurm_env(node, nodes, **extra)), root)]
        assert [(p["platform"], p["cluster"]["node_rank"], p["cluster"]["nnodes"], p["cluster"]["nproc_per_node"])
                for p in plans] == [("slurm", node, nodes, nproc) for node in range(nodes)], text


def test_pbs_blocks_run_in_the_submission_directory(tmp_path, stock, tools, dist):  # noqa: F811
    """README's and pbs.md's PBS lines: pbsdsh starts each task in the home directory; the task's ``cd``
    finds train.py, and ``--nproc-per-node 2`` gives the chunk's ngpus=2 (PBS gives no process count)."""
    workdir = checkout(tmp_path, dist)
    node_file = tmp_path / "nodefile"  # this machine is the first node (its name cannot be changed here)
    node_file.write_text(f"{socket.gethostname()}\nother-node\n")
    env = simulated_pbs.node_variables("ddp-train", 2, 0, str(node_file), 1, 20000, None, workdir)
    del env["LAUNCHER_MASTER_PORT"]  # simulate's stand-in for the port a job script would export
    for text in (block("README.md", "pbsdsh -u --").text, block("docs/platforms/pbs.md", "#!/bin/bash").text):
        assert "ngpus=2" in text or text.startswith("pbsdsh")
        (plan,) = run_bash(text, shell_env(tmp_path, stock, tools, **env), tmp_path / "home")
        assert (plan["platform"], plan["cluster"]["nnodes"], plan["cluster"]["node_rank"],
                plan["cluster"]["nproc_per_node"]) == ("pbs", 2, 0, 2)
        assert plan["cluster"]["master_port"] == 20000 + 4242 % 10000 or plan["cluster"]["master_port"] >= 20000


def test_env_blocks_resolve_each_node(tmp_path, stock, tools, dist):  # noqa: F811
    """README's and env.md's torchrun-style lines: each is a node of the same 2-node cluster."""
    root = checkout(tmp_path, dist)
    readme = block("README.md", "MASTER_ADDR=node0").text
    node1 = readme.split("#")[0].replace("NODE_RANK=0", "NODE_RANK=1")  # as its comment says
    plans = run_bash(readme, shell_env(tmp_path, stock, tools), root) + \
        run_bash(node1, shell_env(tmp_path, stock, tools), root) + \
        run_bash(block("docs/platforms/env.md", "MASTER_ADDR=node0").text, shell_env(tmp_path, stock, tools), root)
    assert [(p["platform"], p["cluster"]["nnodes"], p["cluster"]["node_rank"], p["cluster"]["master_addr"],
             p["cluster"]["master_port"]) for p in plans] == [("env", 2, r, "node0", 29500) for r in (0, 1, 0, 1)]


def test_options_and_recovery_blocks_resolve(tmp_path, stock, tools, dist):  # noqa: F811
    """options.md's forms (its first line is the synopsis) and recovery.md's two ways to ask for restarts."""
    root = checkout(tmp_path, dist)
    synopsis, *forms = block("docs/options.md", "ddp-launcher [options]").text.split("\n")
    assert "[options]" in synopsis
    env = shell_env(tmp_path, stock, tools)
    del env["LAUNCHER_DRY_RUN"], env["LAUNCHER_JSON"]  # the lines ask for the dry run themselves
    shown = subprocess.run(["bash", "-e", "-c", "\n".join(forms)], cwd=root, env=env, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr
    (plan,) = plans_of(shown.stdout[shown.stdout.index("{"):])  # the text form first, then the JSON one
    assert "torch.distributed.run" in shown.stdout.split("{", 1)[0] and plan["platform"] == "local"
    text = block("docs/recovery.md", "ddp-launcher --max-restarts 3").text
    assert len(run_bash(text, shell_env(tmp_path, stock, tools), root)) == 2  # both lines accepted
    for line in (t.split("#")[0] for t in text.split("\n") if not t.startswith("#")):
        words = shlex.split(line)
        assigned = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        argv = words[len(assigned) + 1:]  # after the assignments and ddp-launcher
        assert parse_invocation(argv, assigned).options.max_restarts == 3, line


def mounted(words: list[str], mounts: dict[str, str]) -> list[str]:
    """The words with each container path under a mount placed at the mount's directory here."""
    out = []
    for word in words:
        for mount, here in mounts.items():
            if word == mount or word.startswith(mount + "/"):
                word = here + word[len(mount):]
        out.append(word)
    return out


def stock_run(argv: list[str], env: dict[str, str], cwd, python: str) -> dict:
    """``argv`` as the image runs it (``python`` the stock one), a JSON dry run; returns the plan."""
    argv = [python if w == "python" else w for w in argv]
    proc = subprocess.run(argv, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (argv, proc.stderr[-2000:])
    (plan,) = plans_of(proc.stdout)
    return plan


def image_env(tmp_path, stock, **extra: str) -> dict[str, str]:  # noqa: F811
    """The stock image's environment: its Python first on PATH, nothing of ours installed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XDG_CACHE_HOME")}
    (tmp_path / "home").mkdir(exist_ok=True)
    env.update(HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path), LAUNCHER_DRY_RUN="true", LAUNCHER_JSON="true",
               PATH=os.pathsep.join([os.path.dirname(stock["torch_only"]), "/usr/bin", "/bin"]), **extra)
    return env


def configmap(tmp_path, dist) -> str:  # noqa: F811
    """The ddp-launcher ConfigMap as mounted at /opt/ddp: the zipapp, the training scripts, a train.py."""
    opt = tmp_path / "opt-ddp"
    opt.mkdir()
    os.symlink(dist["pyz"], opt / "ddp-launcher.pyz")
    for name in glob.glob(os.path.join(REPO, "train_scripts", "*.py")):
        os.symlink(name, opt / os.path.basename(name))
    (opt / "train.py").write_text("import torch\n")
    return str(opt)


def test_kubernetes_blocks_run_the_zipapp_in_the_stock_image(tmp_path, stock, dist):  # noqa: F811
    """kubernetes.md's PyTorchJob and install.md's container: the stock image (no ``ddp-launcher`` command)
    runs the zipapp from the ConfigMap at /opt/ddp, as the examples do; both pods resolve one cluster."""
    opt = configmap(tmp_path, dist)
    job = yaml.safe_load(block("docs/platforms/kubernetes.md", "apiVersion: kubeflow.org/v1").text)
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    fragment = yaml.safe_load(block("docs/install.md", "containers:").text)
    with open(os.path.join(REPO, "examples", "pytorchjob-per-pod.yaml"), encoding="utf-8") as fh:
        example = yaml.safe_load(fh)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    for spec in (pod, fragment):
        (container,) = spec["containers"]
        assert spec["volumes"] == example["volumes"]  # the ConfigMap of the examples, at the same path
        assert container["volumeMounts"] == example["containers"][0]["volumeMounts"]
        assert container["command"][:2] == ["python", "/opt/ddp/ddp-launcher.pyz"]
        words = mounted(container["command"], {"/opt/ddp": opt})
        plans = [stock_run(words, image_env(tmp_path, stock, KUBERNETES_SERVICE_HOST="10.96.0.1",
                                            MASTER_ADDR="ddp-digits-master-0", MASTER_PORT="23456", WORLD_SIZE="2",
                                            RANK=str(rank)), tmp_path, stock["torch_only"]) for rank in (0, 1)]
        assert [(p["platform"], p["cluster"]["node_rank"], p["cluster"]["nnodes"]) for p in plans] == \
            [("kubeflow", 0, 2), ("kubeflow", 1, 2)]


def vertex_cluster_env(pools: list[int], index: int) -> dict[str, str]:
    cluster = {f"workerpool{p}": [f"cmle-training-workerpool{p}-ab-{i}:2222" for i in range(n)]
               for p, n in enumerate(pools)}
    tasks = [(pool, i) for pool, hosts in cluster.items() for i in range(len(hosts))]
    pool, i = tasks[index]
    spec = {"cluster": cluster, "environment": "cloud", "task": {"type": pool, "index": i}}
    return {"CLUSTER_SPEC": json.dumps(spec)}


def test_vertex_blocks_run_the_installed_package(tmp_path, stock, dist):  # noqa: F811
    """install.md's and vertex.md's pythonPackageSpec: ``python -m launcher ARGS`` where Vertex installed
    the source distribution (the wheel built from it), the script through the /gcs/ mount."""
    opt = configmap(tmp_path, dist)
    full = json.loads(block("docs/platforms/vertex.md", "{\"displayName\"").text)
    pools = full["jobSpec"]["workerPoolSpecs"]
    assert pools[1]["pythonPackageSpec"] == {"...": "the same as pool 0"}
    fragment = json.loads("{" + block("docs/install.md", "\"pythonPackageSpec\"").text + "}")["pythonPackageSpec"]
    for spec in (pools[0]["pythonPackageSpec"], fragment):
        assert os.path.basename(spec["packageUris"][0]) == os.path.basename(dist["sdist"])
        counts = [p["replicaCount"] for p in pools]
        plans = [stock_run([stock["with_wheel"], "-m", spec["pythonModule"],
                            *mounted(spec["args"], {"/gcs/YOUR_BUCKET/ddp": opt})],
                           image_env(tmp_path, stock, **vertex_cluster_env(counts, i)), tmp_path, stock["torch_only"])
                 for i in range(sum(counts))]
        assert [(p["platform"], p["cluster"]["node_rank"], p["cluster"]["nnodes"]) for p in plans] == \
            [("vertex", i, 3) for i in range(3)]


def test_oci_blocks_run_the_artifact(tmp_path, stock, tools, dist):  # noqa: F811
    """install.md's artifact (bundle, zip) and oci.md's job configuration: the job runs the zip's launch.py
    with the arguments, on each node of 2."""
    root = checkout(tmp_path, dist)
    env = shell_env(tmp_path, stock, tools)
    del env["LAUNCHER_DRY_RUN"], env["LAUNCHER_JSON"]
    made = subprocess.run(["bash", "-e", "-c", block("docs/install.md", "python3 -m launcher bundle").text],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    unpacked = tmp_path / "job"
    with zipfile.ZipFile(os.path.join(root, "ddp-digits.zip")) as archive:
        archive.extractall(unpacked)  # what OCI does with the job artifact
    details = json.loads("{" + block("docs/platforms/oci.md", "\"jobConfigurationDetails\"").text + "}")
    details = details["jobConfigurationDetails"]
    meta = tmp_path / "nodes.json"
    meta.write_text(json.dumps([{"Rank": str(i), "IPAddress": f"10.0.1.{i + 5}"} for i in range(2)]))
    entry = details["environmentVariables"]["JOB_RUN_ENTRYPOINT"]
    plans = [stock_run(["python", entry, *shlex.split(details["commandLineArguments"])],
                       image_env(tmp_path, stock, **details["environmentVariables"], JOB_RUN_OCID="ocid1.jobrun.x",
                                 NODE_RANK=str(i), NODE_COUNT="2", CLUSTER_NODES_METADATA_FILE=str(meta)),
                       unpacked, stock["torch_only"]) for i in range(2)]
    assert [(p["platform"], p["cluster"]["node_rank"], p["cluster"]["master_addr"]) for p in plans] == \
        [("oci", 0, "10.0.1.5"), ("oci", 1, "10.0.1.5")]


def test_the_stock_python_builds_the_zipapp_in_a_checkout_and_runs_it(tmp_path, stock, tools, dist):  # noqa: F811
    """install.md's and slurm.md's ``python3 -m launcher zipapp`` with the stock Python (torch, nothing of
    ours installed) in a checkout, and slurm.md's sbatch running that file with it on each of 4 nodes."""
    root = checkout(tmp_path, dist)
    env = shell_env(tmp_path, stock, tools)
    env["PATH"] = os.pathsep.join([tools, os.path.dirname(stock["torch_only"]), "/usr/bin", "/bin"])
    for text, made in ((block("docs/install.md", "python3 -m launcher zipapp --out ddp-launcher.pyz   #").text,
                        os.path.join(root, "ddp-launcher.pyz")),
                       (block("docs/platforms/slurm.md", "python3 -m launcher zipapp").text,
                        os.path.join(env["HOME"], "ddp-launcher.pyz"))):
        assert run_bash(text, env, root) == [] and zipfile.is_zipfile(made), text
    sbatch = block("docs/platforms/slurm.md", "#!/bin/bash\n#SBATCH --job-name=ddp-stock").text
    plans = [p for node in range(4)
             for p in run_bash(sbatch, dict(env, **slurm_env(node, 4, SLURM_GPUS_ON_NODE="8")), root)]
    assert [(p["platform"], p["cluster"]["node_rank"], p["cluster"]["nproc_per_node"], p["argv"][0]) for p in plans] \
        == [("slurm", node, 8, stock["torch_only"]) for node in range(4)]


def test_the_sagemaker_check_plans_4_processes_on_each_of_2_hosts(tmp_path, stock, tools, dist):  # noqa: F811
    """sagemaker.md's check: the bundle, then its launch.py as the second ml.g5.12xlarge runs it (4 GPUs)."""
    root = checkout(tmp_path, dist)
    env = shell_env(tmp_path, stock, tools)
    del env["LAUNCHER_DRY_RUN"]  # the block asks for it, as a hyperparameter
    (plan,) = run_bash(block("docs/platforms/sagemaker.md", "ddp-launcher bundle --out build/bundle").text, env, root)
    assert (plan["platform"], plan["cluster"]["node_rank"], plan["cluster"]["nnodes"],
            plan["cluster"]["nproc_per_node"], plan["cluster"]["master_addr"]) == ("sagemaker", 1, 2, 4, "algo-1")
    assert plan["argv"][-3:] == ["train_resnet.py", "--epochs", "25"]


def test_the_answer_dry_runs_state_the_rule_they_ask_for(tmp_path, stock, tools, dist):  # noqa: F811
    """hangs.md's two lines (the learned default, then a fixed 600 s) and recovery.md's 3 restarts."""
    root = checkout(tmp_path, dist)
    env = shell_env(tmp_path, stock, tools)
    learned, fixed = run_bash(block("docs/hangs.md", "ddp-launcher --dry-run train.py").text, env, root)
    assert learned["hangs"]["on"] and learned["hang_timeout"].startswith("learned: 5 x the longest gap")
    assert fixed["hang_timeout"].startswith("600 s between progress events")
    (plan,) = run_bash(block("docs/recovery.md", "ddp-launcher --dry-run --max-restarts 3").text, env, root)
    assert plan["restarts"]["on"] and plan["restarts"]["why"].startswith("up to 3 job-wide restart(s)")


def test_bundle_blocks_write_the_bundle(tmp_path, stock, tools, dist):  # noqa: F811
    """install.md's bundles: the listing it shows, and a script's own modules taken along (Python and CLI)."""
    root = checkout(tmp_path, dist)
    env = shell_env(tmp_path, stock, tools)
    run_bash(block("docs/install.md", "ddp-launcher bundle train_scripts/train_resnet.py").text, env, root)
    listing = block("docs/install.md", "build/bundle/").text.split("\n")[1:]
    shown = sorted(line.split("#")[0].strip().rstrip("/") for line in listing)
    assert sorted(os.listdir(os.path.join(root, "build", "bundle"))) == shown
    for first in ("from launcher.platforms.sagemaker.bundle import stage_bundle", "ddp-launcher bundle src/train.py"):
        work = tmp_path / ("py" if first.startswith("from") else "cli")
        (work / "src").mkdir(parents=True)
        for name in ("train.py", "model_def.py", "data.py"):
            (work / "src" / name).write_text("import torch\n")
        text = block("docs/install.md", first).text
        argv = [stock["with_wheel"], "-c", text] if first.startswith("from") else ["bash", "-e", "-c", text]
        proc = subprocess.run(argv, cwd=str(work), env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert {"launch.py", "launcher", "train.py", "model_def.py", "data.py"} <= set(os.listdir(work / "build" /
                                                                                                  "bundle"))


def test_the_progress_beat_snippet_sends_the_rank(tmp_path, monkeypatch):
    """hangs.md's four lines, with the address a path and an abstract name: the datagram is the rank."""
    text = block("docs/hangs.md", "beat = socket.socket").text
    for address in (str(tmp_path / "progress.sock"), f"@ddp-docs-test-{os.getpid()}"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
            listener.bind("\0" + address[1:] if address.startswith("@") else address)
            listener.settimeout(60)
            monkeypatch.setenv("DDP_LAUNCHER_PROGRESS", address)
            monkeypatch.setenv("RANK", "3")
            scope = {"socket": socket, "os": os, "contextlib": contextlib}
            exec(compile(text, "hangs.md", "exec"), scope)  # noqa: S102 (the documented snippet itself)
            scope["beat"].close()
            assert listener.recv(64) == b"3"


def test_the_documented_outcome_file_meets_the_schema():
    with open(os.path.join(REPO, "docs", "outcome.schema.json"), encoding="utf-8") as fh:
        schema = json.load(fh)
    jsonschema.validate(json.loads(block("docs/failures.md", "{\"schema\"").text), schema)


def test_the_simulate_answer_is_two_hosts_and_a_lost_one():
    """simulate.md's two lines, checked as simulate checks them before any host starts (nothing starts: the
    jobs themselves are tests/test_simulate.py's): 2 SageMaker hosts, then algo-2 SIGKILLed after 15 s."""
    lines = block("docs/simulate.md", "python -m launcher simulate --hosts 2 -- train_scripts").text.split("\n")
    configs = []
    for line in lines:
        words = shlex.split(line)
        assert words[:4] == ["python", "-m", "launcher", "simulate"], line
        configs.append(simulate_config.build_config(words[4:], REPO))
    hosts = ["algo-1", "algo-2"]
    assert [(c.platform, list(c.hosts), os.path.basename(c.script)) for c in configs] == \
        [("sagemaker", hosts, "train_digits.py")] * 2
    assert [c.faults for c in configs] == [(), (simulate_config.parse_fault("algo-2:SIGKILL:15", hosts),)]


def test_the_python_of_the_tests_is_not_the_stock_one(stock):  # noqa: F811
    """The stand-in is what it claims: the stock Python cannot import the launcher (nothing of ours)."""
    proc = subprocess.run([stock["torch_only"], "-c", "import launcher"], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, cwd="/")
    assert proc.returncode != 0 and stock["torch_only"] != PYTHON


# Each file of examples/ and the tests that run it as written (a real run where its point is the run and it
# can run here; a dry run of every node's command in the stock image otherwise).
K8S_PODS = "test_examples_containers.py::test_each_kubernetes_manifest_resolves_in_its_pods"
EXAMPLE_TESTS = {
    "docker-compose.yaml": ["test_examples_containers.py::test_docker_compose_trains_with_its_read_only_scripts",
                            "test_shipping.py::test_each_container_example_runs_as_written_in_the_stock_image"],
    "jobset-retry.yaml": ["test_examples_containers.py::test_the_jobset_pod_reports_its_end_in_the_termination_message",
                          "test_retry_examples.py::test_the_jobset_fails_at_once_on_any_other_code"],
    "pytorchjob-per-pod.yaml": [K8S_PODS, "test_platform_examples.py::test_pytorchjob_one_process_per_pod"],
    "pytorchjob-nproc-per-node.yaml": [K8S_PODS, "test_platform_examples.py::test_pytorchjob_nproc_per_node"],
    "trainjob.yaml": [K8S_PODS, "test_platform_examples.py::test_trainjob"],
    "oci-job-run.json": ["test_shipping.py::test_oci_runs_the_bundle_as_its_job_artifact"],
    "vertex-worker-pools.json": ["test_shipping.py::test_vertex_runs_the_installed_source_distribution"],
    "pbs_train.sh": ["test_shipping.py::test_each_shell_example_runs_as_written_with_the_pyz"],
    "skypilot-retry.yaml": ["test_shipping.py::test_each_shell_example_runs_as_written_with_the_pyz",
                            "test_retry_examples.py::test_skypilot_recovers_on_the_infrastructure_codes_only"],
    "slurm_train.sbatch": ["test_shipping.py::test_each_shell_example_runs_as_written_with_the_pyz"],
    "slurm_requeue.sbatch": ["test_shipping.py::test_each_shell_example_runs_as_written_with_the_pyz",
                             "test_retry_examples.py::test_the_slurm_script_requeues_infrastructure_failures_only"],
}


def test_every_example_is_run_by_a_test():
    assert sorted(os.listdir(os.path.join(REPO, "examples"))) == sorted(EXAMPLE_TESTS)
    for tests in EXAMPLE_TESTS.values():
        for node in tests:
            module, function = node.split("::")
            with open(os.path.join(REPO, "tests", module), encoding="utf-8") as fh:
                source = fh.read()
            assert f"\ndef {function}(" in source, node
