"""Properties (hypothesis) of the decisions a wrong edge case would silently change: where a variant
pays (`speed.break_even`, `speed.serves`) and where each wrapper rule starts refusing
(`eligibility.refusal`). The family's variant choice: test_family_choice.py.

Examples are derandomized so that CI and `tox -e mutate` see the same cases on every run.
"""

import itertools

import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from sage_qual.qualification import speed
from sage_qual.serving.config import WrapperConfig
from sage_qual.serving.eligibility import SdpaCall, refusal

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
                yield {"min_query_tokens": min_q, "min_key_tokens": min_k, "head_dims": list(head_dims)}


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
    assert thresholds["served_shapes"] == len(chosen)
    assert thresholds["measured_shapes"] == len(points)
    # Thresholds sit at measured values: nothing is served where nothing was measured.
    assert thresholds["min_query_tokens"] in {q for q, *_ in points}
    assert thresholds["min_key_tokens"] in {k for _, k, *_ in points}
    assert thresholds["head_dims"] == sorted(set(thresholds["head_dims"]))
    assert set(thresholds["head_dims"]) <= {d for _, _, d, _ in points}


@PROPERTY
@given(POINTS, MIN_SPEEDUP)
@example([(1024, 1024, 128, 2.0), (4096, 4096, 128, 2.0), (1024, 1024, 64, 0.5)], 1.0)
@example([(1024, 512, 128, 2.0), (1024, 512, 64, 2.0)], 1.0)  # equal counts: fewer head sizes
def test_break_even_serves_most_shapes_then_fewest_head_sizes_then_largest_thresholds(points, min_speedup):
    thresholds = speed.break_even(points, min_speedup)
    assume(thresholds is not None)

    def rank(t):
        return len(served(t, points)), -len(t["head_dims"]), t["min_query_tokens"], t["min_key_tokens"]

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
        assert after is not None and after["served_shapes"] >= before["served_shapes"]


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
    thresholds = {"min_query_tokens": min_q, "min_key_tokens": min_k, "head_dims": sorted(head_dims)}
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
    head_dims = draw(st.sets(st.sampled_from([32, 64, 96, 128, 256]), min_size=1))
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
    found = refusal(call, config, NoAutocast(autocast))
    return found and found[0]


def dims(call):
    q, k, _ = call[:3]
    return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype)


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
    found = refusal(call, config, NoAutocast())
    assert found[0] == "short"
    assert found[1] % found[2] == "tokens=%d/%d (needs >= %d/%d)" % (
        call.query.shape[2], call.key.shape[2], config.min_query_tokens, config.min_key_tokens)


@PROPERTY
@given(served_calls(), st.sampled_from([32, 48, 64, 80, 96, 128, 160, 256]))
def test_head_dim_is_served_exactly_when_listed(case, head_dim):
    config, call = case
    b, h, kvh, nq, nk, _, dtype = dims(call)
    call = call._replace(query=tensor(b, h, nq, head_dim, dtype), key=tensor(b, kvh, nk, head_dim, dtype),
                         value=tensor(b, kvh, nk, head_dim, dtype))
    assert reason(call, config) == (None if head_dim in config.head_dims else "head_dim")


@PROPERTY
@given(served_calls(), st.integers(1, 8), st.booleans())
def test_grouped_heads_need_enable_gqa_and_a_whole_multiple(case, kv_heads, enable_gqa):
    config, call = case
    b, h, _, nq, nk, d, dtype = dims(call)
    kv = tensor(b, kv_heads, nk, d, dtype)
    call = call._replace(key=kv, value=kv, enable_gqa=enable_gqa)
    ok = h == kv_heads or (enable_gqa and h % kv_heads == 0)
    assert reason(call, config) == (None if ok else "heads")


@PROPERTY
@given(served_calls(), st.sampled_from(["query", "key", "value"]), st.integers(1, 2))
def test_batch_must_match_across_query_key_value(case, which, extra):
    config, call = case
    b, h, kvh, nq, nk, d, dtype = dims(call)
    heads, tokens = (h, nq) if which == "query" else (kvh, nk)
    call = call._replace(**{which: tensor(b + extra, heads, tokens, d, dtype)})
    assert reason(call, config) == "shape"


@PROPERTY
@given(served_calls(), st.sampled_from(["key", "value"]), st.sampled_from([(1, 0), (0, 1), (1, 1)]))
def test_key_and_value_must_agree_in_heads_and_length(case, which, change):
    config, call = case
    b, h, kvh, nq, nk, d, dtype = dims(call)
    call = call._replace(**{which: tensor(b, kvh + change[0], nk + change[1], d, dtype)})
    assert reason(call, config) == "shape"


@PROPERTY
@given(served_calls(), st.sampled_from(["query", "key", "value"]),
       st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_all_three_must_share_one_half_precision_dtype(case, which, dtype):
    config, call = case
    b, h, kvh, nq, nk, d, own = dims(call)
    heads, tokens = (h, nq) if which == "query" else (kvh, nk)
    call = call._replace(**{which: tensor(b, heads, tokens, d, dtype)})
    assert reason(call, config) == (None if dtype == own else "dtype")


@PROPERTY
@given(served_calls(), st.sampled_from(["query", "key", "value"]), st.sampled_from([2, 3]))
def test_a_strided_last_dimension_is_layout(case, which, stride):
    config, call = case
    b, h, kvh, nq, nk, d, dtype = dims(call)
    heads, tokens = (h, nq) if which == "query" else (kvh, nk)
    call = call._replace(**{which: tensor(b, heads, tokens, d, dtype, stride_last=stride)})
    assert reason(call, config) == "layout"


@PROPERTY
@given(served_calls(), st.sampled_from([1e-9, 0.1, 1.0]))
def test_any_dropout_or_causal_or_mask_or_autocast_is_refused(case, dropout):
    config, call = case
    assert reason(call._replace(dropout_p=dropout), config) == "dropout"
    assert reason(call._replace(dropout_p=0.0), config) is None
    assert reason(call._replace(is_causal=True), config) == "causal"
    assert reason(call._replace(attn_mask=call.query), config) == "mask"
    assert reason(call, config, autocast=True) == "autocast"


@PROPERTY
@given(served_calls(), st.sampled_from(["query", "key", "value"]), st.sampled_from([3, 5]))
def test_anything_but_four_dimensions_is_shape(case, which, rank):
    config, call = case
    original = getattr(call, which)
    reshaped = original.reshape(original.shape[0] * original.shape[1], *original.shape[2:]) if rank == 3 \
        else original[None]
    assert reason(call._replace(**{which: reshaped}), config) == "shape"


@PROPERTY
@given(served_calls(), st.sampled_from(["query", "key", "value"]))
def test_an_input_requiring_grad_is_refused_only_while_grad_is_enabled(case, which):
    config, call = case
    call = call._replace(**{which: getattr(call, which).detach().requires_grad_()})
    assert reason(call, config) == "grad"
    with torch.no_grad():
        assert reason(call, config) is None
