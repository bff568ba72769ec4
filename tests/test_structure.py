"""The package's shape, read from its source with ``ast``: which modules may import which."""

from __future__ import annotations

import ast
import glob
import os
import re

from conftest import REPO

PACKAGE = os.path.join(REPO, "launcher")


def modules_under(folder: str) -> list[str]:
    """Every ``.py`` file under ``launcher/<folder>``, as a path."""
    root = os.path.join(PACKAGE, folder)
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".py"))


def imported(path: str) -> set[str]:
    """The modules a file imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``), at any depth."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_platforms_never_see_the_launchers_options() -> None:
    # A platform reads the cluster (environment + HostView) and nothing else; options meet it in command.py.
    offenders = {os.path.relpath(p, REPO): sorted(n for n in imported(p) if n.startswith(("launcher.options",
                                                                                            "launcher.cli")))
                 for p in modules_under("platforms")}
    assert {p: n for p, n in offenders.items() if n} == {}


def test_the_package_map_names_every_module_and_only_existing_ones() -> None:
    import launcher

    named = set(re.findall(r"``([a-z_0-9/]+)``", launcher.__doc__.split("Map of the modules", 1)[1]))
    named = {n for n in named if "/" in n or os.path.exists(os.path.join(PACKAGE, n + ".py"))}
    modules = set()
    for path in modules_under(""):
        rel = os.path.relpath(path, PACKAGE)[:-3]
        if rel in ("__init__", "__main__"):
            continue
        modules.add(rel[:-len("__init__")] if rel.endswith("/__init__") else rel)
    words = set(re.findall(r"``([a-z_0-9/]+)``", launcher.__doc__))
    assert modules - words == set(), "modules the map in launcher/__init__.py does not name"
    assert {n for n in named if n not in modules} == set(), "the map names modules that do not exist"


def test_how_it_works_names_functions_that_exist() -> None:
    # docs/architecture.md "How it works": every "`launcher/x.py` `name()`" (and "then `other()`") names a function.
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as fh:
        section = fh.read().split("## How it works", 1)[1].split("\n## ", 1)[0]
    pairs = re.findall(r"`(launcher/[a-z_/]+\.py)` `([a-z_]+)\(\)`(?:, then `([a-z_]+)\(\)`)?", section)
    assert len(pairs) >= 6, pairs
    missing = []
    for path, *names in pairs:
        with open(os.path.join(REPO, path), encoding="utf-8") as fh:
            defined = {n.name for n in ast.walk(ast.parse(fh.read())) if isinstance(n, ast.FunctionDef)}
        missing += [f"{path}: {name}()" for name in names if name and name not in defined]
    assert missing == []


def imported_modules(path: str) -> set[str]:
    """The modules a file imports, each as the module itself (``from a import b``: ``a.b`` when ``b`` is a
    module of the repository, else ``a``)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                base = os.path.join(REPO, *sub.split("."))
                names.add(sub if os.path.exists(base + ".py") or os.path.isdir(base) else node.module)
    return names


def test_simulated_host_builders_import_no_other_builder_and_no_platform_reading() -> None:
    from launcher.simulate.hosts import BUILDERS

    builders = set(BUILDERS.values())
    # AWS's side of SageMaker, which the simulator plays with the launcher's own copy (hosts/base.py says why)
    aws_side = {"launcher.platforms.sagemaker.argv", "launcher.platforms.sagemaker.bundle"}
    sideways, platform_reading = {}, {}
    for path in modules_under(os.path.join("simulate", "hosts")):
        module = "launcher." + os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
        names = imported_modules(path)
        if module in builders:
            sideways[module] = sorted(names & (builders - {module}))
        platform_reading[module] = sorted(n for n in names if n.startswith("launcher.platforms") and n not in aws_side)
    assert {m: n for m, n in sideways.items() if n} == {}
    assert {m: n for m, n in platform_reading.items() if n} == {}
    assert len(sideways) == len(builders)  # every builder was looked at


def test_one_module_knows_how_to_become_a_host() -> None:
    # sethostname and bind mounts happen in launcher/simulate/become.py only (the lab, PBS and SDK v3 use it).
    # The SLURM lab is not a simulated host: it builds a whole cluster (its own PID namespace, controller, nodes).
    offenders = []
    for path in modules_under("simulate"):
        if path.endswith((os.sep + "become.py", os.sep + "slurm_lab.py")):
            continue
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        if re.search(r"sethostname|libc\.mount|\"--bind\"", text):
            offenders.append(os.path.relpath(path, REPO))
    assert offenders == []



