"""`Served`, what a profile serves for one family (issue 41): its checks, its one phrasing and its
short form, and the WrapperConfig it gives a capability. Every reader states a range through these,
so each wording rule has its test here."""

import pytest

from sage_qual.kernels.contexts import CONTEXTS
from sage_qual.kernels.variants import KERNEL_HEAD_DIMS, LAYOUTS, VARIANTS
from sage_qual.serving.config import DEFAULT_CONFIG
from sage_qual.serving.profile_matching import served_config, served_nothing
from sage_qual.verdicts.served import Bound, Served

SM90 = (9, 0)
BOUND = Bound("key", 17, "flux1_ip_adapter_zero_uncond: output not finite")


def served(**fields) -> Served:
    base = dict(variant="sm90-fp8-cuda", min_query_tokens=9728, min_key_tokens=9728, head_dims=[128],
                max_query_tokens=75600, max_key_tokens=75600, layouts=["contiguous", "transposed"],
                contexts=["side_stream", "compile"])
    return Served(**{**base, **fields})


def test_the_one_phrasing_of_a_verified_range():
    assert served(bounds=[BOUND]).text() == (
        "from 9,728 to 75,600 tokens, head_dim 128 (layouts: contiguous, transposed; contexts: side_stream, "
        "compile); calls with fewer than 17 keys stay on torch (flux1_ip_adapter_zero_uncond: output not "
        "finite)"
    )


def test_a_range_of_one_length_reads_as_one_length():
    """Issue 43: "from 16,384 to 16,384 tokens"."""
    one = served(min_query_tokens=16384, min_key_tokens=16384, max_query_tokens=16384, max_key_tokens=16384)
    assert one.text().startswith("at 16,384 tokens, head_dim 128")
    assert one.short().startswith("sm90-fp8-cuda 16,384 tokens, head_dim 128")


def test_query_and_key_ranges_that_differ_are_given_apart():
    cross = served(min_key_tokens=512, max_key_tokens=512, head_dims=[64, 128], contexts=[])
    assert cross.text() == (
        "from 9,728 to 75,600 query / 512 key tokens, head_dim 64/128 (layouts: contiguous, "
        "transposed; contexts: none)"
    )
    assert cross.short() == (
        "sm90-fp8-cuda 9,728 to 75,600 query / 512 key tokens, head_dim 64/128 (contiguous, "
        "transposed; contexts: none)"
    )


def test_without_long_checks_no_upper_bound_is_claimed():
    legacy = served(max_query_tokens=None, max_key_tokens=None, layouts=None, contexts=None, bounds=[BOUND])
    assert not legacy.range_verified
    assert legacy.text() == ("from 9,728 query / 9,728 key tokens, head_dim 128 (no upper bound verified: a "
                             "report without long checks); calls with fewer than 17 keys stay on torch "
                             "(flux1_ip_adapter_zero_uncond: output not finite)")
    assert legacy.short() == "sm90-fp8-cuda >= 9728/9728, head_dim 128 (keys >= 17)"


def test_the_short_form_carries_contexts_and_bounds():
    assert served(bounds=[BOUND]).short() == (
        "sm90-fp8-cuda 9,728 to 75,600 tokens, head_dim 128 (contiguous, "
        "transposed; contexts: side_stream, compile; keys >= 17)"
    )


def test_any_layout_the_built_in_contexts_and_masked_calls_in_both_forms():
    """A range verified with no layout, under the built-in context rule (null), serving masked calls,
    kept off below two bounds; a key range left null is the query range."""
    queries = Bound("query", 5, "z: wrong")
    ck = served(variant="ck-int8-cuda", max_key_tokens=None, layouts=None, contexts=None, masks=True,
                bounds=[BOUND, queries])
    assert ck.text() == (
        "from 9,728 to 75,600 tokens, head_dim 128 (layouts: any; masked calls too); calls with fewer than "
        "17 "
        "keys stay on torch (flux1_ip_adapter_zero_uncond: output not finite); calls with fewer than 5 query "
        "tokens stay on torch (z: wrong)"
    )
    assert ck.short() == ("ck-int8-cuda 9,728 to 75,600 tokens, head_dim 128 (any layout; masks; keys >= 17; "
                          "query tokens >= 5)")
    legacy = served(variant="ck-int8-cuda", max_query_tokens=None, max_key_tokens=None, masks=True)
    assert legacy.text() == ("from 9,728 query / 9,728 key tokens, head_dim 128 (no upper bound verified: a "
                             "report without long checks; masked calls too)")
    assert legacy.short() == "ck-int8-cuda >= 9728/9728, head_dim 128 (masks)"
    assert (
        served(max_query_tokens=None, max_key_tokens=None).short()
        == "sm90-fp8-cuda >= 9728/9728, head_dim 128"
    )


