"""A fake `sageattention` and a fake CUDA, for our tests and for downstream apps' tests.

    from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention, on_device

    fake = FakeSageAttention(version="2.2.0")
    with FakeCuda([FakeGpu((8, 9), "RTX 4090")]), fake.installed():
        sage_qual.install()
        with sage_qual.sage_attention_scope():
            out = F.scaled_dot_product_attention(q, k, v)   # CPU tensors, served by the fake
    assert fake.calls[0].keywords["smooth_k"] is False

CPU tensors count as CUDA tensors on fake device 0, or on the device `on_device()` gives them;
meta tensors count as not on a GPU. The fake kernels declare the real keyword signatures of
SageAttention 2.2, record every call, and return the exact attention computed in float32 (cast
to the input dtype, as the real kernels return), unless told to raise or return something else.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from sage_qual.serving import platform
from sage_qual.serving.variants import EXTENSIONS

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
        self.events: list[str] = []
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

    def __enter__(self):
        self._swap = platform.use(self)
        return self._swap.__enter__()

    def __exit__(self, *exc):
        return self._swap.__exit__(*exc)


def exact_attention(q, k, v, sm_scale: float) -> torch.Tensor:
    """Attention in float32 on [B, H, N, D] tensors (K/V may have fewer heads), in q's dtype."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * sm_scale
    return (scores.softmax(-1) @ v).to(q.dtype)


@dataclass
class KernelCall:
    function: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    keywords: dict[str, Any]
    device: Optional[int]  # the fake current device while the kernel ran


