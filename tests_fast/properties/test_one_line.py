"""limits.one_line: every status line fits its limit, and what it gives up first is a list in
parentheses, never the number before it (issue 54: SDXL's reason lost "27,520 key tokens" and kept
its seven per-shape speedups)."""

from hypothesis import given
from hypothesis import strategies as st

from sage_qual.limits import STATUS_LINE_LIMIT, one_line

SDXL = ("built-in defaults, measured on NVIDIA H200 (sm_90) with torch 2.11.0+cu130: family SDXL kept off: "
        "no speedup at its shapes: sm90-fp8-cuda pays only from 27,520 query / 27,520 key tokens, "
        "head_dim 64, which serves none of them (1024² self, 640 ch 0.55x, 1024² self, 1280 ch 0.20x, "
        "1024² cross, 640 ch 0.10x, 2048² self, 640 ch 0.88x)")


def test_the_list_goes_before_the_number():
    line = one_line(SDXL)
    assert len(line) <= STATUS_LINE_LIMIT
    assert "pays only from 27,520 query / 27,520 key tokens" in line and "0.55x" not in line


def test_advice_in_parentheses_stays_and_the_longest_list_goes_first():
    head = "GPU never measured (run sage-qual certify here): by the strictest of (A, B, C, D, E): "
    text = head + "12,345 tokens (layouts: contiguous, transposed, nhd, fused_qkv)"
    assert one_line(text, 110) == head + "12,345 tokens (...)"
    assert one_line(text, 96) == head.replace("(A, B, C, D, E)", "(...)") + "12,345 tokens (...)"


def test_a_text_that_fits_is_unchanged_and_a_cut_leaves_no_half_aside():
    assert one_line("short (a, b, c)", 50) == "short (a, b, c)"
    assert one_line("a" * 40 + " (no list here at all)", 50) == "a" * 40 + "..."


@given(st.text(alphabet="ab ,()x", max_size=400), st.integers(min_value=10, max_value=250))
def test_every_line_fits_its_limit(text, limit):
    line = one_line(text, limit)
    assert len(line) <= limit and (line == text) == (len(text) <= limit)
