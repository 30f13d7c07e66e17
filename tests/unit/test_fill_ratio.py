"""The guest's memory must compress like real guest RAM, or compression results lie."""

import shutil
import subprocess
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parents[2] / "guest" / "agent"


@pytest.mark.skipif(shutil.which("zstd") is None, reason="zstd CLI missing (make setup)")
@pytest.mark.parametrize(("fill", "lo", "hi"), [
    ("mixed", 1.9, 3.2), ("text", 2.5, 4.5), ("random", 0.95, 1.05)])
def test_zstd1_ratio_of_filled_memory(tmp_path, fill, lo, hi):
    subprocess.run(["make", "-s", "-C", str(AGENT), f"OUT={tmp_path}",
                    f"{tmp_path}/dumpfill"], check=True, timeout=300)
    dump = subprocess.run([str(tmp_path / "dumpfill"), fill, "32"], capture_output=True,
                          check=True).stdout
    packed = subprocess.run(["zstd", "-1", "-c"], input=dump, capture_output=True,
                            check=True).stdout
    ratio = len(dump) / len(packed)
    print(f"{fill}: zstd -1 ratio {ratio:.2f}")
    assert lo <= ratio <= hi
