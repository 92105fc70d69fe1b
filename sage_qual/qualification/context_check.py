"""Each variant in each execution context, on the GPU: is its output bit-identical to the same call
made eagerly on the default stream?

Four checks (`CHECKS`), each the served call of `sage_qual.install()` with the variant forced:
- `side_stream`: q, k and v are made on a side stream kept busy by matmuls, and the call runs there;
- `capture`: the call is captured into a CUDA graph on inputs of other values, new values are copied
  into the captured inputs and the graph is replayed;
- `compile`: `torch.compile` in the default mode, three calls on three sets of values;
- `compile_reduce_overhead`: the same with `mode="reduce-overhead"` (its third call is the first
  replay of Inductor's CUDA graph).
The checks of a context all pass, or the variant is not safe there (`safe_contexts`). The stream
checks run with every context trusted, so what is measured is the kernel, not a fallback; the
compile checks run with the contexts the stream checks certified, as a profile would configure
the wrapper (a variant not capture-safe is kept out of Inductor's CUDA graphs).

`through="kernel"` runs the two stream checks on the kernel function itself, without the wrapper:
upstream's behaviour, which the GPU test records next to the wrapper's (tests_gpu/test_contexts_gpu.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sage_qual.serving.contexts import CAPTURE, COMPILE, CONTEXTS, SIDE_STREAM

CHECKS = {"side_stream": SIDE_STREAM, "capture": CAPTURE, "compile": COMPILE,
          "compile_reduce_overhead": COMPILE}
# The shape of issue 24's measurement ([1, 24, 16384, 128] bf16): long enough that the quantizers on
# one stream and the kernel on the other overlap (NaN or 1.0 relative L2 on the H200).
SHAPE = (1, 24, 16384, 128)
BUSY_MATMULS = 8  # 8192^2 bf16 matmuls queued before the inputs, about 10 ms of an H200's side stream
COMPILE_CALLS = 3  # the third call of reduce-overhead is the first replay of its CUDA graph


@dataclass(frozen=True)
class ContextMeasurement:
    """One check of one variant: its outputs against the eager default-stream call on the same values."""
    check: str  # a key of CHECKS
    variant: str
    through: str  # "wrapper" or "kernel"
    calls: int = 0
    served: int = 0  # of `calls`, those SageAttention served (the wrapper's report)
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason: count, as the wrapper reported
    bit_identical: bool = False  # every call's output equal, bit for bit, to the eager call's
    max_abs_diff: float | None = None  # the largest element difference against the eager call
    rel_l2: float | None = None  # the largest relative L2 against the eager call
    finite: bool = True
    torch_rel_l2: float | None = None  # the largest relative L2 against torch's SDPA on the same values
    error: str = ""  # what raised, if something did

    @property
    def passed(self) -> bool:
        return not self.error and self.calls > 0 and self.served == self.calls and self.bit_identical


def safe_contexts(measurements: list[ContextMeasurement]) -> tuple[str, ...]:
    """The contexts every check of which passed (in `CONTEXTS` order)."""
    return tuple(context for context in CONTEXTS
                 if all(m.passed for m in measurements if CHECKS[m.check] == context)
                 and any(CHECKS[m.check] == context for m in measurements))


def _compare(outs, expected) -> dict:
    diffs = [(o.float() - e.float()) for o, e in zip(outs, expected, strict=True)]
    finite = all(bool(torch.isfinite(o).all()) for o in outs)
    max_abs = max(float(d.abs().nan_to_num(float("inf")).max()) for d in diffs)
    rel = max(float(torch.linalg.vector_norm(d) / torch.linalg.vector_norm(e.float()).clamp_min(1e-12))
              for d, e in zip(diffs, expected, strict=True))
    identical = all(torch.equal(o, e) for o, e in zip(outs, expected, strict=True))
    return {"bit_identical": identical, "max_abs_diff": max_abs, "rel_l2": rel, "finite": finite}


def _values(shape, dtype, seed: int):
    generator = torch.Generator("cuda").manual_seed(seed)
    return tuple(torch.randn(shape, device="cuda", dtype=dtype, generator=generator) for _ in range(3))


class _Served:
    """Calls as the wrapper serves them (a scope around torch's SDPA), counting served calls."""

    def __init__(self):
        import sage_qual

        self.sage_qual = sage_qual
        self.calls = self.served = 0
        self.fallbacks: dict[str, int] = {}

    def __call__(self, fn, *args):
        with self.sage_qual.sage_attention_scope() as report:
            out = fn(*args)
        self.calls += report.calls
        self.served += report.served
        for reason, count in report.fallbacks.items():
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + count
        return out


def _side_stream(call, q, k, v):
    """`call` on copies of q, k, v made on a busy side stream, run there."""
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(BUSY_MATMULS):
            busy = busy @ busy * 1e-4
        copies = tuple(t.clone() for t in (q, k, v))
        out = call(*copies)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return out


def _captured(call, q, k, v):
    """`call` captured on inputs of other values, replayed after q, k, v were copied into them."""
    static = tuple(torch.randn_like(t) for t in (q, k, v))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(*static)
    for target, source in zip(static, (q, k, v), strict=True):
        target.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    return out


def _compiled(call, inputs, mode):
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), mode=mode)
    outs = []
    for values in inputs:
        outs.append(call(fn, *values).clone())  # a CUDA-graph output is overwritten by the next replay
    torch.cuda.synchronize()
    return outs


