"""The repository keeps its promises: README's commands are the ones CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_readme_has_a_main_job_command_and_a_test_command():
    commands = readme_commands()
    assert any("pip install" in c and ("pslaunch" in c or "examples/" in c) for c in commands), commands
    assert "bash scripts/test.sh" in commands


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^bash scripts/test\.sh\b", ci, flags=re.M)


def test_ci_fails_when_no_test_passed():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "passed" in ci and "exit 1" in ci
