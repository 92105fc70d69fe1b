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
    mask = torch.ones(8, 8, dtype=torch.bool)
    compiled.traced_call(torch_call(emitted), frozenset(), q, k, v, mask, 0.25, True, scale=2,
                         enable_gqa=True)
    ((name, args),) = emitted
    assert name == "sdpa_outside_cuda_graphs"
    assert all(given is passed for given, passed in zip((q, k, v, mask), args[:4], strict=True))
    assert args[4:] == (0.25, True, 2.0, True)
    assert type(args[4]) is float and type(args[6]) is float


def test_the_operator_gets_the_defaults_of_torchs_sdpa(emitted):
    q, k, v = qkv()
    compiled.traced_call(torch_call(emitted), frozenset(), q, k, v)
    ((_, args),) = emitted
    assert args[3:] == (None, 0.0, False, None, False)


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
    mask = torch.ones(8, 8, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled.traced_call(torch_call(emitted), frozenset(), q, k, v, mask, 0.5, True, scale=0.3,
                             enable_gqa=True)
    compiled.traced_call(torch_call(emitted), frozenset(), q.requires_grad_(), k, v)
    assert [call[0] for call in emitted] == ["torch", "torch"]
    (_, args, keywords), (_, grad_args, grad_keywords) = emitted
    assert all(given is passed for given, passed in zip((q, k, v), args, strict=True))
    assert keywords == {
        "attn_mask": mask,
        "dropout_p": 0.5,
        "is_causal": True,
        "scale": 0.3,
        "enable_gqa": True,
    }
    assert grad_keywords == {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                             "enable_gqa": False}


def test_an_argument_torch_does_not_know_traces_torchs_own_call_with_it(emitted):
    q, k, v = qkv()
    compiled.traced_call(torch_call(emitted), frozenset(), q, k, v, future_option=1)
    ((name, _, keywords),) = emitted
    assert name == "torch" and keywords["future_option"] == 1


def test_a_tensor_subclass_alone_is_not_enough_to_leave_the_operator(emitted):
    """Only a missing tensor or an unknown argument sends the call to torch, not each alone with the
    other's opposite (the check is `or`)."""
    q, k, v = qkv()
    compiled.traced_call(torch_call(emitted), frozenset(), q, k, "not a tensor")
    assert [call[0] for call in emitted] == ["torch"]


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
    mask = torch.ones(8, 8, dtype=torch.bool)
    out = compiled._body(q, k, v, mask, 0.125, True, 0.5, False)
    fake = compiled._fake(q, k, v, mask, 0.125, True, 0.5, False)
    assert out.shape == fake.shape and out.stride() == fake.stride()
    assert received.pop("attn_mask") is mask
    assert received == dict(dropout_p=0.125, is_causal=True, scale=0.5, enable_gqa=False)


@pytest.mark.parametrize("tagged", [False, True])
def test_an_operator_is_defined_functional_with_its_fake_and_tags(tagged, request):
    """`_define` (run at import for the two operators): a sage_qual:: operator that mutates nothing,
    carries the tags it is given and has the fake registered (a fake tensor gets the fake's shape)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if tagged and compiled._UNSAFE_TAG is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    tags = (compiled._UNSAFE_TAG,) if tagged else ()
    name = f"contract_{request.node.callspec.id}_{id(request)}"
    op = compiled._define(name, tags)
    overload = op._opoverload
    assert overload.name() == f"sage_qual::{name}"
    assert not overload._schema.is_mutable
    assert set(tags) <= set(overload.tags) and (tagged or compiled._UNSAFE_TAG not in overload.tags)
    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(t) for t in qkv(d_value=32))
        out = op(q, k, v, None, 0.0, False, None, False)
    assert out.shape == (1, 2, 8, 32)
