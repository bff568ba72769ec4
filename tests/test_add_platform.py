"""The "Add a platform" steps of docs/architecture.md, followed literally on a copy of the package: two modules, two
registry lines, and the new platform is detected, resolved, shown by --help and simulated, with a
simulate option of its own that its builder declares and checks (config.py is not edited)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

from conftest import PYTHON, REPO, launcher_env

PLATFORM_MODULE = '''\
"""Toy: a cluster manager that publishes its hosts in TOY_HOSTS and this host's name in TOY_HOST."""

from __future__ import annotations

from collections.abc import Mapping

from launcher.cluster import Cluster
from launcher.errors import ConfigError
from launcher.platforms.base import HostView, Platform, nproc_per_node


class Toy(Platform):
    """Toy jobs: the host list in TOY_HOSTS, in rank order."""

    name = "toy"
    reads = "TOY_HOSTS (comma-separated, rank order), TOY_HOST; port 29777"
    grace_period = 12.0
    report_limit = 512

    def detect(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        return ("TOY_HOSTS is set",) if environ.get("TOY_HOSTS") else ()

    def resolve(self, environ: Mapping[str, str], host: HostView) -> Cluster:
        hosts = tuple(environ["TOY_HOSTS"].split(","))
        current = environ.get("TOY_HOST") or host.name
        if current not in hosts:
            raise ConfigError(f"this host {current!r} is not in TOY_HOSTS")
        evidence = [f"TOY_HOSTS: {len(hosts)} host(s); {current} is node {hosts.index(current)}"]
        nproc = nproc_per_node(host, evidence)
        return Cluster(platform=self.name, nnodes=len(hosts), node_rank=hosts.index(current),
                       nproc_per_node=nproc, current_host=current, master_addr=hosts[0], master_port=29777,
                       hosts=hosts, local_addr=current, evidence=tuple(evidence))


PLATFORM = Toy()
'''

BUILDER_MODULE = '''\
"""Toy hosts ``toy-0`` .. ``toy-<N-1>``: TOY_HOSTS and TOY_HOST, as the toy manager sets them."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.errors import ConfigError
from launcher.simulate.job import PlatformOptions, plain_script
from launcher.simulate.hosts.base import HostSpec, plain_hosts

NAME = "toy"
SUMMARY_NOTE = "each host's files stay in its directory"


@dataclass(frozen=True)
class ToyOptions(PlatformOptions):
    queue: str = "default"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group("Toy (--platform toy)").add_argument("--toy-queue", default=None,
                                                                   help="the toy manager's queue")


def check_options(args, hosts: Sequence[str], job_name: str, words: Sequence[str], cwd: str):
    if args.toy_queue is not None and not args.toy_queue.isalpha():
        raise ConfigError(f"--toy-queue must be letters: {args.toy_queue!r}")
    return (*plain_script(words, cwd), ToyOptions(args.toy_queue or "default"))


def host_names(job_name: str, count: int) -> tuple[str, ...]:
    return tuple(f"toy-{i}" for i in range(count))


def make_hosts(config, environ: Mapping[str, str], port: int) -> list[HostSpec]:
    return plain_hosts(config, environ, lambda i, _base: {"TOY_HOSTS": ",".join(config.hosts),
                                                          "TOY_HOST": config.hosts[i],
                                                          "TOY_QUEUE": config.options.queue}, resolve=config.hosts)
'''

# Inside the copy: build the simulated hosts, then plan the launch on each (nothing starts).
CHECK = textwrap.dedent('''
    import json, os, sys
    from launcher import cli
    from launcher.errors import ConfigError
    from launcher.simulate.config import build_config
    from launcher.simulate.hosts import builder

    config = build_config(["--platform", "toy", "--hosts", "3", "--workdir", "runs", "--toy-queue", "gpu", "--",
                           "train.py"], os.getcwd())
    specs = builder("toy").make_hosts(config, os.environ, 29777)
    seen = []
    for spec in specs:
        p = cli.plan(["train.py"], spec.env, run_dir="unused")
        seen.append([spec.name, p.choice.platform.name, p.cluster.node_rank, p.cluster.master_addr,
                     spec.env["TOY_QUEUE"]])
    refused = []
    for argv in (["--platform", "env", "--toy-queue", "gpu"], ["--platform", "toy", "--toy-queue", "g-1"]):
        try:
            build_config([*argv, "--hosts", "2", "--", "train.py"], os.getcwd())
        except ConfigError as exc:
            refused.append(str(exc))
    print(json.dumps([seen, refused]))
''')


def follow_the_steps(root: Path) -> Path:
    """A copy of the package with the manual's four steps applied; returns the package's parent."""
    package = root / "launcher"
    shutil.copytree(os.path.join(REPO, "launcher"), package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "platforms" / "toy.py").write_text(PLATFORM_MODULE)                       # step 1
    (package / "simulate" / "hosts" / "toy.py").write_text(BUILDER_MODULE)                # step 2
    registry = package / "platforms" / "__init__.py"                                       # step 3
    text = registry.read_text()
    text = re.sub(r"^(from launcher\.platforms import .*)$", r"\1\nfrom launcher.platforms import toy", text,
                  count=1, flags=re.M)
    text, added = re.subn(r"^(    \(env\.PLATFORM,)", '    (toy.PLATFORM, "TOY_HOSTS is the toy manager\'s alone"),\n'
                          r"\1", text, count=1, flags=re.M)
    assert added == 1, "ORDER has no env entry to put the new platform before"
    registry.write_text(text)
    builders = package / "simulate" / "hosts" / "__init__.py"                              # step 4
    text, added = re.subn(r"^(BUILDERS = \{\n)", '\\1    "toy": "launcher.simulate.hosts.toy",\n',
                          builders.read_text(), count=1, flags=re.M)
    assert added == 1, "no BUILDERS table"
    builders.write_text(text)
    (root / "train.py").write_text("print('never run')\n")
    return root


STEPS = ("launcher/platforms/<name>.py", "launcher/simulate/hosts/<name>.py", "launcher/platforms/__init__.py",
         "launcher/simulate/hosts/__init__.py")


def test_the_manual_gives_the_four_steps_this_test_follows() -> None:
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as fh:
        section = fh.read().split("## Add a platform", 1)[1].split("\n## ", 1)[0]
    steps = re.findall(r"^(\d)\. `([^`]+)`", section, re.M)
    assert steps == [(str(i), path) for i, path in enumerate(STEPS, 1)]
    assert "`ORDER`" in section and "`BUILDERS`" in section and "before the generic `env`" in section


def test_a_new_platform_is_two_modules_and_two_registry_lines(tmp_path: Path) -> None:
    root = follow_the_steps(tmp_path)
    env = launcher_env(PYTHONPATH=str(root))
    out = subprocess.run([PYTHON, "-c", CHECK], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen, refused = json.loads(out.stdout)
    assert seen == [[f"toy-{i}", "toy", i, "toy-0", "gpu"] for i in range(3)]
    # The builder's own option: checked by the builder, refused on another platform in the common words.
    assert refused == ["--toy-queue needs --platform toy, not 'env'", "--toy-queue must be letters: 'g-1'"]
    usage = subprocess.run([PYTHON, "-m", "launcher", "simulate", "--help"], cwd=root, env=env, capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert "--toy-queue" in usage and re.search(r"^  toy +Toy hosts ``toy-0``", usage, re.M), usage
    manual = subprocess.run([PYTHON, "-m", "launcher", "--help"], cwd=root, env=env, capture_output=True,
                            text=True, timeout=60, check=True).stdout
    assert ("toy TOY_HOSTS (comma-separated, rank order), TOY_HOST; port 29777; grace period 12 s; failure "
            "report: its first 512 characters shown") in " ".join(manual.split())
    dry = subprocess.run([PYTHON, "-m", "launcher", "--dry-run", "--json", "train.py"], cwd=root,
                         env={**env, "TOY_HOSTS": "a,b", "TOY_HOST": "b"}, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    plan = json.loads(dry)
    assert (plan["platform"], plan["cluster"]["node_rank"], plan["cluster"]["master_addr"]) == ("toy", 1, "a")
    assert plan["grace_period"] == 12.0
    assert "--node-rank" in plan["argv"] and plan["argv"][plan["argv"].index("--master-port") + 1] == "29777"
