"""The real `platform.CudaPlatform`'s stream bridge, on a CPU: the fake GPU (`testing.FakeCuda`) replaces
these methods, so here torch.cuda's stream calls are recorded instead (issue 43: the legacy stream not
waiting for the caller, the output not recorded on the caller's stream, and the streams read on the
current device instead of the call's all passed the fast suite)."""

import contextlib

import pytest
import torch

from sage_qual.kernels import contexts
from sage_qual.serving.platform import CudaPlatform


class Stream:
    def __init__(self, name: str, events: list):
        self.name, self.events = name, events

    def wait_stream(self, other: "Stream") -> None:
        self.events.append(f"{self.name} waits for {other.name}")

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.name == self.name

    __hash__ = None


class Output:
    def __init__(self, events: list):
        self.events = events

    def record_stream(self, stream: Stream) -> None:
        self.events.append(f"output recorded on {stream.name}")


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda's stream calls, recorded: device 1's current stream is a side stream, device 0's is
    its default stream; `capturing` says whether a capture is under way."""
    events, state = [], {"capturing": False, "in": None}
    current = {0: Stream("default 0", events), 1: Stream("side 1", events)}
    default = {0: Stream("default 0", events), 1: Stream("default 1", events)}

    @contextlib.contextmanager
    def stream(s):
        events.append(f"enter {s.name}")
        state["in"] = s.name
        yield
        state["in"] = None
        events.append(f"leave {s.name}")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: current[index])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda index=None: default[index])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    return events, state


def test_a_legacy_call_from_a_side_stream_is_ordered_both_ways_on_the_calls_device(cuda):
    events, state = cuda
    ran_on = []

    def call():
        ran_on.append(state["in"])
        events.append("kernel")
        return Output(events)

    CudaPlatform().run_on_legacy_stream(1, call)
    assert ran_on == ["default 1"]
    assert events == ["default 1 waits for side 1", "enter default 1", "kernel", "leave default 1",
                      "side 1 waits for default 1", "output recorded on side 1"]


def test_the_stream_context_is_read_on_the_calls_device(cuda):
    events, state = cuda
    platform = CudaPlatform()
    assert platform.stream_contexts(1) == (contexts.SIDE_STREAM,)
    assert platform.stream_contexts(0) == ()
    state["capturing"] = True
    assert platform.stream_contexts(0) == (contexts.CAPTURE, contexts.SIDE_STREAM)


@pytest.mark.parametrize("context, legacy, bridged", [
    ((contexts.SIDE_STREAM,), True, True),
    ((contexts.SIDE_STREAM, contexts.COMPILE), True, True),
    ((contexts.CAPTURE, contexts.SIDE_STREAM), True, False),  # the legacy stream cannot be captured
    ((), True, False),
    ((contexts.SIDE_STREAM,), False, False),  # a kernel on the current stream needs no bridge
])
def test_launch_bridges_only_a_legacy_kernel_off_the_default_stream_outside_capture(cuda, context, legacy,
                                                                                    bridged):
    events, state = cuda
    ran_on = []

    def call():
        ran_on.append(state["in"])
        return Output(events)

    CudaPlatform().launch(1, context, legacy, call)
    assert ran_on == (["default 1"] if bridged else [None])
    assert ("output recorded on side 1" in events) == bridged


def test_the_device_queries_ask_torch_cuda_about_the_given_index(monkeypatch):
    """What the wrapper reads of a GPU comes from torch.cuda for that device index (issue 43: SM counts
    never read, or read off another device, passed the fast suite)."""
    from sage_qual.serving import platform

    class Properties:
        def __init__(self, index):
            self.total_memory, self.multi_processor_count = (141 + index) << 30, 132 + index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, index))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"GPU {index}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", Properties)
    monkeypatch.setattr(torch.cuda, "device", lambda index: ("guard", index))
    monkeypatch.setattr(torch.version, "cuda", "13.0.48")
    monkeypatch.setattr(torch.version, "hip", None)
    platform._capability.cache_clear()
    platform._device_name.cache_clear()
    try:
        cuda = CudaPlatform()
        assert cuda.device_count() == 2 and not cuda.is_rocm()
        assert (cuda.capability(1), cuda.device_name(1)) == ((9, 1), "GPU 1")
        assert (cuda.total_memory(1), cuda.sm_count(1)) == (142 << 30, 133)
        assert cuda.torch_cuda() == (13, 0)
        assert cuda.device_guard(1) == ("guard", 1)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.version, "cuda", None)
        monkeypatch.setattr(torch.version, "hip", "6.2")
        assert (cuda.device_count(), cuda.torch_cuda(), cuda.is_rocm()) == (0, None, True)
    finally:
        platform._capability.cache_clear()
        platform._device_name.cache_clear()


@pytest.mark.parametrize("device, index", [(torch.device("cuda", 1), 1), (torch.device("xpu", 1), None),
                                           (torch.device("cpu"), None)])
def test_a_tensors_device_index_on_cuda_and_none_elsewhere(device, index):
    on = type("On", (torch.Tensor,), {"device": property(lambda self: device)})
    assert CudaPlatform().tensor_device(torch.Tensor._make_subclass(on, torch.zeros(1))) == index


def test_autocast_is_read_for_cuda(monkeypatch):
    asked = []
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type: asked.append(device_type) or True)
    assert CudaPlatform().autocast_enabled() and asked == ["cuda"]
