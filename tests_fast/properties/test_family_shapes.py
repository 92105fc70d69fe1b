"""The families' shapes and call spaces: the key a timed shape is shared by, its FLOPs, the two shape
builders, each call-space problem a declaration can have, the longest call, and which fixtures count
for which family (with the memory bound they are judged by)."""

import pytest

from sage_qual.limits import MEMORY_BOUND
from sage_qual.qualification import families
from sage_qual.qualification.families import (
    FAMILIES,
    CallSite,
    Family,
    Shape,
    call_space_problems,
    counts_for,
    cross_attention,
    family_of,
    find,
    memory_bound,
    self_attention,
    site,
)


def test_a_shape_key_names_every_field_and_grouped_heads():
    assert Shape(24, 24, 4608, 4608, 128).key == "b1 h24 q4608 k4608 d128 bfloat16"
    assert Shape(48, 12, 4608, 1024, 64, "float16", 2).key == "b2 h48/12 q4608 k1024 d64 float16"


def test_shapes_that_differ_anywhere_have_different_keys():
    base = Shape(24, 24, 4608, 4608, 128)
    others = [Shape(25, 25, 4608, 4608, 128), Shape(24, 12, 4608, 4608, 128), Shape(24, 24, 4609, 4608, 128),
              Shape(24, 24, 4608, 4609, 128), Shape(24, 24, 4608, 4608, 64),
              Shape(24, 24, 4608, 4608, 128, "float16"), Shape(24, 24, 4608, 4608, 128, batch=2)]
    assert len({base.key, *(s.key for s in others)}) == len(others) + 1


def test_flops_count_both_matrix_products():
    # QK^T and PV: 2 x 2 x N_q x N_k x D per head and item.
    assert Shape(3, 3, 10, 20, 8, batch=2).flops == 4.0 * 2 * 3 * 8 * 10 * 20
    assert Shape(3, 1, 10, 20, 8).flops == 4.0 * 3 * 8 * 10 * 20  # query heads, not K/V heads


def test_as_dict_holds_every_field():
    assert Shape(4, 2, 10, 20, 64, "float16", 3).as_dict() == {
        "heads": 4, "kv_heads": 2, "q_tokens": 10, "kv_tokens": 20, "head_dim": 64, "dtype": "float16",
        "batch": 3}


def test_self_attention_builds_equal_token_counts_and_defaults():
    assert self_attention(24, 4608) == Shape(24, 24, 4608, 4608, 128, "bfloat16", 1)
    assert self_attention(48, 100, 64, kv_heads=12, dtype="float16") == Shape(48, 12, 100, 100, 64, "float16")


def test_cross_attention_builds_its_own_key_length():
    assert cross_attention(10, 4096, 77) == Shape(10, 10, 4096, 77, 128, "bfloat16", 1)
    assert cross_attention(10, 4096, 77, 64, dtype="float16") == Shape(10, 10, 4096, 77, 64, "float16")


# Call-site problems -------------------------------------------------------------------------------

def test_a_consistent_site_has_no_problem():
    assert site("ok", self_attention(8, 100), self_attention(8, 200)).problems() == []
    assert site("equal", self_attention(8, 100), self_attention(8, 100)).problems() == []
    assert site("gqa", self_attention(8, 10, kv_heads=2), self_attention(8, 20, kv_heads=2)).problems() == []


@pytest.mark.parametrize("smallest, largest", [
    (self_attention(8, 100), self_attention(16, 200)),
    (self_attention(8, 100, kv_heads=4), self_attention(8, 200, kv_heads=8)),
    (self_attention(8, 100, 64), self_attention(8, 200, 128)),
    (self_attention(8, 100, dtype="float16"), self_attention(8, 200)),
])
def test_a_site_whose_ends_differ_in_heads_head_dim_or_dtype_says_so(smallest, largest):
    assert site("s", smallest, largest).problems() == [
        "s: smallest and largest differ in heads, head_dim or dtype"]


@pytest.mark.parametrize("smallest, largest", [
    (self_attention(8, 201), self_attention(8, 200)),
    (cross_attention(8, 100, 78), cross_attention(8, 100, 77)),
    (cross_attention(8, 101, 77), cross_attention(8, 100, 77)),
])
def test_a_smallest_call_longer_than_the_largest_says_so(smallest, largest):
    assert site("s", smallest, largest).problems() == ["s: smallest call is longer than the largest"]


