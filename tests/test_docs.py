"""The manual as a site: it builds with ``mkdocs --strict``, every page is in the nav, the pages outside the
site (README.md, CONTRIBUTING.md) link to files and headings that exist, and a measured figure has one
value wherever it is quoted."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import PYTHON, REPO

DOCS = Path(REPO) / "docs"
OUTSIDE_THE_SITE = ("README.md", "CONTRIBUTING.md")
FIGURES_PAGE = "docs/benchmarks.md"
MARK = re.compile(r"<!--fig:([a-z0-9-]+)-->(.*?)<!--/fig-->")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Rows of the option table are the parser's own help text (tests/test_manual.py), not written here.
GENERATED_ROW = re.compile(r"^\| `--[^`]+` \| `LAUNCHER_[A-Z_]+` \| ")
MAX_ROW = 300
INTERNAL_WORDS = re.compile(r"session \d|\bseed script\b|the seed's|main before this change", re.I)


def pages() -> dict[str, str]:
    """Every Markdown file of the manual, by its path from the repository's root."""
    found = {os.path.relpath(p, REPO): p.read_text(encoding="utf-8") for p in sorted(DOCS.rglob("*.md"))}
    for name in OUTSIDE_THE_SITE:
        found[name] = Path(REPO, name).read_text(encoding="utf-8")
    return found


def nav_pages(nav: list) -> list[str]:
    """The pages ``mkdocs.yml``'s nav names, at any depth."""
    names: list[str] = []
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            names += nav_pages(value) if isinstance(value, list) else [value]
    return names


def figure_disagreements(texts: dict[str, str], defining: str) -> list[str]:
    """One line per problem with the measured figures: a key quoted with two values, a key that ``defining``
    (the table of figures) does not give, or a decimal figure of that table quoted elsewhere without its key."""
    places: dict[str, dict[str, list[str]]] = {}
    for path, text in texts.items():
        for key, value in MARK.findall(text):
            places.setdefault(key, {}).setdefault(value, []).append(path)
    problems = []
    for key, values in places.items():
        if not any(defining in paths for paths in values.values()):
            problems.append(f"figure {key!r} is not in {defining} ({', '.join(sorted(set(sum(values.values(), []))))})")
        if len(values) > 1:
            problems.append(f"figure {key!r} has {len(values)} values: " + "; ".join(
                f"{value!r} in {', '.join(sorted(set(paths)))}" for value, paths in sorted(values.items())))
    decimals = {value for key, values in places.items() for value, paths in values.items()
                if defining in paths and re.fullmatch(r"\d+\.\d+(?: s)?", value)}
    for path, text in texts.items():
        if path != defining:
            unmarked = MARK.sub("", text)
            problems += [f"{path}: {value!r} is quoted without its key" for value in sorted(decimals)
                         if re.search(rf"(?<![\d.]){re.escape(value)}(?![\d])", unmarked)]
    return problems


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) and GitHub give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return re.sub(r"[ ]", "-", text)


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown file's headings (outside code blocks)."""
    found, in_code = set(), False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            found.add(slug(line.lstrip("#")))
    return found


