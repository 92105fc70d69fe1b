"""Route torch.nn.functional.scaled_dot_product_attention to SageAttention inside a scope.

`install()` rebinds torch's function once and never raises; outside `sage_attention_scope()` the
replacement hands every call to torch untouched. Inside a scope, a call that passes the rules of
`eligibility` runs on the kernel `config.kernel_table` picks for its GPU, with K smoothing off.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from dataclasses import dataclass, field

import torch

from sage_qual.kernels import sage_package
from sage_qual.kernels.contexts import CAPTURE, COMPILE, REASON, SIDE_STREAM
from sage_qual.kernels.providers import PROVIDERS, THU_ML
from sage_qual.kernels.variants import Variant, capability_label
from sage_qual.limits import one_line
from sage_qual.serving import audit, platform, scope, slice_check, torch_sdpa
from sage_qual.serving.assess import Packages, assess, box_facts, loaded
from sage_qual.serving.audit import Auditor
from sage_qual.serving.config import DEFAULT_CONFIG, AuditConfig, WrapperConfig
from sage_qual.serving.eligibility import SdpaCall, bind, copies_fit, refusal, rows_without_keys, within_span
from sage_qual.serving.failures import Failure, classify
from sage_qual.serving.scope import ScopeReport, _active
from sage_qual.verdicts import fitness

log = logging.getLogger("sage_qual")


@dataclass
class DeviceState:
    index: int
    name: str
    capability: tuple[int, int]
    variant: Variant | None = field(repr=False)
    no_kernel_reason: str = ""
    retired: str = ""  # why the device went back to PyTorch until the process restarts
    checked: set = field(default_factory=set)  # (dtype, head_dim) that passed the first-call check
    cache_errors: int = 0  # consecutive Triton cache failures
    announced: bool = False
    # Its own thresholds and kernel table: a profile entry that matches this device, else the default.
    config: WrapperConfig = field(default=DEFAULT_CONFIG, repr=False)
    profile_note: str = ""  # which profile entry (or built-in default) applies, or why none does: one line
    profile_reasons: tuple[str, ...] = ()  # every reason that entry gives for serving nothing, in full
    profile_matched: bool = True  # False: no entry describes it, or a rule for a model never measured: warn

    @property
    def safe_contexts(self) -> tuple[str, ...]:
        """Execution contexts its variant may serve in (its config's certified ones, else built in)."""
        return self.config.safe_contexts(self.variant) if self.variant else ()

    @property
    def legacy_stream(self) -> bool:
        """Whether its kernel launches on the legacy default stream (a side-stream call is bridged)."""
        return bool(self.variant) and self.variant.kernel_function.launches_on == "legacy"

    @property
    def label(self) -> str:
        return "cuda:%d (%s, %s)" % (self.index, self.name, capability_label(self.capability))


@dataclass(frozen=True)
class InstallStatus:
    enabled: bool
    reason: str = ""  # why torch's function was kept, one line of at most 200 characters; empty when enabled
    version: str = ""
    devices: tuple[DeviceState, ...] = ()  # also when no GPU had a kernel: each one's reason in full


class _NoKernel(sage_package.SageUnavailable):
    """No GPU has a usable kernel; carries the devices, whose reasons say why in full."""

    def __init__(self, reason: str, devices: tuple[DeviceState, ...]):
        super().__init__(reason)
        self.devices = devices


class _Installed:
    """What a successful install() holds; module-level singleton while installed."""

    def __init__(self, original, packages: Packages, config: WrapperConfig, devices: dict[int, DeviceState],
                 arguments: tuple, family: str | None):
        self.arguments = arguments  # install()'s (config, profile, family, audit, own_family) as given
        self.original = original
        self.packages = packages
        self.config = config
        self.devices = devices
        # Per device, its variant's kernel from its provider's package, called as the variant is
        # (`Variant.invoke`): a call adds q, k, v and sm_scale.
        self.kernels = {i: functools.partial(d.variant.invoke, packages[d.variant.provider].kernel(d.variant))
                        for i, d in devices.items() if d.variant}
        self.lock = threading.Lock()
        self.function = None  # the function bound over torch's (see `_make_sdpa`)
        self.one_config = all(d.config is config for d in devices.values())
        self.auditor = Auditor(config.audit, family, original, functools.partial(_retire, self),
                               self.build_of)

    def build_of(self, device: DeviceState) -> str:
        """Its kernel's provider, version and origin, as a recorded miss names the build."""
        package = self.packages[device.variant.provider]
        return " ".join(filter(None, (package.provider, package.version, package.origin)))


_installed: _Installed | None = None
_status = InstallStatus(False, "install() has not been called")
_install_lock = threading.Lock()  # two threads installing at once must not wrap the wrapper


def install_status() -> InstallStatus:
    return _status


# A scope that begins while nothing is installed says so instead of reporting "0 attention calls".
scope.report_installs_with(lambda: "" if _installed is not None else _status.reason)
scope.settle_audits_with(lambda: _installed.auditor.settle(wait=True) if _installed is not None else None)


def install(config: WrapperConfig | None = None, profile=None, family: str | None = None,
            audit: AuditConfig | None = None, own_family: bool = False) -> InstallStatus:
    """Rebind torch's SDPA to the wrapper once. Never raises; logs one WARNING when it cannot.

    profile: a `sage-qual certify` profile.json (path or dict). Its GPU then gets the variant and
    thresholds certified for `family` (default: for all families), or no kernel. A GPU no entry
    describes keeps the defaults, and a family the nearest entry keeps off stays off, with one WARNING.
    Without config and profile, the built-in defaults apply (`sage_qual.serving.defaults`).
    audit: the sampled audit of served calls (`serving.audit`), in place of the config's (default:
    on, one call in each block of `limits.AUDIT_EVERY` per device); `AuditConfig(every=0)` turns it off.
    family: a family sage-qual qualifies, any spelling ("krea 2"); another is refused, unless
    `own_family=True`: then the default entry and the loosest fitness bound of all serve it.

    Called again while installed: with the same arguments it changes nothing and returns the same
    status; with others it installs anew with them (a notebook or a server switching families gets
    what it asked for, said in one INFO line), as `uninstall()` then `install()` would.
    """
    with _install_lock:
        return _install(config, profile, family, audit, own_family)


def _install(config: WrapperConfig | None, profile=None, family: str | None = None,
             audit_config: AuditConfig | None = None, own_family: bool = False) -> InstallStatus:
    global _installed, _status
    arguments = (config, profile, family, audit_config, own_family)
    if _installed is not None:
        if _installed.arguments == arguments:
            return _status
        log.info("install() called again with other arguments: installing anew with them")
        _take_out(_installed)
        _installed = None
    try:
        family = _family(family, own_family)
        loaded = _load_profile(profile)  # a broken profile is said before any GPU or package check
        config = config or DEFAULT_CONFIG
        if audit_config is not None:
            config = dataclasses.replace(config, audit=audit_config)
        devices, packages = _probe(config, loaded, family, builtin=arguments[0] is None)
        package = _primary(packages)
    except sage_package.SageUnavailable as why:
        _status = InstallStatus(False, str(why), devices=getattr(why, "devices", ()))
        log.warning("SageAttention not enabled, attention stays on PyTorch SDPA: %s", why)
        return _status
    except Exception as error:  # install must never break the application that calls it
        _status = InstallStatus(False, f"unexpected {type(error).__name__}: {error}")
        log.warning("SageAttention not enabled, attention stays on PyTorch SDPA: %s", _status.reason)
        return _status
    _installed = _Installed(torch.nn.functional.scaled_dot_product_attention, packages, config, devices,
                            arguments, family)
    _installed.function = _make_sdpa(_installed)
    torch_sdpa.bind(_installed.function, _installed.original)
    _status = InstallStatus(True, "", package.version, tuple(devices.values()))
    unmatched = [device for device in devices.values() if not device.profile_matched]
    if unmatched:  # one WARNING, once the install stands
        source = "built-in defaults" if loaded is None else "profile"
        others = f" and {len(unmatched) - 1} more GPUs" if len(unmatched) > 1 else ""
        note = unmatched[0].profile_note.removeprefix(f"{source}: ")  # said once, first
        # the device by its index: the note names the GPU model, and the 200 characters go to the range
        log.warning("%s", one_line(f"{source}: cuda:{unmatched[0].index}{others}: {note}"))
    for device in devices.values():
        if device.profile_note:
            log.info("%s: %s", device.label, device.profile_note)
    served = ", ".join(f"{d.label} -> {d.variant.name}" for d in devices.values() if d.variant)
    unserved = "; ".join(f"{d.label}: {d.no_kernel_reason}" for d in devices.values() if not d.variant)
    every = config.audit.every
    audited = f"; audit: 1 served call in {every} per GPU" if every else "; audit off"
    log.info("%s %s enabled for SDPA calls inside sage_attention_scope(): %s%s%s",
             PROVIDERS[package.provider].title, package.version, served,
             f"; no kernel for {unserved}" if unserved else "", audited)
    return _status


def uninstall() -> None:
    """Give torch back its own function (a no-op when not installed). When something bound its own
    function over the wrapper since (the fixture recorder), that one now calls what the wrapper
    called, and torch's name gets torch's function back when it is removed."""
    global _installed, _status
    with _install_lock:
        if _installed is not None:
            _take_out(_installed)
            _installed = None
        _status = InstallStatus(False, "uninstall() was called")


def _take_out(state: _Installed) -> None:
    """Unbind an installed wrapper, its pending audits judged first (their misses still count)."""
    torch_sdpa.unbind(state.function)
    state.auditor.settle(wait=True)


def _family(family, own_family: bool) -> str | None:
    """The family's one name, the caller's own as given, else SageUnavailable with the known names."""
    known = fitness.family_name(family) if isinstance(family, str) else None
    if family is None or known is not None:
        return known
    if not (own_family and isinstance(family, str) and family.strip()):
        raise sage_package.SageUnavailable(
            f"unknown family {family!r} (known: {', '.join(fitness.FAMILY_NAMES)}): name one of them, or "
            "install(family=..., own_family=True) for a family of your own")
    return family


def _load_profile(profile):
    if profile is None:
        return None
    from sage_qual.verdicts.profile import ProfileError, load

    try:
        return load(profile)
    except ProfileError as error:
        raise sage_package.SageUnavailable(str(error)) from None


def _device_configs(cuda, packages: Packages, config: WrapperConfig, profile, family: str | None,
                    builtin: bool):
    """Each device's config and note: the built-in defaults (when `builtin`) or `config`, then the
    profile's entry where one matches; one WARNING when the profile describes a GPU not, or when the
    built-in defaults were measured with another sageattention build."""
    from sage_qual.serving import defaults
    from sage_qual.serving.devices_here import machines
    from sage_qual.serving.profile_matching import DeviceConfig, device_configs
    from sage_qual.verdicts.profile import ProfileError

    package = _primary(packages)
    here = machines(cuda, package.version, package.source, sage_package.other_builds(packages, package))
    try:
        bases = (defaults.device_configs(here, family, config) if builtin
                 else [DeviceConfig(config, "")] * len(here))
        chosen = (
            bases if profile is None else device_configs(profile, here, family, [b.config for b in bases])
        )
    except ProfileError as error:
        raise sage_package.SageUnavailable(str(error)) from None
    return chosen


def _primary(packages: Packages) -> sage_package.SagePackage:
    """The package install_status() names and a profile's build is matched with: thu-ml's where it
    loads, else the first provider's that does."""
    thu_ml = packages[THU_ML.name]
    return loaded(packages)[0] if isinstance(thu_ml, str) else thu_ml


def _probe(config: WrapperConfig, profile=None, family: str | None = None,
           builtin: bool = False) -> tuple[dict[int, DeviceState], Packages]:
    """Each device's state, with its own config and note from the built-in defaults and the profile."""
    cuda = platform.current()
    if cuda.is_rocm():
        raise sage_package.SageUnavailable("this is a ROCm build of torch; SageAttention runs on NVIDIA "
                                           "CUDA GPUs only")
    count = cuda.device_count()
    if count == 0:
        raise sage_package.SageUnavailable("no CUDA GPU is visible (CPU-only torch build, no driver, or "
                                           "CUDA_VISIBLE_DEVICES empty): install a CUDA build of torch")
    capabilities = {i: cuda.capability(i) for i in range(count)}
    if all(cap < (8, 0) for cap in capabilities.values()):
        found = ", ".join("cuda:%d %s" % (i, capability_label(cap)) for i, cap in capabilities.items())
        raise sage_package.SageUnavailable(f"no GPU of compute capability 8.0 or newer ({found}); "
                                           "SageAttention 2 needs Ampere or newer")
    packages = sage_package.load_all()
    if not loaded(packages):
        raise sage_package.SageUnavailable(packages[THU_ML.name])
    per_device = _device_configs(cuda, packages, config, profile, family, builtin)
    devices = {}
    for index, capability in capabilities.items():
        own = per_device[index]
        gpu = assess(index, box_facts(cuda, index, packages), packages, own.config)
        variant, reason = gpu.kernel, gpu.no_kernel_reason
        if own.note and not variant and own.config.kernel_table.get(capability) == ():
            reason = own.note  # the profile or the built-in defaults keep it off: say why
        name = cuda.device_name(index)
        devices[index] = DeviceState(index, name, capability, variant, reason, config=own.config,
                                     profile_note=own.note, profile_reasons=own.reasons,
                                     profile_matched=own.matched,
                                     retired=audit.retired_before(index, name, family))
    if not any(d.variant for d in devices.values()):
        first, *others = devices.values()
        more = f" and {len(others)} more GPUs (install_status().devices)" if others else ""
        raise _NoKernel(one_line(f"{first.label}{more}: {first.no_kernel_reason}"),
                        tuple(devices.values()))
    if all(d.retired for d in devices.values() if d.variant):  # as its WARNING said: not served again
        first = next(d for d in devices.values() if d.variant)
        why = f"{first.label} was retired by this process until it restarts: {first.retired}"
        raise _NoKernel(one_line(why), tuple(devices.values()))
    return devices, packages


def _make_sdpa(state: _Installed):
    """The function torch gets. Outside a scope it is one ContextVar read away from torch's own
    (the benchmark in tests_fast/serving/test_overhead_benchmarks.py measures what that costs). While
    torch.compile traces it, it emits one opaque operator whose body runs `_serve_compiled`."""
    from sage_qual.serving import compiled

    original, active, compiling = state.original, _active.get, torch.compiler.is_compiling
    compiled.serve = _serve_compiled
    graph_safe = frozenset(i for i, d in state.devices.items() if d.variant and CAPTURE in d.safe_contexts)

    def scaled_dot_product_attention(*args, **kwargs):
        if compiling():  # before the ContextVar, which Dynamo cannot trace
            return compiled.traced_call(original, graph_safe, *args, **kwargs)
        report = active()
        if report is None or _installed is not state:  # no scope, or uninstalled while kept
            return original(*args, **kwargs)
        return _serve(state, report, args, kwargs)

    scaled_dot_product_attention.__doc__ = "SageAttention-aware SDPA (installed by sage_qual.install())."
    return scaled_dot_product_attention


def _serve_compiled(*args, **kwargs):
    """The body of the compiled operator: the thread's scope as the compiled code runs, the
    `compile` context; outside a scope what the wrapper wraps (torch's function, or a function bound
    under it), and torch's own once uninstalled."""
    state, report = _installed, _active.get()
    if state is None:
        return torch_sdpa.TORCH_SDPA(*args, **kwargs)
    if report is None:
        return state.original(*args, **kwargs)
    return _serve(state, report, args, kwargs, compiled=True)


def _serve(state: _Installed, report: ScopeReport, args: tuple, kwargs: dict, compiled: bool = False):
    original = state.original
    call, bad_arguments = bind(args, kwargs)
    if bad_arguments:
        report.fell_back("arguments", "%s", (bad_arguments,))
        return original(*args, **kwargs)
    cuda = platform.current()
    if state.one_config:  # every GPU has the same rules: the query's GPU is read only if they pass
        index = device = None
        config = state.config
    else:  # a profile gave GPUs their own rules: read the query's GPU once, for both checks
        index = cuda.tensor_device(call.query) if isinstance(call.query, torch.Tensor) else None
        device = state.devices.get(index)
        config = state.config if device is None else device.config
    refused = refusal(call, config, cuda)
    copy = False  # serve from contiguous copies of the tensors past the span limit
    if refused is not None and refused[0] == "span" and config.copy_past_span and \
            copies_fit(call, config.max_span_elements):
        refused, copy = None, True
    if refused is None:
        device = _device_refusal(state, call, cuda, index, device)
        refused = ("device", "%s", (device,)) if isinstance(device, str) else None
    if refused is None and call.attn_mask is not None and not device.variant.takes_mask:
        refused = ("mask", "attn_mask given (%s takes none)", (device.variant.name,))
    if refused is None:
        context = cuda.stream_contexts(device.index) + ((COMPILE,) if compiled else ())
        refused = _context_refusal(device, context) if context else None
    if refused is None and report.out_of_memory:
        refused = ("memory", "this scope ran out of memory", ())
    if refused is not None:
        report.fell_back(*refused)
        return original(*args, **kwargs)

    failed = False
    kernel = state.kernels[device.index]

    def run():  # the copies are made here: out of memory for them is handled as for the kernel's own
        given = within_span(call, config.max_span_elements) if copy else call
        out = kernel(given.query, given.key, given.value, sm_scale=call.sm_scale, attn_mask=call.attn_mask)
        return out if call.attn_mask is None else out.masked_fill_(rows_without_keys(call.attn_mask), 0)

    with cuda.device_guard(device.index):
        try:
            out = cuda.launch(device.index, context, device.legacy_stream, run)
            # Checked once per context too: a process whose first call ran on the default stream still
            # checks its first side-stream call. Never under capture, where reading a value is illegal.
            check_key = (call.query.dtype, call.query.shape[-1], context)
            if CAPTURE not in context and check_key not in device.checked:
                problem = _first_call_problem(state, device, call, out)
                if problem:
                    why = f"first-call check failed for {_describe(call, context)}: {problem}"
                    _retire(state, device, why)
                    report.fell_back("kernel_error", "%s", (why,))
                    failed = True
                else:
                    with state.lock:
                        device.checked.add(check_key)
        except Exception as error:
            _record_failure(state, report, device, call, error)
            failed = True
    if failed:
        # Torch runs only now, outside the except block: the exception's traceback keeps the kernel's
        # frames alive, and with them its quantized copies; an out-of-memory fallback inside the
        # block runs out of memory too (H200, docs/results/README.md, "Out-of-memory fallback").
        out = None
        return original(*args, **kwargs)
    state.auditor.served(cuda, report.audit, device, call, out, context, _describe(call, context))
    device.cache_errors = 0
    report.calls += 1
    report.served += 1
    report.copied += copy
    if not device.announced:
        device.announced = True
        package = state.packages[device.variant.provider]
        log.info("%s %s serves attention on %s with %s (variant %s)", PROVIDERS[package.provider].title,
                 package.version, device.label, device.variant.function, device.variant.name)
    return out


def _device_refusal(state: _Installed, call: SdpaCall, cuda, index: int | None,
                    device: DeviceState | None) -> DeviceState | str:
    """The query's device when the call may run there, else why not (`index` and `device`: the
    query's GPU and its state when the caller read them already)."""
    if device is None:
        index = cuda.tensor_device(call.query)
        device = state.devices.get(index)
    if index is None or cuda.tensor_device(call.key) != index or cuda.tensor_device(call.value) != index:
        return "tensors not all on one CUDA device"
    if device is None or device.variant is None:
        return "no SageAttention kernel for this GPU"
    if device.retired:
        return f"{device.label} retired: {device.retired}"
    return device


def _first_call_problem(state: _Installed, device: DeviceState, call: SdpaCall, out: torch.Tensor) -> str:
    """The audit's check on the first call's slice (`slice_check.first_call_slice`: sample 0, the first
    K/V group, the last `check_rows` query rows: a few MiB at most, so the checked call costs no more
    memory than later ones), both judges, read at once: '' when fit and on its model, else why not."""
    where = slice_check.first_call_slice(call.query.shape, call.key.shape[1], state.config.check_rows)
    norms = slice_check.measure(state.original, call, out, where, device.variant)
    bound = state.auditor.bound(device)
    return slice_check.judge(norms.tolist(), bound, call.query.dtype).problem()  # the one host read


def _record_failure(state, report, device, call, error) -> None:
    """Count, log and act on a kernel error; keeps no reference to it."""
    kind = classify(error)
    detail = f"{device.variant.function} on {_describe(call)}: {type(error).__name__}: {error}"
    if kind is Failure.OUT_OF_MEMORY:
        report.out_of_memory = True
        report.fell_back("memory", "%s", (detail,))
        log.info("SageAttention ran out of memory on %s (%s); the rest of this scope runs on PyTorch SDPA",
                 device.label, _describe(call))
    elif kind is Failure.CACHE:
        report.fell_back("cache_error", "%s", (detail,))
        with state.lock:
            device.cache_errors += 1
            streak = device.cache_errors
        if streak >= state.config.cache_error_limit:
            _retire(state, device, f"{streak} Triton cache failures in a row, last: {error}")
    else:
        report.fell_back("kernel_error", "%s", (detail,))
        _retire(state, device, f"raised: {detail}")


def _retire(state: _Installed, device: DeviceState, why: str, family: str | None = None) -> None:
    """Move `device` to torch for `family` (None: every family) until the process restarts: a later
    install() for that family keeps it there (`audit.retired_before`), as the WARNING says."""
    with state.lock:
        if device.retired:
            return
        device.retired = why
    audit.remember_retired(device.index, device.name, family, why)
    log.warning("SageAttention retired on %s for %s until this process restarts, its attention runs on "
                "PyTorch SDPA: %s", device.label, family or "every family", why)


def _describe(call: SdpaCall, context: tuple[str, ...] = ()) -> str:
    shapes = " ".join(str(list(t.shape)) for t in (call.query, call.key, call.value))
    where = f" ({', '.join(context)})" if context else ""
    return f"q/k/v {shapes} {str(call.query.dtype).replace('torch.', '')}{where}"


_CONTEXT_WORDS = {SIDE_STREAM: "a side stream (torch's current stream is not the default stream)",
                  CAPTURE: "CUDA-graph capture", COMPILE: "code compiled by torch.compile"}


def _context_refusal(device: DeviceState, context: tuple[str, ...]):
    """The refusal for the first context of the call its variant is not safe in, else None."""
    for name in context:
        if name not in device.safe_contexts:
            return (REASON[name], "%s: %s is not certified safe there (safe in: %s)",
                    (_CONTEXT_WORDS[name], device.variant.name, ", ".join(device.safe_contexts) or "none"))
    return None
