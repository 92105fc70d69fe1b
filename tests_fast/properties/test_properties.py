"""Properties (hypothesis) of the decisions a wrong edge case would silently change: where a variant
pays (`speed.break_even`, `speed.serves`) and where each wrapper rule starts refusing
(`eligibility.refusal`). The family's variant choice: test_family_choice.py.

Examples are derandomized so that CI and `tox -e mutate` see the same cases on every run.
"""

import collections
import dataclasses
import itertools

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from sage_qual.kernels.variants import KERNEL_HEAD_DIMS
from sage_qual.qualification import families
from sage_qual.qualification.measure import speed
from sage_qual.serving.config import WrapperConfig
from sage_qual.serving.eligibility import SdpaCall, bind, refusal
from sage_qual.serving.scope import ScopeReport

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None)

# break_even and serves ---------------------------------------------------------------------------
# Few distinct lengths and sizes, so that points share thresholds and ties are common; speedups
# include the exact thresholds (1.0 is the default min_speedup) as often as values around them.
TOKENS = st.sampled_from([77, 512, 1024, 4096, 16384])
HEAD_DIMS = st.sampled_from([64, 96, 128])
SPEEDUPS = st.sampled_from([0.0, 0.5, 0.99, 1.0, 1.01, 1.2, 2.0]) | st.floats(0.0, 3.0)
POINT = st.tuples(TOKENS, TOKENS, HEAD_DIMS, SPEEDUPS)
POINTS = st.lists(POINT, max_size=8)
MIN_SPEEDUP = st.sampled_from([1.0, 0.5, 1.2])


def served(thresholds, points):
    return [p for p in points if speed.serves(thresholds, p[0], p[1], p[2])]


def candidates(points):
    """Every threshold set break_even may choose from: head_dim sets and measured lengths."""
    dims = sorted({d for _, _, d, _ in points})
    for size in range(1, len(dims) + 1):
        for head_dims in itertools.combinations(dims, size):
            for min_q, min_k in itertools.product({q for q, *_ in points}, {k for _, k, *_ in points}):
                t = speed.Thresholds(min_q, min_k, list(head_dims), 0, len(points))
                yield dataclasses.replace(t, served_shapes=len(served(t, points)))


def feasible(thresholds, points, min_speedup):
    chosen = served(thresholds, points)
    return bool(chosen) and all(s > min_speedup for *_, s in chosen)


@PROPERTY
@given(POINTS, MIN_SPEEDUP)
@example([(4096, 512, 128, 1.0)], 1.0)  # exactly break-even is not faster
@example([(1024, 512, 128, 2.0), (4096, 512, 128, 0.5)], 1.0)  # faster only below a slower length
def test_break_even_is_none_exactly_when_no_shape_pays_from_its_size_up(points, min_speedup):
    """Thresholds are lower bounds, so a faster shape can be served only together with every
    measured shape of its head size that is at least as long: None when no shape has that
    (in particular when no shape was faster at all)."""
    def pays_from(p):
        return all(s > min_speedup for q, k, d, s in points if q >= p[0] and k >= p[1] and d == p[2])

    thresholds = speed.break_even(points, min_speedup)
    assert (thresholds is None) == (not any(pays_from(p) for p in points))
    if not any(s > min_speedup for *_, s in points):
        assert thresholds is None


@PROPERTY
@given(POINTS, MIN_SPEEDUP)
def test_every_served_shape_was_faster_and_the_counts_are_true(points, min_speedup):
    thresholds = speed.break_even(points, min_speedup)
    assume(thresholds is not None)
    chosen = served(thresholds, points)
    assert chosen and all(s > min_speedup for *_, s in chosen)
    assert thresholds.served_shapes == len(chosen)
    assert thresholds.measured_shapes == len(points)
    # Thresholds sit at measured values: nothing is served where nothing was measured.
    assert thresholds.min_query_tokens in {q for q, *_ in points}
    assert thresholds.min_key_tokens in {k for _, k, *_ in points}
    assert thresholds.head_dims == sorted(set(thresholds.head_dims))
    assert set(thresholds.head_dims) <= {d for _, _, d, _ in points}


