"""This app's attention, written the way many apps write it: SageAttention's `sageattn()` for the
calls it can take, PyTorch SDPA for the rest. Nothing here knows sage-qual."""

import torch
import torch.nn.functional as F

SAGE_HEAD_DIMS = (64, 128)


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's signature and [B, H, N, D] layout."""
    plain = attn_mask is None and not dropout_p
    if plain and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in SAGE_HEAD_DIMS:
        from sageattention import sageattn

        return sageattn(q, k, v, tensor_layout="HND", is_causal=is_causal, sm_scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
