"""The compiled operator's contract with torch.compile, checked on its parts (`serving.compiled`): what
the traced call passes to the operator, when it traces torch's own call instead, which operator a device
gets, and that the body returns the layout the fake promises (issue 43: each of these could break with
the fast suite green, since its compile tests run contiguous inputs on CPU tensors under aot_eager)."""

import pytest
import torch

from sage_qual.serving import compiled


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:`index` (all the traced call reads of it)."""
    index = 0

    @property
    def device(self):
        return torch.device("cuda", self.index)


def on_cuda(tensor: torch.Tensor, index: int) -> torch.Tensor:
    cls = type(f"OnCuda{index}", (OnCuda,), {"index": index})
    return torch.Tensor._make_subclass(cls, tensor)


@pytest.fixture
def emitted(monkeypatch):
    """The operators replaced by recorders: (operator name, its arguments) per traced call."""
    calls = []
    for name in ("sdpa", "sdpa_outside_cuda_graphs"):
        monkeypatch.setattr(compiled, name, lambda *args, _name=name: calls.append((_name, args)) or args[0])
    return calls


def torch_call(calls):
    return lambda *args, **kwargs: calls.append(("torch", args, kwargs)) or args[0]


def qkv(d_value=64):
    return torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, d_value)


def test_every_argument_reaches_the_operator_as_its_schema_types_it(emitted):
    q, k, v = qkv()
    compiled.traced_call(torch_call(emitted), frozenset(), q, k, v, None, 0.25, True, scale=2,
                         enable_gqa=True)
    ((name, args),) = emitted
    assert name == "sdpa_outside_cuda_graphs"
    assert args[3:] == (None, 0.25, True, 2.0, True)
    assert type(args[4]) is float and type(args[6]) is float


@pytest.mark.parametrize("index, expected", [(0, "sdpa"), (1, "sdpa_outside_cuda_graphs")])
def test_the_graph_safe_operator_only_where_the_variant_is_capture_safe(emitted, index, expected):
    q, k, v = (on_cuda(t, index) for t in qkv())
    compiled.traced_call(torch_call(emitted), frozenset({0}), q, k, v)
    assert [name for name, _ in emitted] == [expected]


def test_a_cpu_tensor_never_gets_the_graph_safe_operator(emitted):
    q, k, v = qkv()  # device index None, as a CPU tensor's
    compiled.traced_call(torch_call(emitted), frozenset({None, 0}), q, k, v)
    assert [name for name, _ in emitted] == ["sdpa_outside_cuda_graphs"]


def test_autocast_and_gradients_trace_torchs_own_call(emitted):
    q, k, v = qkv()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled.traced_call(torch_call(emitted), frozenset(), q, k, v, dropout_p=0.5)
    compiled.traced_call(torch_call(emitted), frozenset(), q.requires_grad_(), k, v)
    assert [call[0] for call in emitted] == ["torch", "torch"]
    assert emitted[0][2]["dropout_p"] == 0.5


def test_the_fake_promises_the_value_head_size_contiguous():
    q, k, v = qkv(d_value=32)
    fake = compiled._fake(q, k, v, None, 0.0, False, None, False)
    assert fake.shape == (1, 2, 8, 32) and fake.is_contiguous() and fake.dtype == q.dtype


def test_the_body_returns_what_the_fake_promises_whatever_layout_the_kernel_gave(monkeypatch):
    q, k, v = qkv(d_value=32)
    received = {}

    def serve(*args, **kwargs):
        received.update(kwargs)
        return torch.randn(1, 8, 2, 32).transpose(1, 2)  # a kernel's NHD output viewed as HND

    monkeypatch.setattr(compiled, "serve", serve)
    out = compiled._body(q, k, v, None, 0.125, True, 0.5, False)
    fake = compiled._fake(q, k, v, None, 0.125, True, 0.5, False)
    assert out.shape == fake.shape and out.stride() == fake.stride()
    assert received == dict(attn_mask=None, dropout_p=0.125, is_causal=True, scale=0.5, enable_gqa=False)
