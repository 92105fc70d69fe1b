"""Attention integrations certify can qualify: what applications really call, not only our wrapper.

A `Target` is one integration of SageAttention:

- `attention(q, k, v, **sdpa_kwargs) -> out`: the call, with SDPA's arguments and [B, H, N, D]
  layout in and out (an adapter converts to the integration's own layout, as its app would);
- `enabled()`: how the app switches it on (install + scope, a backend context, nothing), yielding
  `Evidence` of which calls reached a SageAttention function;
- `claims`: what it says it supports; `not_supported_reasons(q, k, v)` and `machine_reasons(box)`
  turn them into reasons such as `head_dim=96 (supported: 64, 128)`.

Built in (`resolve(name)`): `wrapper` (sage_qual as installed), `wrapper:<variant>` (one variant
forced, no thresholds, in place of a wrapper an app installed first), `sageattn` (upstream
`sageattention.sageattn()` as most apps call it: its kernels' default `smooth_k=True`),
`diffusers:<backend>` (diffusers' SageAttention backends through
`dispatch_attention_fn`, NHD layout, inside `attention_backend(...)`), and `module:function` (any
app's function with SDPA's signature, or a module attribute that is a `Target`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator

import torch

from sage_qual.kernels import sage_package
from sage_qual.kernels.providers import THU_ML
from sage_qual.kernels.variants import (
    KERNEL_FUNCTIONS,
    UPSTREAM_PICKS,
    VARIANTS,
    BoxFacts,
    Capability,
    Variant,
    capability_label,
    upstream_pick,
)
from sage_qual.serving import assess, audit, platform
from sage_qual.serving.config import DEFAULT_CONFIG, KERNEL_TABLE, WrapperConfig
from sage_qual.serving.eligibility import SdpaCall, refusal
from sage_qual.serving.scope import ScopeReport

FP16_TYPES = (torch.float16, torch.bfloat16)
# Every sageattention function an integration may call; `Evidence` counts calls to these.
SAGE_FUNCTIONS = ("sageattn", "sageattn_varlen",
                  *(name for name, f in KERNEL_FUNCTIONS.items() if f.provider == THU_ML.name))
# diffusers' backends that download their kernel from the Hugging Face Hub when enabled: nothing
# a qualification run on an offline GPU box can reach, so they are named and left out.
DIFFUSERS_HUB_BACKENDS = ("sage_hub", "sage_blackwell_hub")


class TargetError(ValueError):
    """A target name that cannot be resolved; the message says what to give instead."""


@dataclass(frozen=True)
class Claims:
    """What an integration says it takes. None: it makes no claim (anything goes through)."""

    head_dims: tuple[int, ...] | None = None  # exact sizes
    max_head_dim: int | None = None  # any size up to this (upstream pads to 64 or 128)
    dtypes: tuple[torch.dtype, ...] | None = FP16_TYPES
    capabilities: tuple[Capability, ...] | None = None  # exactly these GPUs
    min_capability: Capability | None = None
    masks: bool = False  # attn_mask, is_causal, dropout

    def call_reasons(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **sdpa_kwargs) -> list[str]:
        reasons = []
        head_dim = q.shape[-1]
        if self.head_dims is not None and head_dim not in self.head_dims:
            reasons.append(f"head_dim={head_dim} (supported: {', '.join(map(str, self.head_dims))})")
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            reasons.append(f"head_dim={head_dim} (supported: up to {self.max_head_dim})")
        if self.dtypes is not None and q.dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            reasons.append(f"dtype={str(q.dtype).replace('torch.', '')} (supported: {names})")
        if not self.masks:
            # A mask is given when it is not None: a tensor has no truth value of its own.
            used = [name for name in ("attn_mask", "is_causal", "dropout_p")
                    if (sdpa_kwargs.get(name) is not None if name == "attn_mask" else sdpa_kwargs.get(name))]
            if used:
                reasons.append(f"{', '.join(used)} given (supported: plain attention)")
        return reasons

    def machine_reasons(self, capability: Capability) -> list[str]:
        capability = tuple(capability)
        if self.capabilities is not None and capability not in self.capabilities:
            known = ", ".join(map(capability_label, self.capabilities))
            return [f"capability={capability_label(capability)} (supported: {known})"]
        if self.min_capability is not None and capability < self.min_capability:
            return [f"capability={capability_label(capability)} (needs >= "
                    f"{capability_label(self.min_capability)})"]
        return []


@dataclass
class Evidence:
    """What happened while a target was enabled: which calls reached a SageAttention function, and
    for those that did not, why (as far as the integration says)."""

    calls: int = 0
    served: int = 0
    functions: Counter = field(default_factory=Counter)  # sageattention function -> calls
    fallbacks: dict[str, str] = field(default_factory=dict)  # reason -> first such call's detail
    scope: ScopeReport | None = None  # the wrapper's own report, when the target is our wrapper

    def sage_calls(self) -> int:
        """Calls that reached SageAttention so far (the wrapper counts its own)."""
        return self.scope.served if self.scope is not None else sum(self.functions.values())

    def not_served_detail(self) -> str:
        fallbacks = dict(self.scope.details) if self.scope is not None else {}
        fallbacks.update(self.fallbacks)
        if fallbacks:
            return "; ".join(f"{reason}: {detail}" if detail else reason
                             for reason, detail in fallbacks.items())
        counted = ", ".join(SAGE_FUNCTIONS)
        return f"no SageAttention function was called (counted: sageattention.{counted})"


class Session:
    """An enabled target: `call()` runs one attention call and says whether SageAttention served it."""

    def __init__(self, target: "Target", evidence: Evidence):
        self.target, self.evidence = target, evidence

    def call(self, q, k, v, **sdpa_kwargs) -> tuple[torch.Tensor, bool]:
        before = self.evidence.sage_calls()
        out = self.target.attention(q, k, v, **sdpa_kwargs)
        served = self.evidence.sage_calls() > before
        self.evidence.calls += 1
        self.evidence.served += served
        return out, served


@dataclass
class Target:
    """One integration: see the module docstring."""

    name: str
    description: str
    attention: Callable[..., torch.Tensor]
    enable: Callable[[], ContextManager[Evidence]]
    claims: Claims = field(default_factory=Claims)
    # The registry variant whose kernel and numerics the integration runs on a GPU of this
    # capability (its budgets and accuracy class); None when it has no kernel there.
    variant_for: Callable[[Capability], Variant | None] = field(default=lambda capability: None)
    # Extra reasons the machine cannot run it (a package missing, the backend not usable).
    requirements: Callable[[BoxFacts], list[str]] = field(default=lambda box: [])
    # Reasons for one call beyond the claims (the wrapper's own eligibility rules).
    call_rules: Callable[..., list[str]] = field(default=lambda q, k, v, **sdpa_kwargs: [])

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """Enable the integration as its app would; calls go through `Session.call`."""
        with self.enable() as evidence:
            yield Session(self, evidence)

    def not_supported_reasons(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              **sdpa_kwargs) -> list[str]:
        """Why the integration claims not to take this call (empty: it claims to)."""
        return self.claims.call_reasons(q, k, v, **sdpa_kwargs) + self.call_rules(q, k, v, **sdpa_kwargs)

    def machine_reasons(self, box: BoxFacts | None) -> list[str]:
        """Why it cannot run on this GPU at all (empty: it can)."""
        if box is None:
            return ["no CUDA GPU visible: SageAttention integrations run on NVIDIA GPUs only"]
        return self.claims.machine_reasons(box.capability) + self.requirements(box)

    def variant(self, capability: Capability) -> Variant | None:
        return self.variant_for(tuple(capability))

    def accuracy_class(self, capability: Capability) -> str | None:
        variant = self.variant(capability)
        return variant.accuracy_class if variant else None


# Counting calls into sageattention ------------------------------------------------------------
@contextlib.contextmanager
def counting_sage_calls(evidence: Evidence, modules: tuple[types.ModuleType, ...] = ()) -> Iterator[Evidence]:
    """Count calls to sageattention's functions, wherever the integration holds them: as attributes
    of the `sageattention` module, and as names bound by `from sageattention import ...` in
    `modules` (diffusers' attention_dispatch, an app's module). The package is imported first when
    it is installed: patched only if already imported, the first call of a fresh process went
    uncounted (run 8, the sageattn target's first cell: "no SageAttention function was called")."""
    package = _imported_sageattention()
    originals = {name: getattr(package, name) for name in SAGE_FUNCTIONS if hasattr(package, name)} \
        if package is not None else {}
    patched: list[tuple[object, str, object]] = []

    def counted(name, function):
        def call(*args, **kwargs):
            out = function(*args, **kwargs)
            evidence.functions[name] += 1
            return out

        call.__wrapped__ = function
        call.__name__ = getattr(function, "__name__", name)
        return call

    for holder in (package, *modules):
        if holder is None:
            continue
        for attribute, value in list(vars(holder).items()):
            for name, function in originals.items():
                if value is function:
                    patched.append((holder, attribute, value))
                    setattr(holder, attribute, counted(name, function))
    try:
        yield evidence
    finally:
        for holder, attribute, value in reversed(patched):
            setattr(holder, attribute, value)


def _imported_sageattention() -> types.ModuleType | None:
    """The sageattention module, imported now if installed; None if it is not, or if it fails to
    import (the target's own call then reports that failure)."""
    if "sageattention" in sys.modules:
        return sys.modules["sageattention"]
    try:
        return importlib.import_module("sageattention") if importlib.util.find_spec("sageattention") else None
    except Exception:
        return None


# Our wrapper ----------------------------------------------------------------------------------
def _sdpa(q, k, v, **sdpa_kwargs):
    # Looked up at call time: install() rebinds it.
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)


def wrapper_target(variant: str | None = None) -> Target:
    """sage_qual's wrapper: as installed (default table and thresholds), or one variant forced on
    every GPU with no token thresholds (what a certified profile may pick)."""
    if variant is None:
        config = DEFAULT_CONFIG
        name, description = "wrapper", "sage_qual.install() as installed: default kernel table and thresholds"
    else:
        if variant not in VARIANTS:
            raise TargetError(f"unknown variant {variant!r} for target wrapper:VARIANT "
                              f"(known: {', '.join(VARIANTS)})")
        every_gpu = {*KERNEL_TABLE, *VARIANTS[variant].native_on}
        config = WrapperConfig(min_query_tokens=0, min_key_tokens=0,
                               kernel_table={cap: (variant,) for cap in every_gpu})
        name, description = f"wrapper:{variant}", f"sage_qual.install() with {variant} forced, no thresholds"

    @contextlib.contextmanager
    def enable() -> Iterator[Evidence]:
        import sage_qual

        evidence = Evidence()
        previous = sage_qual.install_status()
        # A forced variant must serve, not whatever wrapper an app installed first: that one is
        # replaced for the session and installed again, with its own configuration, afterwards.
        replaced = variant is not None and previous.enabled
        restore = {id(d.config): d.config for d in previous.devices} if replaced else {}
        if len(restore) > 1:
            evidence.fallbacks["install"] = (
                f"{name} cannot stand in for a wrapper installed from a profile (one configuration per "
                "GPU, which install(config=...) cannot restore): qualify it in a process of its own")
            yield evidence
            return
        if replaced:
            sage_qual.uninstall()
        # A trial of its own: no retirement of an earlier trial (or of the app) holds in it, and none
        # made in it outlives it.
        set_aside = audit.retirements_set_aside()
        set_aside.__enter__()
        installed_here = not sage_qual.install_status().enabled
        status = sage_qual.install(config=config) if installed_here else sage_qual.install_status()
        try:
            if not status.enabled:
                evidence.fallbacks["install"] = status.reason
                yield evidence
                return
            with sage_qual.sage_attention_scope() as report:
                evidence.scope = report
                yield evidence
        finally:
            if installed_here:
                sage_qual.uninstall()
            set_aside.__exit__(None, None, None)
            for app_config in restore.values():  # the one configuration of the app's wrapper
                sage_qual.install(config=app_config)

    def variant_for(capability: Capability) -> Variant | None:
        names = config.kernel_table.get(capability, ())
        return VARIANTS[names[0]] if names else None

    def requirements(box: BoxFacts) -> list[str]:
        chosen, why = config.kernel_for(box)
        return [] if chosen is not None else [why]

    def call_rules(q, k, v, **sdpa_kwargs) -> list[str]:
        """The wrapper's own eligibility rules, with its wording (`reason: detail`)."""
        refused = refusal(SdpaCall(q, k, v, **sdpa_kwargs), config, platform.current())
        if refused is None:
            return []
        reason, template, values = refused
        return [f"{reason}: {template % values}"] if reason not in ("head_dim", "dtype") else []

    return Target(name, description, _sdpa, enable,
                  Claims(head_dims=config.head_dims, capabilities=tuple(config.kernel_table)),
                  variant_for, requirements, call_rules)


