"""README's two newcomer commands stay what CI and a user run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_readme_demo_command_is_a_wheel_install_of_the_cpu_torch() -> None:
    demo, tests, *_ = _quick_start_commands()
    assert demo.endswith("ipc-dpsample demo"), demo
    assert "pip install . " in demo, f"the demo installs a normal wheel, not -e: {demo}"
    for command in (demo, tests):
        assert "--index-url https://download.pytorch.org/whl/cpu" in command, command


def test_readme_test_command_is_what_ci_runs() -> None:
    _, tests, *_ = _quick_start_commands()
    pytest_command = tests.rsplit("&&", 1)[1].strip()
    assert pytest_command == "python -m pytest -q", tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"check {pytest_command}\n" in ci, "`.ci/run` must run README's test command"
    assert "pip install -q -e '.[test]'" in ci and "-e '.[test]'" in tests