def test_the_site_builds_strictly_with_every_page_in_the_nav(tmp_path: Path) -> None:
    with open(os.path.join(REPO, "mkdocs.yml"), encoding="utf-8") as fh:
        config = yaml.safe_load(fh)
    in_nav = nav_pages(config["nav"])
    on_disk = sorted(os.path.relpath(p, DOCS) for p in DOCS.rglob("*.md"))
    assert sorted(in_nav) == on_disk, "mkdocs.yml's nav and the pages under docs/ differ"
    assert len(in_nav) == len(set(in_nav)), "a page is in the nav twice"
    out = subprocess.run([PYTHON, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    site = tmp_path / "site"
    unbuilt = [p for p in on_disk if not (site / ("" if p == "index.md" else p[:-3]) / "index.html").is_file()]
    assert unbuilt == [], "pages the build did not write"

def test_readme_and_contributing_link_to_files_and_headings_that_exist() -> None:
    broken = []
    for name in OUTSIDE_THE_SITE:
        text = Path(REPO, name).read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = Path(REPO, path) if path else Path(REPO, name)
            if not file.exists():
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
                broken.append(f"{name}: {target} (no such heading)")
    assert broken == []


def test_a_measured_figure_has_one_value_wherever_it_is_quoted() -> None:
    texts = pages()
    assert len(MARK.findall(texts[FIGURES_PAGE])) >= 15
    assert figure_disagreements(texts, FIGURES_PAGE) == []
    quoted = {key for path, text in texts.items() if path != FIGURES_PAGE for key, _ in MARK.findall(text)}
    assert {"launcher-vs-torchrun", "host-loss-collective", "venv-v3-install", "throughput-bf16"} <= quoted


@pytest.mark.parametrize(("quote", "problem"), [
    ("<!--fig:loss-->1.53 s<!--/fig-->", None),
    ("<!--fig:loss-->1.06 s<!--/fig-->", "figure 'loss' has 2 values: '1.06 s' in b.md; '1.53 s' in a.md"),
    ("<!--fig:ratio-->1.017<!--/fig-->", "figure 'ratio' is not in a.md (b.md)"),
    ("1.53 s", "b.md: '1.53 s' is quoted without its key"),
    ("11.53 s or 1.534 s", None),
])
def test_the_figure_check_names_a_disagreement(quote: str, problem: str | None) -> None:
    texts = {"a.md": "| x | <!--fig:loss-->1.53 s<!--/fig--> |", "b.md": f"the host was lost in {quote}."}
    assert figure_disagreements(texts, "a.md") == ([problem] if problem else [])


def test_tables_stay_readable_and_the_text_renders_without_internal_words() -> None:
    long_rows, marks_first, internal = [], [], []
    for path, text in pages().items():
        for number, line in enumerate(text.splitlines(), 1):
            plain = MARK.sub(r"\2", line)
            if plain.lstrip().startswith("|") and len(plain) > MAX_ROW and not GENERATED_ROW.match(plain):
                long_rows.append(f"{path}:{number}: {len(plain)} characters")
            if line.lstrip().startswith("<!--fig:"):  # an HTML block there: it would end a list or paragraph
                marks_first.append(f"{path}:{number}")
            if INTERNAL_WORDS.search(line):
                internal.append(f"{path}:{number}: {line.strip()[:80]}")
    assert long_rows == []
    assert marks_first == []
    assert internal == []
    assert len(Path(REPO, "README.md").read_text(encoding="utf-8").splitlines()) <= 200


def test_the_readmes_slurm_example_gives_4_nodes_of_8_processes(tmp_path: Path, monkeypatch) -> None:
    # The front door's SLURM recipe, as SLURM's srun step would see it on node 2 of 4: 32 processes.
    from launcher import cli

    readme = Path(REPO, "README.md").read_text(encoding="utf-8")
    recipe = readme.split("**SLURM**", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert re.findall(r"#SBATCH --(nodes|ntasks-per-node|gpus-per-node)=(\d+)", recipe) == [
        ("nodes", "4"), ("ntasks-per-node", "1"), ("gpus-per-node", "8")]
    words = recipe.split("srun --ntasks-per-node=1 ddp-launcher ", 1)[1].split()
    (tmp_path / words[0]).write_text("print('never run')\n")
    monkeypatch.chdir(tmp_path)
    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[01-04]", "SLURM_NODEID": "1",
            "SLURMD_NODENAME": "gpu02", "SLURM_GPUS_ON_NODE": "8", "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
            "PATH": os.environ.get("PATH", "")}
    plan = cli.plan(words, step, run_dir=str(tmp_path / "run"))
    cluster = plan.cluster
    assert (plan.choice.platform.name, cluster.nnodes, cluster.nproc_per_node, cluster.node_rank,
            cluster.master_addr) == ("slurm", 4, 8, 1, "gpu01")
