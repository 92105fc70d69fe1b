"""The committed evidence stays small enough to travel: every device call carries the whole tracked
tree, 64 MiB at most (fixtures 30 MB of it), and the H200 provider builds ride beside it. Reports,
logs and tables over 32 KB are kept gzip-compressed under docs/results/ (121 files there went from
27.9 MB to 6.2 MB so), and sage-qual reads them as they are (`sage_qual.jsonfile`)."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
COMPRESSED_ALREADY = (".gz", ".tgz", ".png")
LARGEST_PLAIN = 32 * 1024
# The tracked tree's budget: room beside it, under the 64 MiB a call carries, for thu-ml's source
# (0.6 MB) and half of comfy-kitchen's wheel (two calls of about 17 MB: docs/providers.md).
TREE_BUDGET = 45 * 10**6


def tracked(under: str = ".") -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z", under], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in names.decode().split("\0") if name and (ROOT / name).is_file()]


def test_every_large_text_file_of_the_evidence_is_compressed():
    plain = [str(p.relative_to(ROOT)) for p in tracked("docs/results")
             if p.suffix not in COMPRESSED_ALREADY and p.stat().st_size > LARGEST_PLAIN
             and p.name != "README.md"]
    assert not plain, f"gzip -9 -n these (and point their readers at the .gz): {plain}"


def test_every_committed_report_is_compressed():
    assert not [p for p in tracked("docs/results") if p.name == "report.json"]


def test_the_tracked_tree_leaves_room_for_the_providers_on_a_device_call():
    total = sum(p.stat().st_size for p in tracked())
    assert total < TREE_BUDGET, f"tracked tree {total / 1e6:.1f} MB: compress or drop evidence"
