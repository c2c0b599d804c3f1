"""Each code candidate waiting for a GPU (bench/candidates/*.diff, applied by `bash bench/gpu_session.sh
candidates` to the device's copy of the tree) still applies to the tree: one written before later commits
touched its files stopped that plan at once ("patch does not apply"), a rare GPU session's call spent."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CANDIDATES = sorted(glob.glob(os.path.join(ROOT, "bench", "candidates", "*.diff")))


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize("patch", CANDIDATES, ids=os.path.basename)
def test_a_candidate_applies_to_the_tree(patch):
    check = subprocess.run(["git", "apply", "--check", patch], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, f"{os.path.relpath(patch, ROOT)} no longer applies: regenerate it\n{check.stderr}"