# Upstream sageattn() --------------------------------------------------------------------------
def _sageattention_problem() -> list[str]:
    try:
        sage_package.load()
    except sage_package.SageUnavailable as why:
        return [str(why)]
    return []


def _native_capabilities() -> tuple[Capability, ...]:
    return tuple(sorted(UPSTREAM_PICKS))


def sageattn_target() -> Target:
    """`sageattention.sageattn(q, k, v, tensor_layout="HND", is_causal=..., sm_scale=scale)`: what
    most apps call. It passes no smooth_k, so its kernels smooth K (their default)."""

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        import sageattention

        return sageattention.sageattn(q, k, v, tensor_layout="HND", is_causal=is_causal, sm_scale=scale)

    @contextlib.contextmanager
    def enable() -> Iterator[Evidence]:
        with counting_sage_calls(Evidence()) as evidence:
            yield evidence

    return Target("sageattn", "upstream sageattention.sageattn(), HND, its default K smoothing on",
                  attention, enable,
                  Claims(max_head_dim=128, capabilities=_native_capabilities()),
                  upstream_pick, lambda box: _sageattention_problem())


# diffusers' backends --------------------------------------------------------------------------
# The variant whose kernel and options each backend runs: it passes no pv_accum_dtype or
# qk_quant_gran, so the kernel's defaults (upstream core.py: fp8 CUDA "fp32+fp16", sm90
# "fp32+fp32", fp16 CUDA "fp32", per-thread groups); `sage` dispatches per GPU like sageattn(),
# `sage_varlen` runs the Triton per-block kernel.
DIFFUSERS_KERNELS = {
    "sage": None,
    "sage_varlen": "sm86-fp16-triton",
    "_sage_qk_int8_pv_fp8_cuda": "sm89-fp8-cuda",
    "_sage_qk_int8_pv_fp8_cuda_sm90": "sm90-fp8-cuda",
    "_sage_qk_int8_pv_fp16_cuda": "sm80-fp16-cuda",
    "_sage_qk_int8_pv_fp16_triton": "sm86-fp16-triton",
}
# The capability each backend's registered constraint checks (`_check_device_cuda_atleast_smXY`):
# diffusers' own claim, which the kernels' real bounds need not match.
DIFFUSERS_MIN_CAPABILITY = {"_sage_qk_int8_pv_fp8_cuda": (9, 0), "_sage_qk_int8_pv_fp8_cuda_sm90": (9, 0),
                            "_sage_qk_int8_pv_fp16_cuda": (8, 0), "_sage_qk_int8_pv_fp16_triton": (8, 0)}