@dataclass
class FakeSageAttention:
    """A stand-in `sageattention` package; see the module docstring.

    version: what its metadata reports (None: no metadata at all).
    import_error: raised when `sageattention` is imported (e.g. OSError("DLL load failed")).
    extensions: compiled extensions that import; the others raise ImportError.
    triton: whether `triton` looks installed.
    missing: kernel functions the module lacks.
    signature_drops: keyword names removed from every kernel's signature (they fall into **kwargs).
    """

    version: Optional[str] = "2.2.0"
    import_error: Optional[BaseException] = None
    extensions: tuple[str, ...] = EXTENSIONS
    triton: bool = True
    missing: tuple[str, ...] = ()
    signature_drops: tuple[str, ...] = ()
    calls: list[KernelCall] = field(default_factory=list)
    _behaviour: Optional[Callable] = None

    # Behaviour of the next kernel calls -------------------------------------------------------
    def raise_error(self, error: BaseException, times: Optional[int] = None) -> None:
        """Make kernel calls raise `error` (the next `times` calls, or all of them)."""
        remaining = [times]

        def behaviour(exact):
            if remaining[0] is None or remaining[0] > 0:
                if remaining[0] is not None:
                    remaining[0] -= 1
                raise error
            return exact

        self._behaviour = behaviour

    def return_value(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Make kernel calls return `make(exact_result)` (NaN, garbage, uninitialized memory...)."""
        self._behaviour = make

    def behave(self) -> None:
        """Back to exact results."""
        self._behaviour = None

    # The fake module ------------------------------------------------------------------------
    def _kernel(self, name: str, q, k, v, keywords: dict[str, Any]):
        cuda = platform.current()
        device = getattr(cuda, "current_device", None)
        self.calls.append(KernelCall(name, q, k, v, keywords, device))
        if hasattr(cuda, "events"):
            cuda.events.append(f"kernel {name} on {device}")
        sm_scale = keywords.get("sm_scale") or q.shape[-1] ** -0.5
        exact = exact_attention(q, k, v, sm_scale)
        return exact if self._behaviour is None else self._behaviour(exact)

    def module(self) -> types.ModuleType:
        fake = self
        module = types.ModuleType("sageattention")
        module.__spec__ = importlib.machinery.ModuleSpec("sageattention", None, is_package=True)
        module.__path__ = []
        module.__version__ = self.version

        def sageattn_qk_int8_pv_fp16_triton(q, k, v, tensor_layout="HND", quantization_backend="triton",
                                            is_causal=False, attn_mask=None, sm_scale=None, smooth_k=True,
                                            return_lse=False, **kwargs):
            keywords = dict(locals(), **kwargs)
            return fake._kernel("sageattn_qk_int8_pv_fp16_triton", q, k, v, _keywords(keywords))

        def sageattn_qk_int8_pv_fp16_cuda(q, k, v, tensor_layout="HND", is_causal=False,
                                          qk_quant_gran="per_thread", sm_scale=None, pv_accum_dtype="fp32",
                                          smooth_k=True, smooth_v=False, return_lse=False, **kwargs):
            keywords = dict(locals(), **kwargs)
            return fake._kernel("sageattn_qk_int8_pv_fp16_cuda", q, k, v, _keywords(keywords))

        def sageattn_qk_int8_pv_fp8_cuda(q, k, v, tensor_layout="HND", is_causal=False,
                                         qk_quant_gran="per_thread", sm_scale=None,
                                         pv_accum_dtype="fp32+fp16", smooth_k=True, smooth_v=False,
                                         return_lse=False, **kwargs):
            keywords = dict(locals(), **kwargs)
            return fake._kernel("sageattn_qk_int8_pv_fp8_cuda", q, k, v, _keywords(keywords))

        def sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout="HND", is_causal=False,
                                              qk_quant_gran="per_thread", sm_scale=None,
                                              pv_accum_dtype="fp32+fp32", smooth_k=True, return_lse=False,
                                              **kwargs):
            keywords = dict(locals(), **kwargs)
            return fake._kernel("sageattn_qk_int8_pv_fp8_cuda_sm90", q, k, v, _keywords(keywords))

        for function in (sageattn_qk_int8_pv_fp16_triton, sageattn_qk_int8_pv_fp16_cuda,
                         sageattn_qk_int8_pv_fp8_cuda, sageattn_qk_int8_pv_fp8_cuda_sm90):
            if function.__name__ in self.missing:
                continue
            if self.signature_drops:
                signature = inspect.signature(function)
                kept = [p for p in signature.parameters.values() if p.name not in self.signature_drops]
                function.__signature__ = signature.replace(parameters=kept)
            setattr(module, function.__name__, function)
        return module

    @contextlib.contextmanager
    def installed(self):
        """Put the fake package (and a fake triton) in place of any real one for a block."""
        names = ["sageattention", "triton"] + [f"sageattention.{e}" for e in EXTENSIONS]
        saved = {name: sys.modules.get(name) for name in names}
        finder = _FakeFinder(self)
        for name in names:
            sys.modules.pop(name, None)
        if self.import_error is None:
            sys.modules["sageattention"] = self.module()
        if self.triton:
            triton = types.ModuleType("triton")
            triton.__spec__ = importlib.machinery.ModuleSpec("triton", None)
            triton.__version__ = "0.0.0+fake"
            sys.modules["triton"] = triton
        else:
            sys.modules["triton"] = None  # find_spec answers None, import raises
        sys.meta_path.insert(0, finder)
        try:
            yield self
        finally:
            sys.meta_path.remove(finder)
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module


def _keywords(local_names: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in local_names.items() if k not in ("q", "k", "v", "kwargs", "fake")}


class _FakeDistribution(importlib.metadata.Distribution):
    def __init__(self, version: str):
        self._metadata = f"Metadata-Version: 2.1\nName: sageattention\nVersion: {version}\n"

    def read_text(self, filename):
        return self._metadata if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path):
        return path


# The default query of `find_distributions` (all distributions), made once as the stdlib's own
# default is; a module-level singleton rather than a call in the signature (ruff B008).
_ANY_DISTRIBUTION = importlib.metadata.DistributionFinder.Context()


class _FakeFinder(importlib.abc.MetaPathFinder):
    """Answers metadata queries for the fake, imports its extensions, or fails its import."""

    def __init__(self, fake: FakeSageAttention):
        self.fake = fake

    def find_spec(self, name, path=None, target=None):
        if name == "sageattention" and self.fake.import_error is not None:
            return importlib.machinery.ModuleSpec(name, _FailingLoader(self.fake.import_error))
        if name.startswith("sageattention.") and name.split(".", 1)[1] in EXTENSIONS:
            return importlib.machinery.ModuleSpec(name, _ExtensionLoader(self.fake.extensions))
        return None

    def find_distributions(self, context=_ANY_DISTRIBUTION):
        if context.name in (None, "sageattention") and self.fake.version is not None:
            yield _FakeDistribution(self.fake.version)
        elif context.name == "sageattention":
            # Shadow a real installation: this fake has no metadata.
            raise importlib.metadata.PackageNotFoundError("sageattention")


class _FailingLoader(importlib.abc.Loader):
    def __init__(self, error: BaseException):
        self.error = error

    def create_module(self, spec):
        raise self.error

    def exec_module(self, module):  # pragma: no cover - create_module raises first
        raise self.error


class _ExtensionLoader(importlib.abc.Loader):
    def __init__(self, available: tuple[str, ...]):
        self.available = available

    def create_module(self, spec):
        if spec.name.split(".", 1)[1] not in self.available:
            raise ImportError(f"fake: {spec.name} was not built")
        return None

    def exec_module(self, module):
        pass