def test_heads_not_a_multiple_of_kv_heads_says_so():
    assert site("s", self_attention(6, 10, kv_heads=4), self_attention(6, 20, kv_heads=4)).problems() == [
        "s: 6 heads are not a multiple of 4 KV heads"]


def test_site_builds_a_call_site():
    a, b = self_attention(8, 1), self_attention(8, 2)
    assert site("x", a, b) == CallSite("x", a, b)


def test_call_space_problems_names_the_family_and_each_problem():
    good = site("s", self_attention(8, 100), self_attention(8, 200))
    bad = site("t", self_attention(8, 300), self_attention(8, 200))
    none = Family("None", (), calls=())
    unknown_layout = Family("Odd", (), calls=(good,), layouts=("contiguous", "diagonal"))
    no_contiguous = Family("NoRef", (), calls=(good,), layouts=("transposed",))
    wrong_site = Family("Wrong", (), calls=(good, bad))
    assert call_space_problems((none,)) == ["None: no call sites declared"]
    assert call_space_problems((unknown_layout,)) == [
        "Odd: layouts ['contiguous', 'diagonal'] (known: contiguous, transposed, fused_qkv, nhd; contiguous "
        "is the reference and always declared)"]
    assert call_space_problems((no_contiguous,))[0].startswith("NoRef: layouts ['transposed']")
    assert call_space_problems((wrong_site,)) == ["Wrong: t: smallest call is longer than the largest"]
    assert call_space_problems((Family("Fine", (), calls=(good,)),)) == []
    assert len(call_space_problems((none, unknown_layout, wrong_site))) == 3


def test_the_shipped_families_declare_usable_call_spaces():
    assert call_space_problems() == []


# The longest call -------------------------------------------------------------------------------

def test_the_longest_call_is_the_largest_site_with_most_query_then_key_tokens():
    short = site("short", self_attention(8, 100), self_attention(8, 1000))
    long_ = site("long", self_attention(8, 100), self_attention(8, 2000))
    cross = site("cross", cross_attention(8, 100, 77), cross_attention(8, 2000, 77))
    wide = site("wide", cross_attention(8, 100, 77), cross_attention(8, 2000, 3000))
    assert Family("F", (), calls=(short, long_, cross)).longest == self_attention(8, 2000)
    assert Family("F", (), calls=(cross, long_)).longest == self_attention(8, 2000)
    assert Family("F", (), calls=(long_, wide)).longest == cross_attention(8, 2000, 3000)
    # The smallest ends never count, however long.
    assert Family("F", (), calls=(site("s", self_attention(8, 5000), self_attention(8, 10)),)).longest == \
        self_attention(8, 10)


def test_wan_22s_longest_call_is_a14b_at_1280x720x81():
    assert find("Wan 2.2").longest == self_attention(40, 75600)


# Which fixtures count for which family ------------------------------------------------------------

def test_a_family_owns_its_fixtures_whatever_the_spelling():
    qwen = find("Qwen-Image")
    for spelling in ("Qwen-Image", "qwen_image", "qwenimage", " QWEN IMAGE "):
        assert qwen.owns(spelling)
    assert not qwen.owns("qwen")
    assert qwen.key == "qwenimage"


def test_find_and_family_of():
    assert find("flux.1").name == "FLUX.1" and find("wan22").name == "Wan 2.2"
    with pytest.raises(KeyError, match="unknown family 'FLUX.3' .known: FLUX.1, FLUX.2, "):
        find("FLUX.3")
    assert family_of("sdxl") is find("SDXL")
    assert family_of("generic") is None and family_of("nothing") is None


def test_a_fixture_counts_for_its_own_family_and_generic_ones_for_every_family():
    flux, sdxl = find("FLUX.1"), find("SDXL")
    assert counts_for(flux, "flux.1") and not counts_for(sdxl, "flux.1")
    assert counts_for(flux, "generic") and counts_for(sdxl, "Generic")
    assert counts_for(None, "flux.1") and counts_for(None, "anything")
    assert not counts_for(flux, "")


def test_a_fixture_is_judged_by_its_owners_memory_bound(monkeypatch):
    owned = Family("Tight", (), memory_bound=1.25, calls=FAMILIES[0].calls)
    monkeypatch.setattr(families, "FAMILIES", (owned, *FAMILIES))
    assert memory_bound("tight") == 1.25
    assert memory_bound("generic") == MEMORY_BOUND
    assert memory_bound("no such family") == MEMORY_BOUND
    assert memory_bound("flux.1") == FAMILIES[0].memory_bound