@PROPERTY
@given(POINTS, MIN_SPEEDUP)
@example([(1024, 1024, 128, 2.0), (4096, 4096, 128, 2.0), (1024, 1024, 64, 0.5)], 1.0)
@example([(1024, 512, 128, 2.0), (1024, 512, 64, 2.0)], 1.0)  # equal counts: fewer head sizes
def test_break_even_serves_most_shapes_then_fewest_head_sizes_then_largest_thresholds(points, min_speedup):
    thresholds = speed.break_even(points, min_speedup)
    assume(thresholds is not None)

    def rank(t):
        return len(served(t, points)), -len(t.head_dims), t.min_query_tokens, t.min_key_tokens

    best = max(rank(t) for t in candidates(points) if feasible(t, points, min_speedup))
    assert rank(thresholds) == best


@PROPERTY
@given(POINTS, st.randoms(use_true_random=False))
def test_break_even_does_not_depend_on_the_order_of_measurements(points, random):
    shuffled = list(points)
    random.shuffle(shuffled)
    assert speed.break_even(shuffled) == speed.break_even(points)


@PROPERTY
@given(POINTS, st.lists(st.floats(0.0, 2.0), min_size=8, max_size=8))
def test_raising_speedups_never_serves_fewer_shapes(points, raises):
    faster = [(q, k, d, s + up) for (q, k, d, s), up in zip(points, raises, strict=False)]
    before, after = speed.break_even(points), speed.break_even(faster)
    if before is not None:
        assert after is not None and after.served_shapes >= before.served_shapes


@PROPERTY
@given(st.lists(st.tuples(TOKENS, SPEEDUPS), max_size=8), st.lists(st.floats(0.0, 2.0), min_size=8,
                                                                   max_size=8))
def test_raising_speedups_never_unserves_a_shape_along_one_length(rows, raises):
    """One head size and one key length: thresholds are a single query length, so a faster
    kernel serves every shape a slower one served (over two lengths and several head sizes the
    most-shapes rule may trade one shape for two others: docs/mutation.md)."""
    points = [(q, 4096, 128, s) for q, s in rows]
    faster = [(q, k, d, s + up) for (q, k, d, s), up in zip(points, raises, strict=False)]
    before, after = speed.break_even(points), speed.break_even(faster)
    if before is not None:
        assert all(speed.serves(after, *p[:3]) for p in served(before, points))


@PROPERTY
@given(TOKENS, TOKENS, st.sets(HEAD_DIMS, min_size=1), HEAD_DIMS)
def test_serves_at_exact_thresholds_and_not_one_below(min_q, min_k, head_dims, head_dim):
    thresholds = speed.Thresholds(min_q, min_k, sorted(head_dims), served_shapes=1, measured_shapes=1)
    inside = head_dim in head_dims
    assert speed.serves(thresholds, min_q, min_k, head_dim) is inside
    assert speed.serves(thresholds, min_q + 1, min_k + 1, head_dim) is inside
    assert not speed.serves(thresholds, min_q - 1, min_k, head_dim)
    assert not speed.serves(thresholds, min_q, min_k - 1, head_dim)


# Eligibility: where each rule starts refusing --------------------------------------------------------
class NoAutocast:
    def __init__(self, on=False):
        self.on = on

    def autocast_enabled(self):
        return self.on


def tensor(batch, heads, tokens, head_dim, dtype=torch.float16, stride_last=1):
    size = (batch, heads, tokens, head_dim)
    strides = (heads * tokens * head_dim * stride_last, tokens * head_dim * stride_last,
               head_dim * stride_last, stride_last)
    return torch.empty_strided(size, strides, dtype=dtype, device="meta")


@st.composite
def served_calls(draw):
    """A config and a call it serves: lengths at or above its thresholds, a supported head size."""
    head_dims = draw(st.sets(st.sampled_from(KERNEL_HEAD_DIMS), min_size=1))  # what a config may list
    config = WrapperConfig(min_query_tokens=draw(st.integers(1, 4096)),
                           min_key_tokens=draw(st.integers(1, 4096)), head_dims=tuple(sorted(head_dims)))
    batch, kv_heads = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    heads = kv_heads * draw(st.integers(1, 4))
    q_tokens = config.min_query_tokens + draw(st.sampled_from([0, 0, 1, 1000]))
    k_tokens = config.min_key_tokens + draw(st.sampled_from([0, 0, 1, 1000]))
    head_dim = draw(st.sampled_from(config.head_dims))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    call = SdpaCall(tensor(batch, heads, q_tokens, head_dim, dtype),
                    tensor(batch, kv_heads, k_tokens, head_dim, dtype),
                    tensor(batch, kv_heads, k_tokens, head_dim, dtype), enable_gqa=heads != kv_heads)
    return config, call


