"""The fake CUDA of `sage_qual.testing`: GPUs, streams and graph capture for CPU tensors."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from sage_qual.kernels import contexts
from sage_qual.serving import platform

_FAKE_INDEX = "_sage_qual_fake_cuda_index"


def on_device(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """Mark a CPU tensor as living on fake CUDA device `index` (returns the same tensor)."""
    setattr(tensor, _FAKE_INDEX, index)
    return tensor


@dataclass(frozen=True)
class FakeGpu:
    capability: tuple[int, int]
    name: str = "Fake GPU"
    memory_gib: float = 24.0
    sm_count: int | None = None  # None: torch does not say (a machine description without it)


class FakeCuda(platform.CudaPlatform):
    """Makes a CPU build of torch look like a CUDA build with the given GPUs.

    `events` records device switches ("enter 1", "exit 1"), and the fake kernels append
    "kernel <name> on <device>", so tests can check the kernel ran with its device current.
    """

    def __init__(self, gpus: list[FakeGpu], torch_cuda: Optional[tuple[int, int]] = (13, 0),
                 rocm: bool = False):
        self.gpus = list(gpus)
        self._torch_cuda = torch_cuda
        self.rocm = rocm
        self.current_device = 0
        # Per device, as torch keeps a current stream per device: "default" or "side", and whether
        # that device's current stream is capturing a CUDA graph. A call is judged by its own
        # device's stream, never by the current device's (issue 43).
        self.streams = {index: "default" for index in range(len(self.gpus))}
        self.capturing: set[int] = set()
        self.events: list[str] = []
        self.reads_held = False  # True: a value sent to the host arrives only when waited for
        self._swap = None

    def is_rocm(self) -> bool:
        return self.rocm

    def device_count(self) -> int:
        return len(self.gpus)

    def capability(self, index: int) -> tuple[int, int]:
        return self.gpus[index].capability

    def device_name(self, index: int) -> str:
        return self.gpus[index].name

    def total_memory(self, index: int) -> int:
        return int(self.gpus[index].memory_gib * 2**30)

    def sm_count(self, index: int) -> int | None:
        return self.gpus[index].sm_count

    def torch_cuda(self):
        return self._torch_cuda

    def tensor_device(self, tensor: torch.Tensor):
        if tensor.device.type != "cpu":
            return None
        return getattr(tensor, _FAKE_INDEX, 0)

    @contextlib.contextmanager
    def device_guard(self, index: int):
        previous, self.current_device = self.current_device, index
        self.events.append(f"enter {index}")
        try:
            yield
        finally:
            self.current_device = previous
            self.events.append(f"exit {index}")

    def autocast_enabled(self) -> bool:
        # The fake CUDA device is the CPU, so CPU autocast stands for CUDA autocast.
        return torch.is_autocast_enabled("cpu")

    @contextlib.contextmanager
    def side_stream(self, index: Optional[int] = None):
        """Run the block as if torch's current stream of device `index` (None: the current device)
        were a side stream."""
        index = self.current_device if index is None else index
        previous, self.streams[index] = self.streams[index], "side"
        try:
            yield
        finally:
            self.streams[index] = previous

    @contextlib.contextmanager
    def capture(self, index: Optional[int] = None):
        """Run the block as if a CUDA graph were being captured on device `index` (None: the current
        device), on a side stream, as torch does."""
        index = self.current_device if index is None else index
        previous = self.streams[index], index in self.capturing
        self.streams[index] = "side"
        self.capturing.add(index)
        try:
            yield
        finally:
            self.streams[index] = previous[0]
            if not previous[1]:
                self.capturing.discard(index)

    @property
    def stream(self) -> str:
        """The current device's current stream."""
        return self.streams[self.current_device]

    def stream_contexts(self, index: int) -> tuple[str, ...]:
        if index in self.capturing:
            return (contexts.CAPTURE, contexts.SIDE_STREAM)
        return (contexts.SIDE_STREAM,) if self.streams[index] != "default" else ()

    def run_on_legacy_stream(self, index: int, call):
        self.events.append(f"legacy stream on {index}")
        previous, self.streams[index] = self.streams[index], "default"
        try:
            return call()
        finally:
            self.streams[index] = previous

    def read_later(self, values: torch.Tensor):
        ready = values.tolist()
        return lambda wait: ready if wait or not self.reads_held else None

    def __enter__(self):
        self._swap = platform.use(self)
        return self._swap.__enter__()

    def __exit__(self, *exc):
        return self._swap.__exit__(*exc)


def device_of(tensor: torch.Tensor) -> Optional[int]:
    return getattr(tensor, _FAKE_INDEX, 0) if tensor.device.type == "cpu" else None


