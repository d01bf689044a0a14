"""Every ```python block in README.md and docs/ runs as written.

The blocks of one page run in order in one fresh interpreter (later blocks use what earlier
ones defined), in a temporary folder so nothing lands in the checkout.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_every_python_block_runs(page, tmp_path):
    source = "\n\n".join(blocks(page))
    if re.search(r"^\s*(import torch|from somatize\.torch|import somatize\.torch)", source, re.M):
        pytest.importorskip("torch", reason=f"{page.name} needs torch: pip install torch==2.13.0")
        pytest.importorskip("tqdm", reason=f"{page.name} needs tqdm")
    script = tmp_path / f"{page.stem}_blocks.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{page.name}:\n{done.stderr}"