def read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def test_simulate_config_imports_no_builder_module_and_names_no_platform() -> None:
    # config.py parses the neutral job description: it knows the registry of builders, never one builder,
    # and no platform by name (each builder declares and checks its own options).
    from launcher.simulate.hosts import BUILDERS

    path = os.path.join(PACKAGE, "simulate", "config.py")
    assert sorted(n for n in imported_modules(path)
                  if n.startswith(("launcher.simulate.hosts.", "launcher.platforms"))) == []
    text = read(path)
    # "env" is also the word for an environment: that platform is looked for as the name "env" only.
    words = {n for name in BUILDERS if name != "env" for n in (name, name.replace("-", "_"))} | {"aws", "kubernetes"}
    named = {w for w in words if re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", text, re.I)}
    assert named == set() and '"env"' not in text


def test_the_job_description_and_the_builders_never_import_the_parser() -> None:
    # The parser (config.py) imports the registry of builders; a builder importing the parser back would make
    # a cycle: builders, like everything below the parser, take the job description from job.py.
    below = [os.path.join(PACKAGE, "simulate", "job.py"),
             *glob.glob(os.path.join(PACKAGE, "simulate", "hosts", "*.py"))]
    importers = [p for p in below if "launcher.simulate.config" in imported_modules(p)]
    assert len(below) > 10 and importers == []
    assert not any(n.startswith("launcher.simulate") for n in imported_modules(below[0]))


def test_every_platform_option_lives_in_its_builder() -> None:
    # A platform's options are declared by its builder (add_options, in the builder's module or a helper module
    # beside it that the builder imports); config.py names none of them; Config is the neutral job description
    # and one platform-owned object.
    import dataclasses
    import importlib

    from launcher.simulate.config import build_parser
    from launcher.simulate.hosts import builder
    from launcher.simulate.job import Config

    parser = build_parser()
    assert parser.owners == {**dict.fromkeys(("instance_type", "channel", "hyperparameters", "toolkit", "sdk",
                                              "sm_drivers", "code", "instance_groups"), "sagemaker"),
                             "kubeflow_legacy": "kubeflow"}
    config_text = read(os.path.join(PACKAGE, "simulate", "config.py"))
    neutral = [a.option_strings[0] for a in parser._actions if a.dest not in parser.owners and a.dest != "help"]
    assert neutral and [o for o in neutral if f'"{o}"' not in config_text] == []  # the rest: config.py's own
    for dest, owner in parser.owners.items():
        option = "--" + dest.replace("_", "-")
        assert option not in config_text, option
        module = builder(owner)
        helpers = [importlib.import_module(m).__file__ for m in imported_modules(module.__file__)
                   if m.startswith("launcher.simulate.hosts.")]
        assert any(f'"{option}"' in read(p) for p in [module.__file__, *helpers]), (option, owner)
    assert {f.name for f in dataclasses.fields(Config)} == {
        "platform", "hosts", "nproc_per_node", "workdir", "job_name", "script", "script_args", "faults",
        "grace_period", "network", "network_note", "platform_stop", "deadline", "options"}


def package_imports() -> dict[str, set[str]]:
    """Each module of the package (``launcher.x.y``) and the package modules it imports, at any depth of its code
    (an import inside a function counts: it runs when that function does)."""
    graph = {}
    for path in modules_under(""):
        rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        module = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
        graph[module] = imported_modules(path)
    return {m: {n for n in names if n in graph and n != m} for m, names in graph.items()}


def test_the_imports_form_no_circle() -> None:
    graph = package_imports()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for name in sorted(graph[module]):
            if seen.get(name) == 1:
                circles.append(path[path.index(name):] + [name])
            elif name not in seen:
                visit(name, [*path, name])
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])
    assert len(graph) > 40 and circles == []


def test_nothing_below_cli_imports_cli() -> None:
    # cli ties the steps together; only the front door (entry: ddp-launcher, python -m launcher) stands above it.
    importers = sorted(m for m, names in package_imports().items() if "launcher.cli" in names)
    assert importers == ["launcher.entry"]


# What starts or talks to processes, threads and sockets: run() uses them, plan() and the dry run never do.
SERVICES = ("launcher.supervise", "launcher.jobwatch", "launcher.generations", "launcher.hangwatch",
            "launcher.stacks", "launcher.proctree", "launcher.workerlogs", "launcher.logspace", "launcher.preflight")


