"""The built-in defaults' merge keeps the conservative end of every field of `Served` (issue 54: an
independent mutation set found the merge could keep the wrong end of a bound or a range unnoticed).
Over any entries of one variant: the highest thresholds, the lowest verified upper bound (null only
where none verified one), the layouts and contexts every entry verified, per side the highest bound,
masked calls only where every entry serves them, and the last entry's reasons."""

from hypothesis import given
from hypothesis import strategies as st

from sage_qual.serving import defaults
from sage_qual.verdicts import profile
from sage_qual.verdicts.env_record import Reason, ReasonKind
from sage_qual.verdicts.served import Bound, Served

VARIANT = "ck-int8-cuda"  # takes a mask, so `masks` may be either
LAYOUTS = ["contiguous", "transposed", "nhd", "fused_qkv"]
CONTEXTS = ["side_stream", "capture", "compile"]


@st.composite
def served(draw):
    low_q, low_k = draw(st.integers(1, 40_000)), draw(st.integers(1, 40_000))
    upper = st.one_of(st.none(), st.integers(0, 80_000))
    max_q, max_k = draw(upper), draw(upper)
    return Served(
        VARIANT, low_q, low_k, [128],
        None if max_q is None else low_q + max_q, None if max_k is None else low_k + max_k,
        draw(st.one_of(st.none(), st.lists(st.sampled_from(LAYOUTS), min_size=1, unique=True))),
        draw(st.one_of(st.none(), st.lists(st.sampled_from(CONTEXTS), unique=True))),
        draw(st.lists(st.builds(Bound, st.sampled_from(["query", "key"]), st.integers(2, 50_000),
                                st.just("a failure")), max_size=3)),
        draw(st.booleans()))


@given(st.lists(served(), min_size=1, max_size=4), st.integers(0, 99))
def test_the_merge_keeps_the_conservative_end_of_every_field(entries_served, tag):
    entries = [profile.Entry(s, [Reason(ReasonKind.SPEED, f"entry {n} {tag}")])
               for n, s in enumerate(entries_served)]
    merged = defaults.merged(VARIANT, entries, [128])
    got = merged.served
    assert got.min_query_tokens == max(s.min_query_tokens for s in entries_served)
    assert got.min_key_tokens == max(s.min_key_tokens for s in entries_served)
    for name in ("max_query_tokens", "max_key_tokens"):
        verified = [getattr(s, name) for s in entries_served if getattr(s, name) is not None]
        assert getattr(got, name) == (min(verified) if verified else None), name
    for name in ("layouts", "contexts"):
        named = [set(getattr(s, name)) for s in entries_served if getattr(s, name) is not None]
        expected = set.intersection(*named) if named else None
        assert (None if getattr(got, name) is None else set(getattr(got, name))) == expected, name
    for side in ("query", "key"):
        belows = [b.below for s in entries_served for b in s.bounds if b.side == side]
        kept = [b.below for b in got.bounds if b.side == side]
        assert kept == ([max(belows)] if belows else []), side
    assert got.masks == all(s.masks for s in entries_served)
    assert merged.reasons == entries[-1].reasons
