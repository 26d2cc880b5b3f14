"""docs/launcher.md's table of flags lists every option of the pslaunch command."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from launcher.cli import cli

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "launcher.md"


def _flags_table() -> str:
    text = DOC.read_text()
    return text.split("### Flags", 1)[1].split("\n## ", 1)[0]


def test_every_option_of_the_command_is_in_the_flags_table():
    table = _flags_table()
    missing = []
    for param in cli.params:
        if not isinstance(param, click.Option):
            continue
        names = [n for n in (*param.opts, *param.secondary_opts) if n.startswith("--")]
        if not any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", table) for n in names):
            missing.append("/".join(param.opts + param.secondary_opts))
    assert not missing, f"options not in docs/launcher.md's flags table: {missing}"


def test_the_check_sees_an_option_missing_from_the_table():
    table = _flags_table()
    assert re.search(r"(?<![\w-])--gpus-per-worker(?![\w-])", table)
    assert not re.search(r"(?<![\w-])--gpus(?![\w-])", table)  # a prefix of a documented option is not it


def test_the_readmes_exit_codes_are_the_ones_pslaunch_help_lists():
    from launcher.cli import _EPILOG

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    in_readme = {int(code) for row in re.findall(r"^\| ([\d /]+) \|", table, re.M) for code in row.split(" / ")}
    helped = _EPILOG.split("Exit codes:", 1)[1].split("Documentation", 1)[0]
    in_help = {int(code) for code in re.findall(r"(?<![\d+-])(\d+)(?![\d-])", helped) if int(code) not in (1, 128)}
    assert in_readme == in_help, (sorted(in_readme), sorted(in_help))