def test_plan_imports_no_service_module(tmp_path) -> None:
    # cli's own imports (those at its top, run by every start) name no service ...
    path = os.path.join(PACKAGE, "cli.py")
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    top = {f"{n.module}.{a.name}" if n.module == "launcher" else n.module
           for n in tree.body if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
    assert top and sorted(top & set(SERVICES)) == []
    # ... and a whole dry run, of a job with the watch, hang detection and restarts on, loads none.
    script = tmp_path / "train.py"
    script.write_text("")
    probe = ("import json, sys\nfrom launcher import cli\n"
             f"p = cli.plan(['--dry-run', '--max-restarts', '2', {str(script)!r}], "
             "{'SM_HOSTS': '[\"algo-1\",\"algo-2\"]', 'SM_CURRENT_HOST': 'algo-1', 'PATH': '/usr/bin'})\n"
             "text = cli.describe(p, False) + cli.describe(p, True)\n"
             "print(json.dumps([p.watch.on, p.hangs.on, p.restarts.on, sorted(sys.modules)]))\n")
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    watch, hangs, restarts, loaded = json.loads(out.stdout)
    assert (watch, hangs, restarts) == (True, True, True)
    assert sorted(set(loaded) & set(SERVICES)) == []


def _loose(annotation: ast.expr | None) -> bool:
    """True for a parameter's annotation that says nothing: none, ``Any`` or ``object``, alone or in an
    ``Optional``/``Union`` (inside a container, as a JSON value's type, ``Any`` is allowed)."""
    if annotation is None:
        return True
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        return _loose(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.Name):
        return annotation.id in ("Any", "object")
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Any"
    if isinstance(annotation, ast.BinOp):  # X | Y
        return _loose(annotation.left) or _loose(annotation.right)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in ("Optional", "Union"):
        inner = annotation.slice
        return any(_loose(e) for e in (inner.elts if isinstance(inner, ast.Tuple) else [inner]))
    return False


def loose_parameters(path: str) -> list[str]:
    """Every parameter of every function in ``path`` (methods' ``self``/``cls`` aside) annotated with nothing,
    ``Any`` or ``object``, as ``function(parameter)``."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p is not None)]
        found += [f"{node.name}({p.arg})" for i, p in enumerate(params)
                  if not (i == 0 and p.arg in ("self", "cls")) and _loose(p.annotation)]
    return found


def test_the_loose_parameter_check_finds_what_it_looks_for(tmp_path) -> None:
    source = ("from typing import Any, Optional, Union\n"
              "def f(a, b: Any, c: object, d: Optional[Any], e: 'Union[int, object]', f: Any | None, *g: int,\n"
              "      h: dict[str, Any], i: Optional[int], j: 'typing.Any', **k) -> Any: ...\n"
              "class C:\n    def m(self, x: int) -> None: ...\n")
    path = tmp_path / "sample.py"
    path.write_text(source)
    assert loose_parameters(str(path)) == ["f(a)", "f(b)", "f(c)", "f(d)", "f(e)", "f(f)", "f(j)", "f(k)"]


def test_the_run_core_has_no_loose_parameter() -> None:
    # The verdict and the generations take the run (launcher/runcontext.py) and typed values: no parameter is
    # Any or object (a JSON value's type inside a container may be Any); nor has the run context or the plan.
    names = ("generations.py", "report.py", "runcontext.py", "plan.py")
    assert {name: loose_parameters(os.path.join(PACKAGE, name)) for name in names} == dict.fromkeys(names, [])


def calls_by_function(path: str) -> dict[str, set[str]]:
    """For each top-level function of ``path``, the names it calls (``f(...)`` and ``module.f(...)`` give ``f``)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    calls = {}
    for top in tree.body:
        if isinstance(top, (ast.FunctionDef, ast.ClassDef)):
            calls[top.name] = {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(top)
                               if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}
    return calls


def test_one_rule_turns_a_torchrun_end_into_a_class_and_a_code() -> None:
    # classify and code_of are applied in one place (report.class_and_code), torchrun's evidence read into a root
    # cause in one (report.torchrun_end), and the verdict and the generations both read an end through it.
    callers: dict[str, list[str]] = {}
    for path in modules_under(""):
        module = os.path.relpath(path, PACKAGE)
        for function, called in calls_by_function(path).items():
            for name in ("classify", "code_of", "find_root_cause", "torchrun_end"):
                if name in called:
                    callers.setdefault(name, []).append(f"{module}:{function}")
    assert callers == {"classify": ["report.py:class_and_code"], "code_of": ["report.py:class_and_code"],
                       "find_root_cause": ["report.py:torchrun_end"],
                       "torchrun_end": ["generations.py:_own_end", "report.py:judge"]}


def test_the_run_context_and_the_plan_load_no_service_module() -> None:
    # report imports the run context's types for its signature: they come from jobwatch, proctree and progress
    # only while type checking, so a dry run (which loads report) still starts no service.
    import subprocess
    import sys

    probe = "import sys\nimport launcher.runcontext, launcher.plan, launcher.report\nprint(sorted(sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    loaded = set(ast.literal_eval(out.stdout))
    assert {"launcher.runcontext", "launcher.plan"} <= loaded and sorted(loaded & set(SERVICES)) == []


def watch_attributes_set(path: str) -> list[str]:
    """``name.attr = ...`` (or augmented; ``name`` also ``x.name``) where ``name`` is a job watch (a name ending in
    ``watch``), in ``path``."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            owner = target.value if isinstance(target, ast.Attribute) else None
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name.endswith("watch") and name != "hangwatch":
                found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {name}.{target.attr}")
    return found


def test_no_attribute_of_the_watch_is_set_from_outside(tmp_path) -> None:
    # The job watch's state is its own: outside launcher/jobwatch/ it is changed through its methods only.
    sample = tmp_path / "sample.py"
    sample.write_text("watch.policy = None\njob_watch.stop_at += 1\nself.watch.off = ''\n"
                      "watch.finish(0, '', True)\nother.x = 1\n")
    assert [line.split(": ", 1)[1] for line in watch_attributes_set(str(sample))] == [
        "watch.policy", "job_watch.stop_at", "watch.off"]
    outside = [path for path in glob.glob(os.path.join(REPO, "launcher", "**", "*.py"), recursive=True)
               if os.sep + "jobwatch" + os.sep not in path]
    assert [hit for path in outside for hit in watch_attributes_set(path)] == []
