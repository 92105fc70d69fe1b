"""The fake `sageattention` and `comfy_kitchen` of `sage_qual.testing`: kernels made from the variant
registry that record their calls and refuse what the real ones refuse."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from sage_qual.kernels import sage_package
from sage_qual.kernels.numerics import exact_attention
from sage_qual.kernels.providers import COMFY_KITCHEN, THU_ML
from sage_qual.kernels.variants import (
    EXTENSIONS,
    KERNEL_FUNCTIONS,
    KernelFunction,
    mask_broadcasts,
    upstream_pick,
)
from sage_qual.serving import platform
from sage_qual.serving.eligibility import MASK_DTYPES
from sage_qual.testing.cuda import FakeCuda, device_of

# comfy_kitchen's modules the fake puts in place (or hides): its package, kernels module and the
# packages above its CUDA extension.
_CK_MODULES = ("comfy_kitchen", "comfy_kitchen.sage_attention", "comfy_kitchen.backends",
               "comfy_kitchen.backends.cuda")

def check_call(function: KernelFunction, q, k, v, keywords: dict[str, Any]) -> None:
    """Raise what the real kernel raises for a call it refuses (upstream core.py's asserts and
    ValueErrors, csrc/qattn's CHECK_DIMS / CHECK_SHAPE as RuntimeError); also refuse option values
    upstream silently misreads (an unknown tensor_layout runs as "HND" in the CUDA kernels) and
    shapes its Triton kernel would read out of bounds (a batch or head_dim mismatch)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise TypeError("q, k and v must be tensors")
    if device_of(q) is None:
        raise AssertionError("Input tensors must be on cuda.")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise AssertionError("Input tensors must be in dtype of torch.float16 or torch.bfloat16")
    if not device_of(q) == device_of(k) == device_of(v):
        raise AssertionError("All tensors must be on the same device.")
    if not q.dtype == k.dtype == v.dtype:
        raise AssertionError("All tensors must have the same dtype.")
    for name, allowed in function.choices.items():
        if name in keywords and keywords[name] not in allowed:
            raise ValueError(f"Unsupported {name}: {keywords[name]!r} (upstream takes {', '.join(allowed)})")
    for name, tensor in (("query", q), ("key", k), ("value", v)):
        if tensor.dim() != 4:
            raise RuntimeError(f"Tensor {name} must have dimension number (4)")
    if q.shape[-1] > function.max_head_dim:
        raise ValueError(f"Unsupported head_dim: {q.shape[-1]}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise AssertionError("Last dim of qkv must be contiguous.")
    nhd = keywords.get("tensor_layout", "HND") == "NHD"
    batch, head_dim = q.shape[0], q.shape[3]
    kv_len, kv_heads = (k.shape[1], k.shape[2]) if nhd else (k.shape[2], k.shape[1])
    expected = (batch, kv_len, kv_heads, head_dim) if nhd else (batch, kv_heads, kv_len, head_dim)
    for name, tensor in (("key", k), ("value", v)):
        if tuple(tensor.shape) != expected:
            raise RuntimeError(f"Tensor {name} must have shape {expected}, got {tuple(tensor.shape)}")
    q_heads = q.shape[2] if nhd else q.shape[1]
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"num_qo_heads ({q_heads}) must be divisible by num_kv_heads ({kv_heads})")
    if keywords.get("is_causal") and keywords.get("attn_mask") is not None:
        raise AssertionError("Mask should be None for causal attention.")
    mask = keywords.get(function.mask_keyword) if function.mask_keyword else None
    if mask is not None:  # comfy-kitchen's _validate_inputs
        if device_of(mask) != device_of(q):
            raise ValueError("attn_mask must be on the same CUDA device as q, k, and v")
        if mask.dtype not in MASK_DTYPES:
            raise TypeError("attn_mask must be bool, float16, bfloat16, or float32")
        scores = (batch, q_heads, q.shape[1] if nhd else q.shape[2], kv_len)
        if not mask_broadcasts(tuple(mask.shape), scores):
            raise ValueError(f"attn_mask must be broadcastable to {list(scores)}, got {tuple(mask.shape)}")


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
    triton: whether the wrapper sees triton installed (`sage_package.has_triton`); the `triton`
        module itself is left alone, so torch.compile (Dynamo, Inductor) finds the real one or none.
    missing: kernel functions the module lacks.
    signature_drops: keyword names removed from every kernel's signature (they fall into **kwargs).
    current_stream: kernel functions that launch on torch's current stream (None: those the registry
        declares so, `KernelFunction.launches_on`). The others launch on the legacy default stream, as
        thu-ml's CUDA kernels do: called while `FakeCuda` is on a side stream or capturing, they
        return `legacy_stream_output(exact)` (zeros: the output buffer nothing wrote), as an
        unordered or unrecorded launch does.
    extension_dir: a folder to give the package files, as a built one has: its `__init__.py` and one
        `<extension>.so` per extension (written when absent), so `sage_package.source_digest` sees a
        build; a test rewrites one to stand for another build. The fake comfy_kitchen's files go in
        its `comfy_kitchen` subfolder. None: packages without files.
    comfy_kitchen: the version of a fake comfy-kitchen to install beside it (None: none, and a real
        one hidden); `ck_extensions` are its compiled extensions that import.
    """

    version: Optional[str] = "2.2.0"
    import_error: Optional[BaseException] = None
    extensions: tuple[str, ...] = EXTENSIONS
    triton: bool = True
    missing: tuple[str, ...] = ()
    signature_drops: tuple[str, ...] = ()
    current_stream: Optional[tuple[str, ...]] = None
    legacy_stream_output: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like
    extension_dir: Optional[Path] = None
    comfy_kitchen: Optional[str] = None
    ck_extensions: tuple[str, ...] = COMFY_KITCHEN.extensions
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
    def _kernel(self, function: KernelFunction, q, k, v, keywords: dict[str, Any]):
        cuda = platform.current()
        device = getattr(cuda, "current_device", None)
        self.calls.append(KernelCall(function.name, q, k, v, keywords, device))
        if hasattr(cuda, "events"):
            cuda.events.append(f"kernel {function.name} on {device}")
        check_call(function, q, k, v, keywords)
        nhd = keywords.get("tensor_layout") == "NHD"
        if nhd:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        sm_scale = keywords.get(function.scale_keyword)
        exact = exact_attention(q, k, v, q.shape[-1] ** -0.5 if sm_scale is None else sm_scale,
                                bool(keywords.get("is_causal")), keywords.get("attn_mask"),
                                bool(keywords.get("return_lse")))
        if nhd:
            exact = ((exact[0].transpose(1, 2), exact[1]) if isinstance(exact, tuple)
                     else exact.transpose(1, 2))
        if isinstance(cuda, FakeCuda) and cuda.stream != "default" and not self._on_current_stream(function):
            exact = self.legacy_stream_output(exact)
        return exact if self._behaviour is None else self._behaviour(exact)

    def _on_current_stream(self, function: KernelFunction) -> bool:
        if self.current_stream is None:
            return function.launches_on == "current"
        return function.name in self.current_stream

    def _make_kernel(self, function: KernelFunction) -> Callable:
        """A function named and signed like the real one: q, k, v, its keywords (less
        `signature_drops`, which fall into **kwargs as a renamed keyword would), **kwargs."""
        kind, keyword_kind = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_KEYWORD
        signature = inspect.Signature(
            [inspect.Parameter(name, kind) for name in ("q", "k", "v")]
            + [inspect.Parameter(name, kind, default=default) for name, default in function.keywords
               if name not in self.signature_drops]
            + [inspect.Parameter("kwargs", keyword_kind)])

        def kernel(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            keywords = {name: value for name, value in arguments.items()
                        if name not in ("q", "k", "v", "kwargs")}
            return self._kernel(function, arguments["q"], arguments["k"], arguments["v"],
                                {**keywords, **arguments["kwargs"]})

        kernel.__name__ = kernel.__qualname__ = function.name
        kernel.__signature__ = signature
        return kernel

    def module(self) -> types.ModuleType:
        module = types.ModuleType("sageattention")
        module.__spec__ = importlib.machinery.ModuleSpec("sageattention", None, is_package=True)
        module.__path__ = []
        module.__version__ = self.version
        if self.extension_dir is not None:
            self.extension_dir.mkdir(parents=True, exist_ok=True)
            module.__file__ = str(self.extension_dir / "__init__.py")
            Path(module.__file__).touch()
        self._add_kernels(module, THU_ML.name)
        module.sageattn = self._make_dispatcher(module)
        return module

    def _add_kernels(self, module: types.ModuleType, provider: str) -> None:
        for function in KERNEL_FUNCTIONS.values():
            if function.provider == provider and function.name not in self.missing:
                setattr(module, function.name, self._make_kernel(function))

    def function(self, name: str) -> Callable:
        """The fake kernel function `name` of any provider (`KERNEL_FUNCTIONS`), as its module holds it."""
        return self._make_kernel(KERNEL_FUNCTIONS[name])

    def ck_modules(self) -> dict[str, types.ModuleType]:
        """The fake comfy_kitchen's modules by name: packages, and the kernels module."""
        modules = {}
        for name in _CK_MODULES:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            module.__path__ = []
            modules[name] = module
        modules["comfy_kitchen"].__version__ = self.comfy_kitchen
        if self.ck_folder is not None:  # the package and its kernels module, as files
            self.ck_folder.mkdir(parents=True, exist_ok=True)
            files = {"comfy_kitchen": "__init__.py", "comfy_kitchen.sage_attention": "sage_attention.py"}
            for name, file in files.items():
                modules[name].__file__ = str(self.ck_folder / file)
                Path(modules[name].__file__).touch()
        self._add_kernels(modules["comfy_kitchen.sage_attention"], COMFY_KITCHEN.name)
        return modules

    @property
    def ck_folder(self) -> Optional[Path]:
        return self.extension_dir / "comfy_kitchen" if self.extension_dir is not None else None

    def _make_dispatcher(self, module: types.ModuleType) -> Callable:
        """Upstream's `sageattn()`: the kernel and options core.py picks for the GPU of `q` (the
        variant `variants.upstream_pick` names for its capability); other keywords, smooth_k included, are
        swallowed by its **kwargs, so the kernel runs with upstream's defaults."""

        def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False,
                     **kwargs):
            cuda = platform.current()
            index = cuda.tensor_device(q)
            if index is None:
                raise AssertionError("Input tensors must be on cuda.")
            capability = cuda.capability(index)
            variant = upstream_pick(capability)
            if variant is None:
                raise ValueError("Unsupported CUDA architecture: sm%d%d" % capability)
            kernel = getattr(module, variant.function)
            return kernel(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal, sm_scale=sm_scale,
                          return_lse=return_lse, **variant.options)

        return sageattn

    @contextlib.contextmanager
    def installed(self):
        """Put the fake package in place of any real one for a block, and tell the wrapper whether
        triton is installed (`triton`)."""
        names = (["sageattention"] + [f"sageattention.{e}" for e in EXTENSIONS] + list(_CK_MODULES)
                 + [f"comfy_kitchen.{e}" for e in COMFY_KITCHEN.extensions])
        saved = {name: sys.modules.get(name) for name in names}
        finder = _FakeFinder(self)
        for name in names:
            sys.modules.pop(name, None)
        if self.import_error is None:
            sys.modules["sageattention"] = self.module()
        # A module set to None is one Python finds nowhere: the real comfy_kitchen stays hidden.
        sys.modules.update(self.ck_modules() if self.comfy_kitchen else {"comfy_kitchen": None})
        has_triton, sage_package.has_triton = sage_package.has_triton, lambda: self.triton
        sys.meta_path.insert(0, finder)
        try:
            yield self
        finally:
            sage_package.has_triton = has_triton
            sys.meta_path.remove(finder)
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module


