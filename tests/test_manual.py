"""The manual says what the parser does: --help and the README's option table come from one table."""

from __future__ import annotations

import re
import subprocess

from conftest import PYTHON, REPO, launcher_env

from launcher import platforms
from launcher.options import option_rows

ROW = re.compile(r"^\| `(--[^`]+)` \| `(LAUNCHER_[A-Z_]+)` \| (.+) \|$")


def readme_option_rows() -> list[tuple[str, str, str]]:
    with open(f"{REPO}/README.md", encoding="utf-8") as fh:
        return [m.groups() for m in map(ROW.match, fh.read().splitlines()) if m]


def test_readme_option_table_is_the_parsers():
    expected = "\n".join(f"| `{flag}` | `{env}` | {meaning} |" for flag, env, meaning in option_rows())
    assert readme_option_rows() == option_rows(), f"README's option table should read:\n{expected}"


def test_help_is_plain_text_from_the_same_tables():
    out = subprocess.run([PYTHON, "-m", "launcher", "--help"], env=launcher_env(), cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "``" not in out and ":func:" not in out  # plain text, not reStructuredText
    for flag, _env, _meaning in option_rows():
        assert flag in out
    for platform, _why in platforms.ORDER:
        assert re.search(rf"^  {re.escape(platform.name)} ", out, re.M), platform.name
