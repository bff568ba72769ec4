"""The manual says what the parser does: --help and the option table of docs/options.md come from one table."""

from __future__ import annotations

import re
import subprocess

from conftest import PYTHON, REPO, launcher_env

from launcher import platforms
from launcher.options import help_text, option_rows

ROW = re.compile(r"^\| `(--[^`]+)` \| `(LAUNCHER_[A-Z_]+)` \| (.+) \|$")


OPTIONS_PAGE = f"{REPO}/docs/options.md"


def manual_option_rows() -> list[tuple[str, str, str]]:
    with open(OPTIONS_PAGE, encoding="utf-8") as fh:
        return [m.groups() for m in map(ROW.match, fh.read().splitlines()) if m]


def test_the_manuals_option_table_is_the_parsers():
    expected = "\n".join(f"| `{flag}` | `{env}` | {meaning} |" for flag, env, meaning in option_rows())
    assert manual_option_rows() == option_rows(), f"docs/options.md's option table should read:\n{expected}"


def test_help_is_plain_text_from_the_same_tables():
    out = subprocess.run([PYTHON, "-m", "launcher", "--help"], env=launcher_env(), cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "``" not in out and ":func:" not in out  # plain text, not reStructuredText
    for flag, _env, _meaning in option_rows():
        assert flag in out
    for platform, _why in platforms.ORDER:
        assert re.search(rf"^  {re.escape(platform.name)} ", out, re.M), platform.name


def test_the_manuals_platform_defaults_are_the_platforms_attributes():
    # Grace periods and report limits are facts of the platform modules: docs/options.md's table is generated.
    expected = [f"| `{pl.name}` | {pl.grace_period:g} s | {pl.report_limit or 'stderr only'} |"
                for pl, _ in platforms.ORDER]
    with open(OPTIONS_PAGE, encoding="utf-8") as fh:
        text = fh.read()
    found = re.findall(r"^\| `[a-z0-9-]+` \| [0-9.]+ s \| (?:\d+|stderr only) \|$", text, re.M)
    assert found == expected, "docs/options.md's defaults table should read:\n" + "\n".join(expected)


def test_help_states_each_platforms_grace_period_and_report_from_its_attributes():
    text = " ".join(help_text("", platforms.help_rows(), platforms.argv_help()).split())
    for pl, _ in platforms.ORDER:
        assert f"{pl.name} {pl.reads}; {platforms.stop_and_report(pl)}" in text
    assert "grace period 90 s; failure report: its first 1024 characters shown" in text  # SageMaker's
