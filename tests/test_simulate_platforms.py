"""``simulate --platform P``: each builder gives each host what P gives a real node.

Two layers. The pure tests read each host's variables and files as the platform's contract says a
node reads them (an oracle written here, independent of ``launcher/platforms/``; lightning-fabric's
``KubeflowEnvironment`` where it applies) and prove a round trip: every host a distinct node rank,
all agree on the node count and the master, and the master is host 0. The end-to-end tests run a real
2-host x 2-process job per platform and are skipped while the launcher has no module of that name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any
from unittest import mock

import pytest
from conftest import PYTHON, REPO, assert_gone, launcher_env
from test_simulate import Simulate, processes_inside, read_json

from launcher import platforms, simulate
from launcher.errors import ConfigError
from launcher.simulate.config import build_parser
from launcher.simulate.hosts import BUILDERS, builder

WORKER = os.path.join(REPO, "tests", "scripts", "launcher_worker.py")
PORT = 23999
PLAIN = [p for p in BUILDERS if p != "sagemaker"]  # the platforms whose command is python -m launcher
HPC = ("slurm", "pbs")  # tested in test_simulate_hpc.py: their command has a prefix (task PID, host name)
# Each platform's own variables on a host (the caller's and simulate's common ones left out).
PLATFORM_VARIABLES = {
    "kubeflow": {"MASTER_ADDR", "MASTER_PORT", "PET_MASTER_ADDR", "PET_MASTER_PORT", "WORLD_SIZE", "RANK",
                 "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_NNODES"},
    "kubeflow-v2": {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                    "JOB_COMPLETION_INDEX"},
    "oci": {"NODE_RANK", "NODE_COUNT", "INITIAL_CLUSTER_SIZE", "CLUSTER_NODES_METADATA_FILE", "JOB_OCID",
            "JOB_RUN_OCID", "FQDN", "LAUNCHER_MASTER_PORT"},
    "vertex": {"CLUSTER_SPEC", "LAUNCHER_MASTER_PORT"},
    "env": {"MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK"},
}
KUBERNETES = {"HOSTNAME", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBERNETES_SERVICE_PORT_HTTPS",
              "KUBERNETES_PORT", "KUBERNETES_PORT_443_TCP", "KUBERNETES_PORT_443_TCP_PROTO",
              "KUBERNETES_PORT_443_TCP_PORT", "KUBERNETES_PORT_443_TCP_ADDR"}
COMMON = {"PYTHONPATH", "PYTHONUNBUFFERED", "LAUNCHER_GRACE_PERIOD", "LAUNCHER_RESOLVE"}


def build(tmp_path: Any, platform: str, hosts: int, *extra: str) -> tuple[simulate.Config, list]:
    config = simulate.build_config(["--platform", platform, "--hosts", str(hosts), "--workdir",
                                    str(tmp_path / "job"), "--job-name", "pt", *extra, "--", WORKER,
                                    "--steps", "2", "--flag", "a b"], str(tmp_path))
    return config, builder(platform).make_hosts(config, launcher_env(), PORT)


def node_view(platform: str, env: dict[str, str]) -> tuple[int, int, str]:
    """(node rank, node count, master host) as the platform's contract says a node reads them."""
    if platform == "kubeflow":
        return int(env["PET_NODE_RANK"]), int(env["PET_NNODES"]), env["PET_MASTER_ADDR"]
    if platform == "kubeflow-v2":
        return int(env["PET_NODE_RANK"]), int(env["PET_NNODES"]), env["PET_MASTER_ADDR"].split(".")[0]
    if platform == "oci":
        rank_to_ip = {int(m["Rank"]): m["IPAddress"] for m in read_json(env["CLUSTER_NODES_METADATA_FILE"])}
        assert len(rank_to_ip) == int(env["INITIAL_CLUSTER_SIZE"]) == int(env["NODE_COUNT"])
        assert rank_to_ip[0] == "127.0.0.1"
        return int(env["NODE_RANK"]), int(env["NODE_COUNT"]), "node-0"  # rank 0's address is the master
    if platform == "vertex":
        spec = json.loads(env["CLUSTER_SPEC"])
        pools, task = spec["cluster"], spec["task"]
        assert spec["environment"] == "cloud" and len(pools["workerpool0"]) == 1
        rank = 0 if task["type"] == "workerpool0" else 1 + task["index"]
        return rank, sum(len(v) for v in pools.values()), pools["workerpool0"][0].rsplit(":", 1)[0]
    return int(env["NODE_RANK"]), int(env["NNODES"]), env["MASTER_ADDR"]