def reason(call, config, autocast=False):
    """(reason, the detail a scope report shows) of a refused call, None for a served one."""
    found = refusal(call, config, NoAutocast(autocast))
    return found and (found[0], found[1] % found[2])


def dims(call):
    q, k, _ = call[:3]
    return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype)


def replaced(call, which, make):
    """The call with `which` (query, key or value) replaced by make(batch, heads, tokens, head_dim, dtype)."""
    b, h, kvh, nq, nk, d, dtype = dims(call)
    heads, tokens = (h, nq) if which == "query" else (kvh, nk)
    return call._replace(**{which: make(b, heads, tokens, d, dtype)})


QKV = st.sampled_from(["query", "key", "value"])


@PROPERTY
@given(served_calls())
def test_calls_at_or_above_every_threshold_are_served(case):
    config, call = case
    assert refusal(call, config, NoAutocast()) is None


@PROPERTY
@given(served_calls(), st.sampled_from(["query", "key"]))
def test_one_token_below_a_threshold_is_short(case, which):
    config, call = case
    b, h, kvh, nq, nk, d, dtype = dims(call)
    if which == "query":
        assume(config.min_query_tokens > 1)
        call = call._replace(query=tensor(b, h, config.min_query_tokens - 1, d, dtype))
    else:
        assume(config.min_key_tokens > 1)
        shorter = tensor(b, kvh, config.min_key_tokens - 1, d, dtype)
        call = call._replace(key=shorter, value=shorter)
    assert reason(call, config) == ("short", "tokens=%d/%d (needs >= %d/%d)" % (
        call.query.shape[2], call.key.shape[2], config.min_query_tokens, config.min_key_tokens))


@PROPERTY
@given(served_calls(), st.sampled_from([32, 48, 64, 80, 96, 128, 160, 256]))
def test_head_dim_is_served_exactly_when_listed(case, head_dim):
    config, call = case
    for which in ("query", "key", "value"):
        call = replaced(call, which, lambda b, h, n, d, dtype: tensor(b, h, n, head_dim, dtype))
    listed = ", ".join(map(str, config.head_dims))
    assert reason(call, config) == (None if head_dim in config.head_dims else
                                    ("head_dim", f"head_dim={head_dim} (supported: {listed})"))


@PROPERTY
@given(served_calls(), st.sampled_from(["key", "value"]), st.sampled_from([-32, 32]))
def test_key_and_value_need_the_query_head_dim(case, which, change):
    config, call = case
    call = replaced(call, which, lambda b, h, n, d, dtype: tensor(b, h, n, d + change, dtype))
    head_dims = tuple(t.shape[3] for t in call[:3])
    assert reason(call, config) == ("head_dim", "head_dim=(%d, %d, %d) (must match)" % head_dims)


@PROPERTY
@given(served_calls(), st.integers(1, 8), st.booleans())
def test_grouped_heads_need_enable_gqa_and_a_whole_multiple(case, kv_heads, enable_gqa):
    config, call = case
    b, h, _, nq, nk, d, dtype = dims(call)
    kv = tensor(b, kv_heads, nk, d, dtype)
    call = call._replace(key=kv, value=kv, enable_gqa=enable_gqa)
    if h == kv_heads or (enable_gqa and h % kv_heads == 0):
        assert reason(call, config) is None
    elif not enable_gqa:
        assert reason(call, config) == ("heads", f"heads={h}/{kv_heads} without enable_gqa")
    else:
        assert reason(call, config) == ("heads", f"heads={h}/{kv_heads} (query heads must be a multiple)")


@PROPERTY
@given(served_calls(), QKV, st.integers(1, 2))
def test_batch_must_match_across_query_key_value(case, which, extra):
    config, call = case
    call = replaced(call, which, lambda b, h, n, d, dtype: tensor(b + extra, h, n, d, dtype))
    batches = tuple(t.shape[0] for t in call[:3])
    assert reason(call, config) == ("shape", "batch=(%d, %d, %d) (must match)" % batches)


