"""Tiny diffusers transformers built from the library's own config classes, with random weights.

The CPU tests (tests_fast/fixtures/test_diffusers_cpu.py) and the GPU tests (tests_gpu/test_diffusers_gpu.py)
run the same model code at different sizes. The models are untrained: the attention calls' shapes,
layouts and arguments are diffusers' own, their statistics are not a real model's.
"""

import torch
from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, WanTransformer3DModel

DTYPE = torch.bfloat16
# Rotary axes per head size: they must add up to head_dim (FLUX.1 and Qwen-Image use 16/56/56 at 128).
ROPE_AXES = {64: (16, 24, 24), 128: (16, 56, 56)}
UNTRAINED = ("recorded from an untrained model with random weights (tiny config): shapes, layouts and "
             "arguments are the library's own, the statistics are not a real model's")


def _random(*shape, device="cpu", dtype=DTYPE):
    generator = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def flux(heads=2, head_dim=64, image_tokens=64, text_tokens=16, device="cpu"):
    """FLUX.1: one joint (double-stream) block and one single-stream block."""
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=head_dim, num_attention_heads=heads,
                                   joint_attention_dim=32, pooled_projection_dim=16,
                                   axes_dims_rope=ROPE_AXES[head_dim])
    inputs = dict(hidden_states=_random(1, image_tokens, 8, device=device),
                  encoder_hidden_states=_random(1, text_tokens, 32, device=device),
                  pooled_projections=_random(1, 16, device=device),
                  timestep=torch.tensor([0.5], device=device),
                  img_ids=torch.zeros(image_tokens, 3, device=device),
                  txt_ids=torch.zeros(text_tokens, 3, device=device))
    return model.to(device=device, dtype=DTYPE).eval(), inputs


def qwen_image(mask: bool, heads=2, head_dim=64, side=8, text_tokens=16, device="cpu"):
    """Qwen-Image: two joint blocks over side x side image tokens and the text. `mask` passes a text
    mask with padding (the last quarter of the text tokens), as a batch of prompts of different
    lengths gets it; the pipeline drops an all-ones mask (pipeline_qwenimage.py, `if
    prompt_embeds_mask.all(): prompt_embeds_mask = None`), so a single prompt runs unmasked."""
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=head_dim, num_attention_heads=heads,
                                        joint_attention_dim=32, axes_dims_rope=ROPE_AXES[head_dim])
    text_mask = None
    if mask:
        text_mask = torch.ones(1, text_tokens, dtype=torch.long, device=device)
        text_mask[:, text_tokens * 3 // 4:] = 0
    inputs = dict(hidden_states=_random(1, side * side, 16, device=device),
                  encoder_hidden_states=_random(1, text_tokens, 32, device=device),
                  timestep=torch.tensor([0.5], device=device), img_shapes=[(1, side, side)],
                  encoder_hidden_states_mask=text_mask)
    return model.to(device=device, dtype=DTYPE).eval(), inputs


def wan(heads=2, head_dim=64, frames=2, side=16, text_tokens=16, device="cpu"):
    """Wan 2.x: one block, self-attention over the video tokens and cross-attention on the text."""
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads,
                                  attention_head_dim=head_dim, in_channels=4, out_channels=4, text_dim=32,
                                  freq_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=64)
    inputs = dict(hidden_states=_random(1, 4, frames, side, side, device=device),
                  timestep=torch.tensor([500], device=device),
                  encoder_hidden_states=_random(1, text_tokens, 32, device=device))
    return model.to(device=device, dtype=DTYPE).eval(), inputs


def run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample
