"""The public surface, the README's promises, and the demo."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import somatize
from somatize import errors

ROOT = Path(__file__).resolve().parent.parent


def test_all_is_sorted_and_every_name_exists():
    assert somatize.__all__ == sorted(somatize.__all__)
    for name in somatize.__all__:
        assert hasattr(somatize, name), name


def test_every_error_is_importable_from_somatize():
    for name, value in vars(errors).items():
        if isinstance(value, type) and issubclass(value, Exception):
            assert getattr(somatize, name) is value
            assert name in somatize.__all__


def test_readme_quick_start_has_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```sh\n(.*?)\n```", quick, re.S)
    assert len(commands) == 2
    demo, tests = commands
    assert "somatize demo" in demo
    assert "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_demo_runs_and_recalls_on_its_second_forward(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "somatize", "demo", "--store", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    second = done.stdout.split("-- second forward", 1)[1]
    assert "'fact': 'recalled', 'node': 'embed'" in second
    assert "'node': 'embed', 'took_us'" not in second
    assert "answer:" in second
