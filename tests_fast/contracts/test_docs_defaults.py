"""The reference docs state the built-in defaults and compare's rule as the code has them (issue 54:
guide.md and certify.md gave the defaults as "runs 29 and 30, from 12,672 tokens, an H100 gets the
H200's" and compare's tolerance as "each threshold within 10 %", long after both changed)."""

import re
from pathlib import Path

import pytest

from sage_qual.cli import compare
from sage_qual.serving import defaults

from ..helpers import flat

DOCS = Path(__file__).resolve().parents[2] / "docs"
READ = {name: flat((DOCS / name).read_text()) for name in ("guide.md", "certify.md")}


def runs_sentence() -> str:
    """"runs 29, 30 and 40 on the H200, 42 and 43 on the H100 80GB HBM3", from the file's sources."""
    _, sources = defaults.read()
    per_gpu: dict[str, list[int]] = {}
    for source in sources:
        number = int(re.search(r"run(\d+)", source.file).group(1))
        per_gpu.setdefault(source.gpu, [])
        if number not in per_gpu[source.gpu]:
            per_gpu[source.gpu].append(number)

    def listed(numbers):
        words = [str(n) for n in sorted(numbers)]
        return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
    return "runs " + ", ".join(f"{listed(numbers)} on the {gpu.removeprefix('NVIDIA ')}"
                               for gpu, numbers in per_gpu.items())


def served_from(name: str) -> tuple[int, int]:
    measured, _ = defaults.read()
    [gpu] = [g for g in measured.gpus if g.name == name]
    return gpu.default.served.min_query_tokens, gpu.default.served.max_query_tokens


def strictest_sm90() -> int:
    measured, _ = defaults.read()
    return defaults.most_conservative([g.default for g in measured.gpus
                                       if tuple(g.capability) == (9, 0)]).served.min_query_tokens


@pytest.mark.parametrize("doc", list(READ))
def test_the_built_in_defaults_are_stated_as_the_shipped_file_has_them(doc):
    text = READ[doc]
    h200, up_to = served_from("NVIDIA H200")
    h100, _ = served_from("NVIDIA H100 80GB HBM3")
    assert runs_sentence() in text
    assert f"an H200 gets the sm90 kernel from {h200:,} to {up_to:,} tokens" in text
    assert f"an H100 80GB HBM3 from {h100:,}" in text
    assert re.search(rf"an sm_90 GPU never measured[^.]*from {strictest_sm90():,}", text, re.IGNORECASE)


@pytest.mark.parametrize("doc", list(READ))
def test_compares_rule_is_stated_as_the_code_has_it(doc):
    text = READ[doc]
    assert f"--tolerance (default {compare.DEFAULT_TOLERANCE:g}" in text
    assert "each threshold within" not in text and "--tolerance 0.1]" not in text


ROOT = DOCS.parent
EVERY_PAGE = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]


@pytest.mark.parametrize("page", EVERY_PAGE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_gives_compares_tolerance_as_the_code_has_it(page):
    """The fleet recipes' README said "within `compare`'s 10 %" after the default became 0.05: any
    "compare's N %" or "--tolerance (default X" on any page must be the code's default."""
    text = flat(page.read_text())
    percents = re.findall(r"compare`?'s (\d+(?:\.\d+)?) ?%", text)
    defaults_given = re.findall(r"--tolerance[^)]{0,40}?default:? (\d*\.\d+)", text)
    expected = compare.DEFAULT_TOLERANCE
    assert [float(p) / 100 for p in percents if float(p) / 100 != expected] == []
    assert [float(d) for d in defaults_given if float(d) != expected] == []
