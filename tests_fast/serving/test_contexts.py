"""Execution contexts: side streams, CUDA-graph capture and torch.compile, on the fake kernels, which
launch on the legacy default stream as thu-ml's CUDA kernels do (wrong off it) unless declared
to launch on the current stream, as the Triton kernel does."""

import dataclasses

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import sage_qual
from sage_qual.kernels import contexts
from sage_qual.kernels.variants import CK_INT8, FP8_CUDA_SM90, FP16_TRITON, VARIANTS
from sage_qual.serving import compiled
from sage_qual.serving.eligibility import REASONS
from sage_qual.testing import FakeSageAttention, on_device
from sage_qual.verdicts.served import Served

from ..helpers import SMALL, TORCH_SDPA, qkv, retired, wrapped

SM90, SM86 = (9, 0), (8, 6)  # a legacy-stream kernel (sm90 fp8 CUDA) and a current-stream one (Triton)


def serve(*tensors):
    with sage_qual.sage_attention_scope() as report:
        out = F.scaled_dot_product_attention(*tensors)
    return out, report


def close_to_torch(out, tensors):
    return torch.allclose(out.float(), TORCH_SDPA(*tensors).float(), atol=2e-3, rtol=2e-3)


# The registry's rule ------------------------------------------------------------------------------

@pytest.mark.parametrize("names", ["side_stream", {"side_stream"}, None, 3])
def test_contexts_are_a_list_or_tuple_of_names_and_the_error_lists_them(names):
    with pytest.raises(ValueError) as caught:
        contexts.check_names(names, "contexts")
    assert (
        str(caught.value)
        == f"contexts={names!r}: give a list of context names from side_stream, capture, compile"
    )


def test_an_unknown_context_is_named_with_the_known_ones():
    contexts.check_names(["capture", "compile"], "contexts")
    contexts.check_names((), "contexts")
    with pytest.raises(ValueError, match=r"^contexts: 'graph' is not an execution context sage-qual knows "
                                         r"\(side_stream, capture, compile\)$"):
        contexts.check_names(["capture", "graph"], "contexts")


def test_every_context_has_a_fallback_reason_in_the_list():
    assert set(contexts.REASON) == set(contexts.CONTEXTS)
    assert set(contexts.REASON.values()) <= set(REASONS)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_only_current_stream_kernels_are_trusted_under_capture(name):
    variant = VARIANTS[name]
    safe = contexts.builtin_safe(variant)
    current_stream = variant.function in (FP16_TRITON, CK_INT8)
    assert (contexts.CAPTURE in safe) == current_stream
    assert contexts.SIDE_STREAM in safe and contexts.COMPILE in safe  # bridged / an opaque operator


def test_the_fake_kernel_is_wrong_off_the_legacy_stream_as_the_real_one_is():
    tensors = qkv()
    with wrapped(gpus=(SM90,)) as (cuda, fake):
        kernel = getattr(__import__("sageattention"), FP8_CUDA_SM90)
        right = kernel(*tensors)
        with cuda.side_stream():
            off = kernel(*tensors)
        with cuda.capture():
            captured = kernel(*tensors)
    assert right.abs().sum() > 0 and off.abs().sum() == 0 and captured.abs().sum() == 0


# Side streams -------------------------------------------------------------------------------------

def test_a_side_stream_call_of_a_legacy_kernel_is_bridged_and_right():
    tensors = qkv()
    with wrapped(gpus=(SM90,)) as (cuda, fake):
        with cuda.side_stream():
            out, report = serve(*tensors)
    assert report.served == 1, report.summary()
    assert close_to_torch(out, tensors)
    assert "legacy stream on 0" in cuda.events
    assert cuda.stream == "default"


@pytest.mark.parametrize("side", [0, 1])
def test_a_call_is_judged_by_its_own_devices_stream_not_the_current_devices(side):
    """torch keeps a current stream per device: with the current device 0 and a call's tensors on
    cuda:1, only cuda:1's stream decides whether the call runs off the legacy stream (the fake keeps
    a stream per device, so a wrapper reading the current device's fails one of the two cases)."""
    tensors = [on_device(t, 1) for t in qkv()]
    with wrapped(gpus=(SM90, SM90)) as (cuda, fake):
        with cuda.side_stream(side):
            out, report = serve(*tensors)
    assert report.served == 1, report.summary()
    assert close_to_torch(out, tensors)
    assert ("legacy stream on 1" in cuda.events) == (side == 1), cuda.events
    assert cuda.streams == {0: "default", 1: "default"}


def test_a_capture_on_one_device_leaves_the_others_calls_served():
    tensors = [on_device(t, 1) for t in qkv()]
    with wrapped(gpus=(SM90, SM90)) as (cuda, fake):
        with cuda.capture(0):
            out, report = serve(*tensors)
        with cuda.capture(1):
            _, captured = serve(*tensors)
    assert report.served == 1 and close_to_torch(out, tensors), report.summary()
    assert captured.served == 0 and contexts.REASON[contexts.CAPTURE] in captured.fallbacks, (
        captured.summary()
    )
    assert cuda.capturing == set()


