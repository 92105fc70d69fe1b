"""torch's own SDPA, and taking a function bound over it out of the chain of such bindings.

The wrapper (`install()`) and the fixture recorder both bind a function of their own to
`torch.nn.functional.scaled_dot_product_attention`, each calling what was bound before it (kept in
its `__wrapped__`). Either may be removed while the other is bound over or under it; `unbind`
keeps the chain whole, so that once both are gone torch's name holds torch's own function again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The builtin that torch.nn.functional.scaled_dot_product_attention names when nothing is bound
# over it; reading it here gives torch's own function whoever rebound the name, and when.
TORCH_SDPA = torch._C._nn.scaled_dot_product_attention

_MAX_CHAIN = 64  # a longer chain of functions with __wrapped__ is taken for a cycle


def bind(function, wrapped) -> None:
    """Bind `function` over torch's SDPA; it must call its `__wrapped__` (set here to `wrapped`)."""
    function.__wrapped__ = wrapped
    F.scaled_dot_product_attention = function


def unbind(function) -> None:
    """Take `function` (bound by `bind`) out: torch's name gets back what it wrapped when it is the
    current binding; otherwise the function bound over it now wraps what it wrapped."""
    if F.scaled_dot_product_attention is function:
        F.scaled_dot_product_attention = function.__wrapped__
        return
    layer = F.scaled_dot_product_attention
    for _ in range(_MAX_CHAIN):
        below = getattr(layer, "__wrapped__", None)
        if below is None:
            return  # not in the chain (already taken out, or someone rebound the name without it)
        if below is function:
            layer.__wrapped__ = function.__wrapped__
            return
        layer = below