@pytest.mark.parametrize("platform", [p for p in PLAIN if p not in HPC])
def test_each_host_gets_exactly_the_platform_variables(tmp_path: Any, platform: str) -> None:
    config, specs = build(tmp_path, platform, 3, "--nproc-per-node", "2")
    for spec in specs:
        if spec.on_start is not None:
            spec.on_start()
    caller = launcher_env()
    expected = PLATFORM_VARIABLES[platform] | (KUBERNETES if platform.startswith("kubeflow") else set())
    if platform in ("oci", "vertex", "env"):
        expected = expected | {"LAUNCHER_NPROC_PER_NODE"}  # the platform has no process count
    views = []
    for spec in specs:
        env = dict(spec.env)
        added = {k for k in env if k not in caller or caller[k] != env[k]} - COMMON
        assert added == expected, spec.name
        assert "LAUNCHER_PLATFORM" not in env  # the launcher must find the platform by itself
        assert spec.argv == (sys.executable, "-m", "launcher", WORKER, "--steps", "2", "--flag", "a b")
        assert spec.cwd == spec.base_dir == os.path.join(str(tmp_path / "job"), spec.name)
        assert env["PYTHONPATH"].split(os.pathsep)[0] == REPO
        resolve = dict(item.split("=") for item in env["LAUNCHER_RESOLVE"].split(","))
        assert set(resolve.values()) == {"127.0.0.1"} and set(config.hosts) <= set(resolve)
        rank, nnodes, master = node_view(platform, env)
        views.append((spec.name, rank, nnodes, master))
    assert sorted(rank for _, rank, _, _ in views) == [0, 1, 2]
    assert {(nnodes, master) for _, _, nnodes, master in views} == {(3, specs[0].name)}
    assert [name for name, rank, _, _ in views if rank == 0] == [specs[0].name]


def test_host_names_are_the_platforms() -> None:
    assert builder("kubeflow").host_names("job", 3) == ("job-master-0", "job-worker-0", "job-worker-1")
    assert builder("kubeflow-v2").host_names("job", 2) == ("job-node-0-0", "job-node-0-1")
    assert builder("kubeflow-v2").dns_names("job", 2) == ("job-node-0-0.job", "job-node-0-1.job")
    assert [n.split("-")[0] for n in builder("vertex").host_names("job", 3)] == \
        ["workerpool0", "workerpool1", "workerpool1"]
    assert builder("sagemaker").host_names("job", 2) == ("algo-1", "algo-2")


def test_kubeflow_values_match_the_operator_and_lightning(tmp_path: Any) -> None:
    from lightning_fabric.plugins.environments import KubeflowEnvironment

    for extra, world, nproc in ((("--nproc-per-node", "2"), 6, "2"), ((), 3, "auto")):
        _, specs = build(tmp_path / nproc, "kubeflow", 3, *extra)
        for i, spec in enumerate(specs):
            env = dict(spec.env)
            assert env["WORLD_SIZE"] == str(world) and env["PET_NPROC_PER_NODE"] == nproc
            assert env["RANK"] == env["PET_NODE_RANK"] == str(i) and env["HOSTNAME"] == spec.name
            assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == str(PORT)
            with mock.patch.dict(os.environ, env, clear=True):
                lightning = KubeflowEnvironment()
                assert (lightning.node_rank(), lightning.main_address, lightning.main_port) == \
                    (i, "pt-master-0", PORT)
    _, legacy = build(tmp_path / "legacy", "kubeflow", 3, "--kubeflow-legacy")
    for i, spec in enumerate(legacy):
        assert not [k for k in spec.env if k.startswith("PET_")]
        with mock.patch.dict(os.environ, dict(spec.env), clear=True):
            lightning = KubeflowEnvironment()  # one process per pod: its RANK and WORLD_SIZE are processes'
            assert (lightning.world_size(), lightning.global_rank(), lightning.main_address) == \
                (3, i, "pt-master-0")