def test_the_default_stream_needs_no_bridge():
    with wrapped(gpus=(SM90,)) as (cuda, fake):
        out, report = serve(*qkv())
    assert report.served == 1 and not any(e.startswith("legacy stream") for e in cuda.events)


def test_a_current_stream_kernel_is_not_bridged():
    with wrapped(gpus=(SM86,)) as (cuda, fake):
        with cuda.side_stream():
            out, report = serve(*qkv())
    assert report.served == 1 and not any(e.startswith("legacy stream") for e in cuda.events)


def test_without_the_bridge_the_first_side_stream_call_is_checked_and_caught(monkeypatch):
    """A platform whose bridge does nothing: the kernel is wrong there, and the first side-stream call
    is checked even after a default-stream call passed (the check is per context)."""
    tensors = qkv()
    with wrapped(gpus=(SM90,)) as (cuda, fake):
        monkeypatch.setattr(cuda, "run_on_legacy_stream", lambda index, call: call())
        first, _ = serve(*tensors)
        with cuda.side_stream():
            out, report = serve(*tensors)
        assert retired().startswith("first-call check failed")
        assert "side_stream" in retired()
    assert report.served == 0 and report.fallbacks["kernel_error"] == 1
    assert close_to_torch(out, tensors)


def test_a_config_without_side_streams_falls_back_with_the_reason_stream():
    config = dataclasses.replace(SMALL, contexts=(contexts.COMPILE,))
    tensors = qkv()
    with wrapped(gpus=(SM90,), config=config) as (cuda, fake):
        with cuda.side_stream():
            out, report = serve(*tensors)
        default, served = serve(*tensors)
    assert report.fallbacks == {"stream": 1} and not fake.calls[1:]
    assert "side stream" in report.details["stream"] and "sm90-fp8-cuda" in report.details["stream"]
    assert torch.equal(out, TORCH_SDPA(*tensors))
    assert served.served == 1


# CUDA-graph capture -------------------------------------------------------------------------------

def test_capture_falls_back_for_a_legacy_kernel():
    tensors = qkv()
    with wrapped(gpus=(SM90,)) as (cuda, fake):
        with cuda.capture():
            out, report = serve(*tensors)
    assert report.fallbacks == {"capture": 1} and not fake.calls
    assert "CUDA-graph capture" in report.details["capture"]
    assert torch.equal(out, TORCH_SDPA(*tensors))
    assert not retired()


def test_capture_serves_a_current_stream_kernel_without_a_first_call_check(monkeypatch):
    tensors = qkv()
    with wrapped(gpus=(SM86,)) as (cuda, fake):
        monkeypatch.setattr(sage_qual.serving.wrapper, "_first_call_problem",
                            lambda *a: pytest.fail("a value was read during capture"))
        with cuda.capture():
            out, report = serve(*tensors)
    assert report.served == 1 and close_to_torch(out, tensors)


def test_a_profile_can_certify_a_fixed_build_capture_safe():
    """A build whose CUDA kernels launch on the current stream (upstream's stream pull requests),
    certified so: served under capture, and right."""
    config = dataclasses.replace(SMALL, contexts=contexts.CONTEXTS)
    fake = FakeSageAttention(current_stream=(FP8_CUDA_SM90,))
    tensors = qkv()
    with wrapped(gpus=(SM90,), config=config, fake=fake) as (cuda, fake):
        with cuda.capture():
            out, report = serve(*tensors)
    assert report.served == 1 and close_to_torch(out, tensors)


def test_unknown_context_names_are_refused_with_the_field_and_the_names():
    with pytest.raises(ValueError, match=r"WrapperConfig.contexts: 'graphs' is not .*side_stream"):
        sage_qual.WrapperConfig(contexts=("graphs",))
    with pytest.raises(ValueError, match="give a list"):
        sage_qual.WrapperConfig(contexts="capture")


# torch.compile ------------------------------------------------------------------------------------

