"""Environments as real platforms produce them (tests/data/real/<platform>/*.json), each resolved by the
launcher's dry run (:func:`launcher.cli.plan`, the path ``--dry-run`` takes) to the plan a person expects
from the platform's documentation: the platform, and torchrun's node count, node rank, processes per node,
master address and port. See tests/data/real/README.md for the format."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import pytest

from launcher import cli, groups
from launcher.options import Options
from launcher.platforms.base import HostView, look_once

CORPUS = Path(__file__).parent / "data" / "real"
PLATFORMS = ("sagemaker", "slurm", "pbs", "kubeflow", "trainer-v2", "vertex", "oci", "env")
RETRIEVED = "2026-11-28"
DIRECTORY = {"kubeflow-v2": "trainer-v2"}  # the launcher's platform name -> the corpus directory, where they differ
ENTRIES = sorted(CORPUS.glob("*/*.json"))


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _flag(argv: tuple[str, ...], name: str) -> Optional[str]:
    """The value of torchrun's ``name`` before the script (``--``), else None."""
    head = argv[:argv.index("--")] if "--" in argv else argv
    return head[head.index(name) + 1] if name in head else None


def _materialise(entry: dict[str, Any], root: Path) -> tuple[dict[str, str], Path]:
    """The entry's files written under ``root`` and its environment with ``{tmp}`` pointing there; the
    host's GPUs as device files in the returned directory."""
    for name, content in entry.get("files", {}).items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    env = {k: v.replace("{tmp}", str(root)) for k, v in entry["env"].items()}
    dev = root / "dev"
    dev.mkdir()
    for i in range(entry.get("gpus", 0)):
        (dev / f"nvidia{i}").touch()
    return env, dev


@pytest.mark.parametrize("path", ENTRIES, ids=[f"{p.parent.name}/{p.stem}" for p in ENTRIES])
def test_real_environment_resolves_to_the_expected_plan(path: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The dry run reads the entry's environment and files on its host and plans what its ``expect`` says."""
    entry = _load(path)
    env, dev = _materialise(entry, tmp_path)

    def host_view(options: Options, dev_dir: str = "/dev", sys_dir: str = "/sys") -> HostView:
        return HostView(dev_dir=str(dev), sys_dir=str(tmp_path / "sys"), hostname=entry["hostname"], wait=look_once)

    monkeypatch.setattr(cli, "host_view", host_view)
    monkeypatch.chdir(tmp_path)
    argv = entry["argv"]
    (tmp_path / argv[0]).write_text("print('training')\n")
    run_dir = str(tmp_path / "run")
    plan = cli.plan(argv, env, run_dir=run_dir)
    expect = entry["expect"]
    assert not os.path.exists(run_dir), "a dry run creates nothing"
    if expect.get("trains") is False:  # a host outside the training world: the script once, told where the world is
        assert (plan.cluster.platform, groups.outside(plan.cluster)) == (expect["platform"], True)
        assert "torch.distributed.run" not in plan.launch.argv
        assert plan.launch.env_changes.get("MASTER_ADDR") == expect["master_addr"]
        assert plan.launch.env_changes.get("MASTER_PORT") == str(expect["master_port"])
        assert list(plan.cluster.hosts) == expect["hosts"]  # the training world, which this host is not in
        assert plan.cluster.current_host not in expect["hosts"]
        return
    torchrun = plan.launch.argv
    seen = {
        "platform": plan.cluster.platform,
        "nnodes": int(_flag(torchrun, "--nnodes") or 0),
        "node_rank": int(_flag(torchrun, "--node-rank") or 0),
        "nproc_per_node": int(_flag(torchrun, "--nproc-per-node") or 0),
        "master_addr": _flag(torchrun, "--master-addr"),
        "master_port": int(_flag(torchrun, "--master-port") or 0) or None,
    }
    wanted = {key: expect.get(key) for key in seen}
    assert seen == wanted, f"{path.name}: the dry run planned {seen}"
    assert cli.describe(plan, as_json=False)  # the dry run's text is printable for it
    if "hosts" in expect:
        assert list(plan.cluster.hosts) == expect["hosts"]
    for key in ("current_host", "job_name"):
        if key in expect:
            assert getattr(plan.cluster, key) == expect[key]


def test_corpus_covers_every_platform_with_recorded_sources() -> None:
    """At least 5 entries per platform and 40 in all; each records where it came from, when, what was
    completed, and a plan; each sits in its platform's directory."""
    counts = Counter(p.parent.name for p in ENTRIES)
    assert set(counts) == set(PLATFORMS), counts
    assert min(counts.values()) >= 5, counts
    assert sum(counts.values()) >= 40, counts
    for path in ENTRIES:
        entry = _load(path)
        source = entry["source"]
        assert source.get("url") or source.get("repository"), path
        assert source.get("retrieved") == RETRIEVED, path
        assert isinstance(entry.get("completed"), list), path
        assert entry["env"] and entry["argv"] and entry["hostname"], path
        platform = entry["expect"]["platform"]
        assert DIRECTORY.get(platform, platform) == path.parent.name, path
        assert set(entry) <= {"source", "completed", "env", "files", "hostname", "gpus", "argv", "expect"}, path