def diffusers_backends() -> list[str]:
    """diffusers' SageAttention backends that run offline (its registry, hub ones left out)."""
    dispatch = importlib.import_module("diffusers.models.attention_dispatch")
    names = [b.value for b in dispatch.AttentionBackendName if "sage" in b.value]
    return [n for n in names if n not in DIFFUSERS_HUB_BACKENDS]


def _diffusers_dispatch():
    try:
        return importlib.import_module("diffusers.models.attention_dispatch")
    except ImportError as error:
        # sage-qual is not on PyPI: its extra installs from a checkout only
        raise TargetError(f"diffusers targets need diffusers ({error}): pip install diffusers==0.42.1, "
                          "or pip install -e '.[diffusers]' in a sage-qual checkout") from None


def diffusers_target(backend: str) -> Target:
    """diffusers' `dispatch_attention_fn` inside `attention_backend(backend)`, q/k/v in diffusers'
    [B, N, H, D] layout, as its attention processors call it."""
    dispatch = _diffusers_dispatch()
    known = [b.value for b in dispatch.AttentionBackendName if "sage" in b.value]
    if backend not in known:
        raise TargetError(f"diffusers has no SageAttention backend {backend!r} (its SageAttention backends: "
                          f"{', '.join(known)})")
    if backend in DIFFUSERS_HUB_BACKENDS:
        raise TargetError(f"diffusers backend {backend!r} downloads its kernel from the Hugging Face Hub "
                          "when enabled, which an offline qualification cannot do; name a local backend "
                          f"({', '.join(b for b in known if b not in DIFFUSERS_HUB_BACKENDS)})")
    kernel = DIFFUSERS_KERNELS.get(backend)

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out = dispatch.dispatch_attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    @contextlib.contextmanager
    def enable() -> Iterator[Evidence]:
        with dispatch.attention_backend(backend), counting_sage_calls(Evidence(), (dispatch,)) as evidence:
            yield evidence

    def variant_for(capability: Capability) -> Variant | None:
        return upstream_pick(capability) if kernel is None else VARIANTS[kernel]

    claims = Claims(max_head_dim=128, dtypes=FP16_TYPES,
                    min_capability=DIFFUSERS_MIN_CAPABILITY.get(backend),
                    capabilities=_native_capabilities() if backend == "sage" else None)

    def requirements(box: BoxFacts | None) -> list[str]:
        problems = _sageattention_problem()
        if not problems and not getattr(dispatch, "_CAN_USE_SAGE_ATTN", True):
            problems.append(f"diffusers finds no usable sageattention >= {dispatch._REQUIRED_SAGE_VERSION}")
        return problems

    return Target(f"diffusers:{backend}", f"diffusers backend {backend!r} through dispatch_attention_fn",
                  attention, enable, claims, variant_for, requirements)


