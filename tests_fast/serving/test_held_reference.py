"""A caller that kept the patched SDPA (`from torch.nn.functional import scaled_dot_product_attention`
before uninstall()) must get torch's function from then on: the kernel never serves it again, even
inside a scope, even after a new install() (the new wrapper is another function)."""

import torch.nn.functional as F

import sage_qual

from ..helpers import TORCH_SDPA, qkv, wrapped


def test_a_held_wrapper_stops_serving_after_uninstall():
    q, k, v = qkv()
    with wrapped() as (_, fake):
        held = F.scaled_dot_product_attention
        with sage_qual.sage_attention_scope() as before:
            held(q, k, v)
        assert before.served == 1 and len(fake.calls) == 1  # the call is one the kernel takes
        sage_qual.uninstall()
        assert F.scaled_dot_product_attention is TORCH_SDPA
        with sage_qual.sage_attention_scope() as after:
            out = held(q, k, v)
        assert len(fake.calls) == 1, "the kernel served a held wrapper after uninstall()"
        assert after.served == 0
        assert out.equal(TORCH_SDPA(q, k, v))


def test_a_held_wrapper_stays_off_after_a_new_install():
    q, k, v = qkv()
    with wrapped() as (_, fake):
        held = F.scaled_dot_product_attention
        sage_qual.uninstall()
        assert sage_qual.install(config=sage_qual.WrapperConfig(min_query_tokens=32, min_key_tokens=16,
                                                                check_rows=16)).enabled
        assert F.scaled_dot_product_attention is not held
        with sage_qual.sage_attention_scope() as report:
            held(q, k, v)
            assert len(fake.calls) == 0, "the old wrapper served under the new install"
            F.scaled_dot_product_attention(q, k, v)
        assert len(fake.calls) == 1 and report.served == 1
