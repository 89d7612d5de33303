"""The suite's own machinery: tests sharing an expensive fixture land on one pytest-xdist worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SUITE = '''
import pytest

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    pass

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
'''


def test_a_group_runs_on_one_worker(tmp_path: Path) -> None:
    """`--dist loadgroup` keeps an xdist_group on one worker (it silently stopped under pytest 9.2, so the 50 s
    side-by-side runs were made once per worker)."""
    (tmp_path / "test_groups.py").write_text(SUITE)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup",
                           "-v", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTEST_ADDOPTS": ""})
    assert done.returncode == 0, done.stdout[-2000:]
    workers = {name: set() for name in ("grouped", "free")}
    for worker, name in re.findall(r"\[(gw\d+)\].*PASSED .*::test_(grouped|free)\[", done.stdout):
        workers[name].add(worker)
    assert len(workers["grouped"]) == 1, done.stdout[-2000:]
    assert workers["free"], done.stdout[-2000:]