class _FakeDistribution(importlib.metadata.Distribution):
    def __init__(self, version: str, name: str = "sageattention"):
        self._metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"

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
            return importlib.machinery.ModuleSpec(name, _ExtensionLoader(self.fake.extensions,
                                                                         self.fake.extension_dir))
        if self.fake.comfy_kitchen and name.split(".", 1)[-1] in COMFY_KITCHEN.extensions:
            return importlib.machinery.ModuleSpec(name, _ExtensionLoader(self.fake.ck_extensions,
                                                                         self.fake.ck_folder))
        return None

    def find_distributions(self, context=_ANY_DISTRIBUTION):
        if context.name in (None, "sageattention") and self.fake.version is not None:
            yield _FakeDistribution(self.fake.version)
        elif context.name == "sageattention":
            # Shadow a real installation: this fake has no metadata.
            raise importlib.metadata.PackageNotFoundError("sageattention")
        if context.name in (None, "comfy-kitchen", "comfy_kitchen") and self.fake.comfy_kitchen is not None:
            yield _FakeDistribution(self.fake.comfy_kitchen, "comfy-kitchen")
        elif context.name in ("comfy-kitchen", "comfy_kitchen"):
            raise importlib.metadata.PackageNotFoundError("comfy-kitchen")  # hide a real one


class _FailingLoader(importlib.abc.Loader):
    def __init__(self, error: BaseException):
        self.error = error

    def create_module(self, spec):
        raise self.error

    def exec_module(self, module):  # pragma: no cover - create_module raises first
        raise self.error


class _ExtensionLoader(importlib.abc.Loader):
    def __init__(self, available: tuple[str, ...], folder: Optional[Path]):
        self.available, self.folder = available, folder

    def create_module(self, spec):
        if spec.name.split(".", 1)[1] not in self.available:
            raise ImportError(f"fake: {spec.name} was not built")
        return None

    def exec_module(self, module):
        if self.folder is not None:
            binary = self.folder / (module.__name__.split(".", 1)[1] + ".so")
            if not binary.exists():
                binary.write_bytes(b"fake build of " + module.__name__.encode())
            module.__file__ = str(binary)
