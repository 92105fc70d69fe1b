"""Everything the wrapper asks torch about the GPUs, behind one small object.

The wrapper never calls torch.cuda directly; it asks `current()`. Tests swap in
`sage_qual.testing.FakeCuda`, which makes a CPU build look like a CUDA build. None of these
methods synchronizes the device: they read tensor metadata and cached device properties.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager

import torch

from sage_qual.kernels import contexts


# Cached once per device index for the process (the set of visible devices cannot change once
# CUDA is initialized). Module-level rather than functools.cache on the methods, which would also
# keep every CudaPlatform instance alive (ruff B019); a call that raises is not cached.
@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


class CudaPlatform:
    def is_rocm(self) -> bool:
        return torch.version.hip is not None

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def capability(self, index: int) -> tuple[int, int]:
        return _capability(index)

    def device_name(self, index: int) -> str:
        return _device_name(index)

    def total_memory(self, index: int) -> int:
        return torch.cuda.get_device_properties(index).total_memory

    def sm_count(self, index: int) -> int:
        return torch.cuda.get_device_properties(index).multi_processor_count

    def torch_cuda(self) -> tuple[int, int] | None:
        if torch.version.cuda is None:
            return None
        major, minor = torch.version.cuda.split(".")[:2]
        return int(major), int(minor)

    def tensor_device(self, tensor: torch.Tensor) -> int | None:
        """CUDA device index of a tensor, None when it is not on a CUDA device."""
        device = tensor.device
        return device.index if device.type == "cuda" else None

    def device_guard(self, index: int) -> ContextManager:
        return torch.cuda.device(index)

    def autocast_enabled(self) -> bool:
        return torch.is_autocast_enabled("cuda")

    def stream_contexts(self, index: int) -> tuple[str, ...]:
        """The stream contexts of a call on device `index` now: `capture` first (a capture runs on a
        side stream, and is the reason to report), then `side_stream`; () on the default stream."""
        if torch.cuda.is_current_stream_capturing():
            return (contexts.CAPTURE, contexts.SIDE_STREAM)
        if torch.cuda.current_stream(index) != torch.cuda.default_stream(index):
            return (contexts.SIDE_STREAM,)
        return ()

    def launch(self, index: int, context: tuple[str, ...], legacy_stream: bool,
               call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run a served kernel call in `context` (`stream_contexts`, plus `compile`): a kernel that
        launches on the legacy stream (`legacy_stream`) called from a side stream is bridged onto
        it (`run_on_legacy_stream`); never under capture, where the legacy stream cannot be captured
        (and where only a capture-safe variant gets here)."""
        if legacy_stream and contexts.SIDE_STREAM in context and contexts.CAPTURE not in context:
            return self.run_on_legacy_stream(index, call)
        return call()

    def run_on_legacy_stream(self, index: int, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`call()` on the legacy default stream, ordered after the caller's stream and before its
        next work, its output kept from reuse until the caller's stream is done with it.

        For kernels that launch on the legacy stream whatever torch's current stream is: their
        Triton quantizers then run there too. On one H200 (sm90 kernel, [1, 24, 16384, 128] bf16)
        this made a side-stream call bit-identical to the default-stream call (docs/benchmarks.md
        has its cost). Not for a capturing stream: the legacy stream cannot be captured.
        """
        caller, legacy = torch.cuda.current_stream(index), torch.cuda.default_stream(index)
        legacy.wait_stream(caller)
        with torch.cuda.stream(legacy):
            out = call()
        caller.wait_stream(legacy)
        out.record_stream(caller)
        return out

    def read_later(self, values: torch.Tensor) -> Callable[[bool], list[float] | None]:
        """Start copying a few values to host memory without waiting for the device; returns
        `read(wait)`, which gives them once the copy has completed (None before), or waits for it
        when `wait`. The audit's numbers travel so: the served path never synchronizes."""
        if values.device.type != "cuda":
            ready = values.tolist()
            return lambda wait: ready
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def read(wait: bool) -> list[float] | None:
            if not wait and not copied.query():
                return None
            copied.synchronize()
            return host.tolist()

        return read


_platform: CudaPlatform = CudaPlatform()


def current() -> CudaPlatform:
    return _platform


@contextlib.contextmanager
def use(platform: CudaPlatform):
    """Swap the platform for the duration of a block (used by the fake CUDA helpers)."""
    global _platform
    previous, _platform = _platform, platform
    try:
        yield platform
    finally:
        _platform = previous