def test_kubeflow_v2_sets_only_pet_variables(tmp_path: Any) -> None:
    _, specs = build(tmp_path, "kubeflow-v2", 2)
    for i, spec in enumerate(specs):
        env = dict(spec.env)
        assert env["PET_NPROC_PER_NODE"] == "auto"  # Trainer's default when numProcPerNode is unset
        assert env["PET_MASTER_ADDR"] == "pt-node-0-0.pt" and env["PET_NODE_RANK"] == str(i)
        assert not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"} & set(env)


def test_oci_metadata_file_fills_in_as_nodes_start(tmp_path: Any) -> None:
    _, specs = build(tmp_path, "oci", 3)
    files = [spec.env["CLUSTER_NODES_METADATA_FILE"] for spec in specs]
    assert len(set(files)) == 3 and not any(os.path.exists(f) for f in files)  # no node is up yet
    for up, spec in enumerate(specs, start=1):
        spec.on_start()
        for path in files:
            assert read_json(path) == [{"Rank": r, "IPAddress": "127.0.0.1"} for r in range(up)]
    assert not [n for n in os.listdir(os.path.dirname(files[0])) if ".tmp" in n]


def test_vertex_cluster_spec_is_vertex_format(tmp_path: Any) -> None:
    _, specs = build(tmp_path, "vertex", 3)
    spec0, spec2 = (json.loads(specs[i].env["CLUSTER_SPEC"]) for i in (0, 2))
    assert spec0["task"] == {"type": "workerpool0", "index": 0}
    assert spec2["task"] == {"type": "workerpool1", "index": 1}
    assert spec0["cluster"] == spec2["cluster"] and set(spec0["cluster"]) == {"workerpool0", "workerpool1"}
    assert all(address.endswith(":2222") for pool in spec0["cluster"].values() for address in pool)
    assert [p["replicaCount"] for p in spec0["job"]["workerPoolSpecs"]] == ["1", "2"]
    _, single = build(tmp_path / "one", "vertex", 1)
    assert list(json.loads(single[0].env["CLUSTER_SPEC"])["cluster"]) == ["workerpool0"]


@pytest.mark.parametrize("platform", PLAIN)
def test_builder_does_not_import_the_launchers_platform_module(platform: str) -> None:
    # The builder plays the platform, the launcher reads it: a builder that borrowed the reading code
    # would make the end-to-end tests agree with themselves. No import of launcher.platforms at all.
    import ast
    import importlib

    path = importlib.import_module(BUILDERS[platform]).__file__
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [m for m in imported if m and m.startswith("launcher.platforms")], imported


BAD = [
    (["--platform", "oci", "--channel", "train=."], "--channel is SageMaker-only"),
    (["--platform", "env", "--hyperparameters", "{}"], "--hyperparameters is SageMaker-only"),
    (["--platform", "vertex", "--toolkit"], "--toolkit is SageMaker-only"),
    (["--platform", "kubeflow-v2", "--instance-type", "ml.m5.large"], "--instance-type is SageMaker-only"),
    (["--platform", "oci", "--kubeflow-legacy"], "--kubeflow-legacy needs --platform kubeflow"),
    (["--platform", "kubeflow", "--job-name", "Upper"], "'Upper'"),
    (["--platform", "kubeflow", "--job-name", "j", "--fault", "algo-2:KILL:1"], "j-master-0, j-worker-0"),
    (["--platform", "nope"], "'nope'"),
]


