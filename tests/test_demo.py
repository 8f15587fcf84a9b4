"""The README's main command on its embedded defaults learns for real: RL lifts held-out
exact-match accuracy by at least 20 points over the SFT start."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_learns(prefect_server, tmp_path, capsys):
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "demo", "-c", str(ROOT / "deployments" / "demo.yaml"), f"storage.root={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(r"accuracy ([\d.]+)% \(SFT\) → ([\d.]+)%", out.stdout)
    assert match, out.stdout[-2000:]
    before, after = float(match.group(1)), float(match.group(2))
    with capsys.disabled():
        print(f"\n[demo] held-out exact-match accuracy {before}% (SFT) -> {after}% (RL)")
    assert after - before >= 20.0
    assert (tmp_path / "runs" / "demo" / "final" / "MANIFEST.json").exists()