@PROPERTY
@given(served_calls(), st.sampled_from(["key", "value"]), st.sampled_from([(1, 0), (0, 1), (1, 1)]))
def test_key_and_value_must_agree_in_heads_and_length(case, which, change):
    config, call = case
    call = replaced(call, which, lambda b, h, n, d, dtype: tensor(b, h + change[0], n + change[1], d, dtype))
    assert reason(call, config) == ("shape", "key %s and value %s differ in heads or length" % (
        tuple(call.key.shape), tuple(call.value.shape)))


@PROPERTY
@given(served_calls(), QKV, st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_all_three_must_share_one_half_precision_dtype(case, which, dtype):
    config, call = case
    own = call.query.dtype
    call = replaced(call, which, lambda b, h, n, d, _: tensor(b, h, n, d, dtype))
    dtypes = tuple(t.dtype for t in call[:3])
    assert reason(call, config) == (None if dtype == own else (
        "dtype", "dtype=(%s, %s, %s) (supported: one of float16, bfloat16)" % dtypes))


@PROPERTY
@given(served_calls(), QKV, st.sampled_from([2, 3]))
def test_a_strided_last_dimension_is_layout(case, which, stride):
    config, call = case
    call = replaced(call, which, lambda b, h, n, d, dtype: tensor(b, h, n, d, dtype, stride_last=stride))
    assert reason(call, config) == ("layout", "last-dim stride != 1")


@PROPERTY
@given(served_calls(), st.sampled_from([1e-9, 0.1, 1.0]))
def test_any_dropout_or_causal_or_mask_or_autocast_is_refused(case, dropout):
    config, call = case
    assert reason(call._replace(dropout_p=dropout), config) == ("dropout", f"dropout_p={dropout}")
    assert reason(call._replace(dropout_p=0.0), config) is None
    assert reason(call._replace(is_causal=True), config) == ("causal", "is_causal=True")
    assert reason(call._replace(attn_mask=call.query), config) == (
        "mask",
        "attn_mask given (no masked call was certified here)",
    )
    assert reason(call, config, autocast=True) == ("autocast", "CUDA autocast is on")


@PROPERTY
@given(served_calls(), QKV, st.sampled_from([3, 5]))
def test_anything_but_four_dimensions_is_shape(case, which, rank):
    config, call = case
    original = getattr(call, which)
    reshaped = original.reshape(original.shape[0] * original.shape[1], *original.shape[2:]) if rank == 3 \
        else original[None]
    call = call._replace(**{which: reshaped})
    ranks = tuple(t.dim() for t in call[:3])
    assert reason(call, config) == ("shape", "dims=(%d, %d, %d) (supported: 4)" % ranks)


@PROPERTY
@given(served_calls(), QKV, st.sampled_from([None, 1.0, "tensor", [[1.0]]]))
def test_any_of_query_key_value_not_a_tensor_is_shape(case, which, other):
    config, call = case
    call = call._replace(**{which: other})
    assert reason(call, config) == ("shape", "query, key and value must be tensors")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_any_nested_input_is_shape(which):
    flat = SdpaCall(*(torch.zeros(1, 2, 64, 64, dtype=torch.float16) for _ in range(3)))
    nested = torch.nested.nested_tensor([torch.zeros(2, 64, 64), torch.zeros(2, 32, 64)],
                                        dtype=torch.float16)
    call = flat._replace(**{which: nested})
    assert reason(call, WrapperConfig(min_query_tokens=1, min_key_tokens=1)) == ("shape", "nested tensor")


@PROPERTY
@given(served_calls(), QKV)
def test_an_input_requiring_grad_is_refused_only_while_grad_is_enabled(case, which):
    config, call = case
    call = call._replace(**{which: getattr(call, which).detach().requires_grad_()})
    assert reason(call, config) == ("grad", "an input requires grad (SageAttention has no backward)")
    with torch.no_grad():
        assert reason(call, config) is None


@pytest.mark.parametrize("keywords", [{"mystery": 1}, {"zeta": 1, "alpha": 2, "mid": 3}])
def test_unknown_keywords_are_named_in_order(keywords):
    q = tensor(1, 2, 64, 64)
    call, why = bind((q, q, q), keywords)
    assert call is None and why == "unknown keywords " + ", ".join(sorted(keywords))


# The scope report ------------------------------------------------------------------------------------
REASON_COUNTS = st.dictionaries(st.sampled_from(["short", "dtype", "device", "memory", "kernel_error"]),
                                st.tuples(st.integers(1, 4), st.booleans()), max_size=4)


@PROPERTY
@given(REASON_COUNTS)
def test_summary_lists_every_reason_with_its_count_and_first_detail(fallbacks):
    """A reason counted without a detail template shows an empty detail."""
    report = ScopeReport()
    for reason, (count, with_detail) in fallbacks.items():
        for n in range(count):
            if with_detail:
                report.fell_back(reason, "call %d of %s", (n, reason))
            else:
                report.fell_back(reason)
    assert report.calls == sum(count for count, _ in fallbacks.values())
    listed = ", ".join(f"{reason}={count} [{f'call 0 of {reason}' if with_detail else ''}]"
                       for reason, (count, with_detail) in sorted(fallbacks.items(), key=lambda r: -r[1][0]))
    assert report.summary() == f"{report.calls} attention calls, 0 on SageAttention; " \
                               f"on PyTorch SDPA: {listed or 'none'}"


def test_summary_of_counts_set_without_details_shows_them_empty():
    report = ScopeReport(calls=3, fallbacks=collections.Counter(device=2, memory=1))
    assert report.summary() == ("3 attention calls, 0 on SageAttention; "
                                "on PyTorch SDPA: device=2 [], memory=1 []")


# Confidence bounds of timings ------------------------------------------------------------------------
@pytest.mark.parametrize("n, ranks", [(1, (1, 1)), (2, (1, 2)), (5, (1, 5)), (20, (5, 16)), (100, (40, 61))])
def test_median_interval_takes_the_order_statistics_of_its_docstring(n, ranks):
    """Ranks floor(n/2 - 1.96 sqrt(n)/2) and ceil(1 + n/2 + 1.96 sqrt(n)/2), 1-based, clipped to
    1..n; worked out by hand for each n."""
    samples = [float(i) for i in range(n, 0, -1)]  # rank r holds the value r, given in reverse
    assert speed.median_interval(samples) == (float(ranks[0]), float(ranks[1]))


def test_median_interval_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="^no samples$"):
        speed.median_interval([])