@pytest.mark.parametrize("args,named", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_platform_input_exits_2_and_writes_nothing(tmp_path: Any, args: list[str], named: str) -> None:
    proc = subprocess.run([PYTHON, "-m", "launcher", "simulate", "--hosts", "2", *args, "--", WORKER],
                          cwd=str(tmp_path), env=launcher_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and named in lines[-1], proc.stderr
    assert os.listdir(tmp_path) == []


def _given(action: Any) -> list[str]:
    """``--option`` as a user gives it: no value for a flag, else a value it parses."""
    option = action.option_strings[0]
    if action.nargs == 0:
        return [option]
    return [option, action.choices[0] if action.choices else "x"]


def test_every_builders_option_is_refused_on_every_other_platform(tmp_path: Any) -> None:
    # Which builder declared an option decides the one-line refusal: the builder's own words (SageMaker's
    # "is SageMaker-only") or the common "needs --platform P, not 'Q'"; nothing in config.py names either.
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    script = tmp_path / "train.py"
    script.write_text("")
    assert parser.owners
    for dest, owner in parser.owners.items():
        option = actions[dest].option_strings[0]
        for platform in BUILDERS:
            if platform == owner:
                continue
            with pytest.raises(ConfigError) as caught:
                simulate.build_config(["--platform", platform, "--hosts", "2", *_given(actions[dest]), "--",
                                       str(script)], str(tmp_path))
            wanted = (f"{option} is SageMaker-only (--platform {platform})" if owner == "sagemaker"
                      else f"{option} needs --platform {owner}, not {platform!r}")
            assert str(caught.value) == wanted
    assert os.listdir(tmp_path) == ["train.py"]


# ------------------------------------------------------------------------------------------------
# Real jobs: 2 hosts x 2 processes per platform
# ------------------------------------------------------------------------------------------------

def _job_case(platform: str) -> Any:
    module = platform.replace("-", "_")
    missing = platform not in platforms.PLATFORMS
    return pytest.param(platform, marks=pytest.mark.skipif(
        missing, reason=f"launcher.platforms has no {platform!r} module yet (launcher/platforms/{module}.py): "
                        "a simulated host's launcher could not detect its platform"))


def two_by_two(tmp_path: Any, platform: str, job_name: str, **env: str) -> tuple[Simulate, int, dict, list[dict]]:
    """A 2 hosts x 2 processes job of ``platform`` that must succeed, and nothing of it left: simulate, its
    exit code, its summary, the four ranks' records."""
    records_dir, workdir = tmp_path / "records", str(tmp_path / "job")
    records_dir.mkdir()
    sim = Simulate(["--platform", platform, "--hosts", "2", "--nproc-per-node", "2", "--workdir", workdir,
                    "--job-name", job_name, "--", WORKER, "--steps", "2"], str(tmp_path),
                   env=launcher_env(WORKER_RECORD_DIR=str(records_dir), **env))
    code = sim.finish()
    summary = read_json(os.path.join(workdir, "summary.json"))
    records = [read_json(str(records_dir / f"rank{r}.json")) for r in range(4)]
    pids = {sim.proc.pid, *(h["pid"] for h in summary["hosts"])} | {p for r in records for p in (r["pid"], r["ppid"])}
    assert_gone(pids)
    assert processes_inside(workdir) == []
    assert code == 0, sim.stderr
    return sim, code, summary, records


@pytest.mark.job
@pytest.mark.lab
# SageMaker's 2 x 2 job is tests/test_simulate.py::test_two_hosts_two_processes, which checks all this and more.
@pytest.mark.parametrize("platform", [_job_case(p) for p in BUILDERS if p not in HPC and p != "sagemaker"])
def test_two_hosts_two_processes(tmp_path: Any, platform: str) -> None:
    sim, code, summary, records = two_by_two(tmp_path, platform, "pj")
    assert [r["world_size"] for r in records] == [4] * 4 and [r["group_rank"] for r in records] == [0, 0, 1, 1]
    assert all(r["params"] == records[0]["params"] for r in records)  # DDP kept every replica identical
    master = builder(platform).host_names("pj", 2)[0]
    assert any(line.startswith(f"[{master}] [rank0]:rank 0 of 4 done") for line in sim.out), sim.stdout
    assert [h["exit_code"] for h in summary["hosts"]] == [0, 0] and summary["platform"] == platform
    print(f"\n{platform}, 2 hosts x 2 processes: {sim.duration:.1f} s")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