def test_the_smallest_range_is_one_token_and_a_range_may_be_one_length():
    assert served(min_query_tokens=1, min_key_tokens=1, max_query_tokens=1, max_key_tokens=1).check() == []
    assert served(max_query_tokens=9728, max_key_tokens=9728).check() == []


def test_the_checks_list_what_is_known_in_full():
    assert served(variant="sm99").check() == [("variant", "'sm99' is not a SageAttention variant sage-qual "
                                                          f"knows ({', '.join(VARIANTS)})")]
    assert served(head_dims=[]).check() == [("head_dims", "empty: name the head sizes served")]
    assert served(head_dims=[96]).check() == [("head_dims", "96 is not a head size the kernels take "
                                                            f"({', '.join(map(str, KERNEL_HEAD_DIMS))})")]
    assert served(layouts=[]).check() == [("layouts", "empty: name the verified layouts, or null for any")]
    assert served(layouts=["diagonal"]).check() == [
        ("layouts", f"'diagonal' is not a layout sage-qual knows ({', '.join(LAYOUTS)})")]
    assert served(masks=True).check() == [
        ("masks", "is true, but sm90-fp8-cuda takes no attn_mask: set it false")]
    assert served(contexts=["compile", "compile"]).check() == [
        ("contexts", "names a context twice, not a list of execution contexts sage-qual knows "
                     f"({', '.join(CONTEXTS)}); [] for none, null for the built-in rule")]


@pytest.mark.parametrize("change, field, words", [
    (dict(variant="sm99"), "variant", "'sm99' is not a SageAttention variant"),
    (dict(min_query_tokens=0), "min_query_tokens", "is 0, expected a token count of at least 1"),
    (dict(head_dims=[]), "head_dims", "empty"),
    (dict(head_dims=[96]), "head_dims", "96 is not a head size the kernels take"),
    (dict(max_query_tokens=100), "max_query_tokens", "below min_query_tokens 9728"),
    (dict(max_key_tokens=100), "max_key_tokens", "below min_key_tokens 9728"),
    (dict(layouts=[]), "layouts", "empty"),
    (dict(layouts=["diagonal"]), "layouts", "'diagonal' is not a layout"),
    (dict(contexts=["graphs"]), "contexts", "'graphs' is not"),
    (dict(contexts=["compile", "compile"]), "contexts", "names a context twice"),
])
def test_each_check_names_its_field(change, field, words):
    [(found, problem)] = served(**change).check()
    assert found == field and words in problem
    assert served().check() == []


def test_its_config_serves_the_variant_on_its_capability_only_within_its_range():
    config = served_config(served(bounds=[BOUND]), DEFAULT_CONFIG, SM90, max_span_elements=1_000_000)
    assert config.kernel_table[SM90] == ("sm90-fp8-cuda",)
    assert config.kernel_table[(8, 9)] == DEFAULT_CONFIG.kernel_table[(8, 9)]
    assert (config.min_query_tokens, config.max_query_tokens, config.max_key_tokens) == (9728, 75600, 75600)
    assert (config.head_dims, config.layouts, config.contexts) == ((128,), ("contiguous", "transposed"),
                                                                   ("side_stream", "compile"))
    assert config.bounds == (BOUND,) and config.max_span_elements == 1_000_000
    assert served_config(served(), DEFAULT_CONFIG, SM90).max_span_elements == DEFAULT_CONFIG.max_span_elements
    legacy = served(max_query_tokens=None, max_key_tokens=None, layouts=None, contexts=None)
    legacy_config = served_config(legacy, DEFAULT_CONFIG, SM90)
    assert (legacy_config.layouts, legacy_config.contexts) == (None, None)
    off = served_nothing(DEFAULT_CONFIG, SM90)
    assert off.kernel_table[SM90] == () and off.min_query_tokens == DEFAULT_CONFIG.min_query_tokens