@PROPERTY
@given(st.lists(st.floats(0.01, 100.0), min_size=1, max_size=60))
def test_median_interval_holds_the_median(samples):
    low, high = speed.median_interval(samples)
    ordered = sorted(samples)
    median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
    assert low <= median <= high and low in samples and high in samples


def test_speedup_bounds_pair_the_opposite_ends():
    sdpa, ours = [float(v) for v in range(10, 30)], [float(v) for v in range(5, 25)]
    sdpa_low, sdpa_high = speed.median_interval(sdpa)
    ours_low, ours_high = speed.median_interval(ours)
    assert speed.speedup_bounds(20.0, sdpa, 10.0, ours) == (sdpa_low / ours_high, 2.0, sdpa_high / ours_low)
    assert speed.speedup_bounds(3.0, [], 2.0, []) == (1.5, 1.5, 1.5)


# Family shapes -------------------------------------------------------------------------------------------
def test_shape_helpers_default_to_bf16_head_dim_128_and_equal_heads():
    assert families.self_attention(24, 4096) == families.Shape(24, 24, 4096, 4096, 128, "bfloat16")
    assert families.self_attention(48, 4608, kv_heads=12, dtype="float16") == \
        families.Shape(48, 12, 4608, 4608, 128, "float16")
    assert families.cross_attention(10, 4096, 77) == families.Shape(10, 10, 4096, 77, 128, "bfloat16")
    assert families.cross_attention(10, 4096, 77, 64, dtype="float16").dtype == "float16"


def test_an_unknown_family_lists_the_known_ones():
    with pytest.raises(KeyError) as unknown:
        families.find("Nope")
    known = ", ".join(f.name for f in families.FAMILIES)
    assert unknown.value.args[0] == f"unknown family 'Nope' (known: {known})"