def graph_recorder(seen):
    def backend(graph_module, example_inputs):
        seen.extend(node.target for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward
    return backend


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def attention_times_two(q, k, v):
    return F.scaled_dot_product_attention(q, k, v) * 2


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_code_sees_one_opaque_operator_and_no_graph_break():
    seen = []
    tensors = qkv()
    with wrapped(gpus=(SM90,)) as (cuda, fake):
        run = torch.compile(attention_times_two, backend=graph_recorder(seen), fullgraph=True)
        with sage_qual.sage_attention_scope() as report:
            out = run(*tensors)
    assert torch.ops.sage_qual.sdpa_outside_cuda_graphs.default in seen
    assert not torch._dynamo.utils.counters["graph_break"]
    assert report.served == 1 and len(fake.calls) == 1
    assert close_to_torch(out / 2, tensors)


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_compiled_operator_reads_the_scope_when_it_runs():
    tensors = qkv()
    with wrapped(gpus=(SM90,)) as (cuda, fake):
        run = torch.compile(attention_times_two, backend="aot_eager", fullgraph=True)
        outside = run(*tensors)  # compiled outside a scope
        with sage_qual.sage_attention_scope() as report:
            inside = run(*tensors)  # the same compiled code, now in a scope
    assert torch.equal(outside, TORCH_SDPA(*tensors) * 2)
    assert report.served == 1 and len(fake.calls) == 1
    assert close_to_torch(inside / 2, tensors)


@pytest.mark.usefixtures("fresh_dynamo")
def test_outside_a_scope_the_compiled_operator_calls_what_the_wrapper_wraps(torch_spy):
    tensors = qkv()
    with wrapped(gpus=(SM90,)) as (cuda, fake):
        run = torch.compile(attention_times_two, backend="aot_eager", fullgraph=True)
        out = run(*tensors)
    assert len(torch_spy) == 1 and not fake.calls  # the function bound before install(), as eagerly
    assert torch.equal(out, TORCH_SDPA(*tensors) * 2)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_config_without_compile_falls_back_with_the_reason_compile():
    config = dataclasses.replace(SMALL, contexts=(contexts.SIDE_STREAM,))
    tensors = qkv()
    with wrapped(gpus=(SM90,), config=config) as (cuda, fake):
        run = torch.compile(attention_times_two, backend="aot_eager", fullgraph=True)
        with sage_qual.sage_attention_scope() as report:
            out = run(*tensors)
    assert report.fallbacks == {"compile": 1} and not fake.calls
    assert torch.equal(out, TORCH_SDPA(*tensors) * 2)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_calls_that_need_a_gradient_stay_torchs():
    seen = []
    q, k, v = (t.requires_grad_() for t in qkv(dtype=torch.float32))
    with wrapped(gpus=(SM90,)) as (cuda, fake):
        run = torch.compile(attention_times_two, backend=graph_recorder(seen))
        with sage_qual.sage_attention_scope():
            run(q, k, v).sum().backward()
    assert q.grad is not None and not fake.calls
    assert torch.ops.sage_qual.sdpa_outside_cuda_graphs.default not in seen


def test_the_operator_for_legacy_kernels_is_kept_out_of_cuda_graphs():
    assert compiled.KEEPS_OUT_OF_CUDA_GRAPHS  # torch 2.13 has the tag and custom_op takes it
    assert torch.Tag.cudagraph_unsafe in torch.ops.sage_qual.sdpa_outside_cuda_graphs.default.tags
    assert torch.Tag.cudagraph_unsafe not in torch.ops.sage_qual.sdpa.default.tags


# A certified profile's contexts -------------------------------------------------------------------

def test_a_profile_entry_gives_its_device_the_certified_contexts():
    from sage_qual.serving import profile_matching as matching
    from sage_qual.verdicts import profile

    served = Served("sm90-fp8-cuda", 32, 16, [64], 64, 64, ["contiguous"], contexts=["capture"])
    config = matching.apply(SMALL, SM90, profile.Entry(served))
    assert config.safe_contexts(VARIANTS["sm90-fp8-cuda"]) == ("capture",)
    assert "; contexts: capture)" in served.text()
    unverified = profile.Entry(dataclasses.replace(served, contexts=None))
    assert matching.apply(SMALL, SM90, unverified).contexts is None


def test_a_profile_entry_with_no_context_certified_serves_the_default_stream_only():
    """`contexts: []` (certify checked, and none passed) is not null (never checked: the built-in
    rule, which trusts a legacy-stream kernel on a side stream): a side-stream call falls back."""
    from sage_qual.serving import profile_matching as matching
    from sage_qual.verdicts import profile

    from .. import builders

    data = builders.make_profile(gpu=builders.H200, entry=builders.make_entry(
        "sm90-fp8-cuda", 32, 16, [64], max_query_tokens=64, max_key_tokens=64, contexts=[]))
    entry = profile.load(data).gpus[0].default
    assert entry.served.contexts == ()
    config = matching.apply(SMALL, SM90, entry)
    assert config.safe_contexts(VARIANTS["sm90-fp8-cuda"]) == ()
    tensors = qkv()
    with wrapped(gpus=(SM90,), config=config) as (cuda, fake):
        with cuda.side_stream():
            _, report = serve(*tensors)
        _, default = serve(*tensors)
    assert report.fallbacks == {"stream": 1} and default.served == 1


@pytest.mark.parametrize("given, words", [(["graphs"], "'graphs' is not"), (["capture", "capture"], "twice")])
def test_a_profile_entry_with_bad_contexts_names_the_field(given, words):

    problems = Served("sm90-fp8-cuda", 32, 16, [64], contexts=given).check()
    assert problems and problems[0][0] == "contexts" and words in problems[0][1]
