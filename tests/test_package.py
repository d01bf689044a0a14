"""The public surface, the README's promises, and the demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import somatize
from somatize import errors

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.pure
def test_all_is_sorted_and_every_name_exists():
    assert somatize.__all__ == sorted(somatize.__all__)
    for name in somatize.__all__:
        assert hasattr(somatize, name), name


@pytest.mark.pure
def test_every_error_is_importable_from_somatize():
    for name, value in vars(errors).items():
        if isinstance(value, type) and issubclass(value, Exception):
            assert getattr(somatize, name) is value
            assert name in somatize.__all__


@pytest.mark.pure
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


def test_contributing_maps_every_test_file_to_what_it_covers():
    table = (ROOT / "CONTRIBUTING.md").read_text().split("## Which tests cover which module", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"\btest_[a-z_]+\b", table))
    files = {path.stem for path in (ROOT / "tests").glob("test_*.py")}
    assert files - named == set(), f"add these to CONTRIBUTING.md's table: {sorted(files - named)}"
    assert named - files == set(), f"CONTRIBUTING.md names test files that are not there: {sorted(named - files)}"


def test_a_pure_test_that_opens_a_socket_or_starts_a_process_fails_even_if_it_swallows_the_error(tmp_path):
    (tmp_path / "test_guarded.py").write_text(
        "import subprocess, sys\n"
        "import pytest, zmq\n\n"
        "@pytest.mark.pure\n"
        "def test_socket():\n"
        "    try:\n"
        "        zmq.Context.instance().socket(zmq.DEALER)\n"
        "    except Exception:\n"
        "        pass  # code under test that swallows what it met\n\n"
        "@pytest.mark.pure\n"
        "def test_process():\n"
        "    subprocess.run([sys.executable, '-c', 'pass'])\n\n"
        "@pytest.mark.pure\n"
        "def test_pure():\n"
        "    assert sum(range(4)) == 6\n\n"
        "def test_not_marked():\n"
        "    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-q",
            "-rA",
            "-o",
            "markers=pure",
            str(tmp_path / "test_guarded.py"),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    said: dict[str, set[str]] = {}
    for kind, name in re.findall(r"^(PASSED|FAILED|ERROR) \S+::(test_\w+)", out, re.M):
        said.setdefault(name, set()).add(kind)
    assert said["test_pure"] == {"PASSED"} and said["test_not_marked"] == {"PASSED"}, out
    assert said["test_socket"] & {"FAILED", "ERROR"} and said["test_process"] & {"FAILED", "ERROR"}, out
    assert "a pure test opened a ZeroMQ socket" in out and "a pure test started a process" in out, out
    assert done.returncode == 1, out


def test_every_command_is_one_of_python_m_somatize():
    """The command-line entry points are in one place: `python -m somatize` lists every
    command and hands the broker's and the worker's their own options, as `python -m
    somatize.broker` and `python -m somatize.worker` (what host tables name) read them."""
    listed = subprocess.run([sys.executable, "-m", "somatize", "--help"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    for name in ("broker", "worker", "demo", "keys", "study", "view"):
        assert re.search(rf"^\s+{name}\s", listed.stdout, re.M), listed.stdout
    for name, option in (("broker", "--allow-workers"), ("worker", "--offer")):
        via = subprocess.run(
            [sys.executable, "-m", "somatize", name, "--help"], capture_output=True, text=True, timeout=60
        )
        direct = subprocess.run(
            [sys.executable, "-m", f"somatize.{name}", "--help"], capture_output=True, text=True, timeout=60
        )
        assert via.returncode == direct.returncode == 0 and option in via.stdout
        assert via.stdout == direct.stdout