def _measure(check: str, variant: str, through: str, make_counter, run) -> ContextMeasurement:
    """`run(counter)` gives (outputs, the eager outputs, torch's outputs) on the same values."""
    counter = make_counter()
    try:
        outs, expected, torch_outs = run(counter)
    except Exception as error:  # a context the kernel cannot run in: recorded, never raised
        return ContextMeasurement(check, variant, through, counter.calls, counter.served,
                                  dict(counter.fallbacks), error=f"{type(error).__name__}: {error}"[:500])
    against_torch = _compare(outs, torch_outs)
    return ContextMeasurement(check, variant, through, counter.calls, counter.served, dict(counter.fallbacks),
                              **_compare(outs, expected), torch_rel_l2=against_torch["rel_l2"])


def _install(variant, contexts):
    import sage_qual
    from sage_qual.serving.config import WrapperConfig

    sage_qual.uninstall()
    capability = torch.cuda.get_device_capability()
    status = sage_qual.install(config=WrapperConfig(min_query_tokens=1, min_key_tokens=1,
                                                    kernel_table={capability: (variant.name,)},
                                                    contexts=contexts))
    if not status.enabled:
        raise RuntimeError(f"install() with {variant.name} forced: {status.reason}")


def check_variant(variant, shape=SHAPE, dtype=torch.bfloat16, seed: int = 0,
                  through: str = "wrapper", contexts: tuple[str, ...] | None = CONTEXTS
                  ) -> list[ContextMeasurement]:
    """Every check of `variant` (a `variants.Variant` this GPU runs). `contexts`: what the wrapper
    trusts during the stream checks (default: all, to measure the kernel; None: the built-in rule).
    The compile checks then run with the contexts the stream checks certified, plus compile (with
    None: the built-in rule again). The wrapper is installed afresh for each check, so a check that
    retires the GPU does not decide the next."""
    import sage_qual
    from sage_qual.serving.torch_sdpa import TORCH_SDPA

    inputs = [_values(shape, dtype, seed + n) for n in range(COMPILE_CALLS)]
    torch_outs = [TORCH_SDPA(*values) for values in inputs]  # also warms torch's SDPA up before a capture
    q, k, v = inputs[0]
    if through == "kernel":
        from sage_qual.serving import sage_package

        kernel = sage_package.load().kernel(variant)
        keywords = {**variant.fixed_keywords(), "sm_scale": shape[-1] ** -0.5}

        def direct(*tensors):
            return kernel(*tensors, **keywords)

        expected = direct(q, k, v)
        checks = [("side_stream", lambda: _Counted(), lambda counted: _side_stream(counted.wrap(direct), q, k, v)),
                  ("capture", lambda: _Counted(), lambda counted: _captured(counted.wrap(direct), q, k, v))]
        return [_measure(check, variant.name, through, make,
                         lambda counted, call=call: ([call(counted)], [expected], torch_outs[:1]))
                for check, make, call in checks]

    def served(*tensors, counter):
        return counter(F.scaled_dot_product_attention, *tensors)

    try:
        _install(variant, contexts)
        eager = _Served()
        expected = [eager(F.scaled_dot_product_attention, *values) for values in inputs]
        if eager.served != len(inputs):
            raise RuntimeError(f"the eager calls were not all served ({eager.fallbacks})")
        results = []
        for check, context in (("side_stream", _side_stream), ("capture", _captured)):
            _install(variant, contexts)
            results.append(_measure(
                check, variant.name, through, _Served,
                lambda counter, context=context: ([context(lambda *t: served(*t, counter=counter), q, k, v)],
                                                  expected[:1], torch_outs[:1])))
        if contexts is not None:
            certified = tuple(c for c in safe_contexts(results) if c != COMPILE and c in contexts)
            contexts = certified + (COMPILE,)
        for check, mode in (("compile", None), ("compile_reduce_overhead", "reduce-overhead")):
            _install(variant, contexts)
            results.append(_measure(check, variant.name, through, _Served,
                                    lambda counter, mode=mode: (_compiled(counter, inputs, mode), expected,
                                                                torch_outs)))
    finally:
        torch._dynamo.reset()
        sage_qual.uninstall()
    return results


class _Counted:
    """A kernel called directly: every call counts as served (there is no wrapper to fall back)."""

    def __init__(self):
        self.calls = self.served = 0
        self.fallbacks: dict[str, int] = {}

    def wrap(self, fn):
        def counted(*args):
            self.calls += 1
            self.served += 1
            return fn(*args)
        return counted


def as_row(measurement: ContextMeasurement) -> dict:
    return {**dataclasses.asdict(measurement), "passed": measurement.passed}