# Any app's function -----------------------------------------------------------------------------
def function_target(spec: str) -> Target:
    """`module:function`: a callable with SDPA's signature ([B, H, N, D] in and out), or a module
    attribute that is already a `Target` (the app then states its own enabling and claims)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise TargetError(f"target {spec!r} is not module:function (e.g. my_app.attention:sage_sdpa)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise TargetError(f"target {spec!r}: cannot import {module_name} ({error}); make it importable "
                          "(install the app or set PYTHONPATH)") from None
    value = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise TargetError(f"target {spec!r}: {module_name} has no attribute {attribute!r}")
        value = getattr(value, part)
    if isinstance(value, Target):
        return value
    if not callable(value):
        raise TargetError(f"target {spec!r} is a {type(value).__name__}, not a function "
                          "(q, k, v, **sdpa_kwargs) -> out")

    @contextlib.contextmanager
    def enable() -> Iterator[Evidence]:
        with counting_sage_calls(Evidence(), (module,)) as evidence:
            yield evidence

    # No claims stated: every call is tried, and the kernel class is the one upstream sageattn()
    # picks on the GPU (what an app that calls SageAttention gets by default).
    return Target(spec, f"{spec} (an application's attention function)", value, enable,
                  Claims(dtypes=None, masks=True), upstream_pick, lambda box: _sageattention_problem())


# Resolving names --------------------------------------------------------------------------------
def builtin_names() -> list[str]:
    """Every built-in target name (diffusers' only when diffusers imports)."""
    names = ["wrapper", *(f"wrapper:{v}" for v in VARIANTS), "sageattn"]
    try:
        names += [f"diffusers:{b}" for b in diffusers_backends()]
    except ImportError:
        pass
    return names


def resolve(name: str) -> Target:
    """A target by name: wrapper, wrapper:VARIANT, sageattn, diffusers:BACKEND or module:function."""
    name = name.strip()
    if name == "wrapper":
        return wrapper_target()
    if name.startswith("wrapper:"):
        return wrapper_target(name.split(":", 1)[1])
    if name == "sageattn":
        return sageattn_target()
    if name.startswith("diffusers:"):
        return diffusers_target(name.split(":", 1)[1])
    if ":" in name:
        return function_target(name)
    raise TargetError(f"unknown target {name!r}: give one of {', '.join(builtin_names())} or an app's "
                      "module:function")


def box_facts() -> BoxFacts | None:
    """This process's first GPU as the variant rules see it (`assess`, the one answer to what can
    run here); None without a GPU."""
    machine = assess.assess_machine()
    return machine.gpus[0].box if machine.gpus else None
