"""Each variant in each execution context: is its output bit-identical to the same call made eagerly
on the default stream?

Four checks (`contexts.CHECKS`), each the served call of `sage_qual.install()` with the variant forced:
- `side_stream`: q, k and v are made on a side stream kept busy by matmuls, and the call runs there;
- `capture`: the call is captured into a CUDA graph on inputs of other values, new values are copied
  into the captured inputs and the graph is replayed;
- `compile`: `torch.compile` in the default mode, three calls on three sets of values;
- `compile_reduce_overhead`: the same with `mode="reduce-overhead"` (its third call is the first
  replay of Inductor's CUDA graph).
A context is safe for the variant when every check of it passed (`report_model.safe_contexts`). The
stream checks run with every context trusted, so what is measured is the kernel, not a fallback;
the compile checks run with the contexts the stream checks certified, as the profile then configures
the wrapper (a variant not capture-safe is kept out of Inductor's CUDA graphs).

`through="kernel"` runs the two stream checks on the kernel function itself, without the wrapper:
upstream's behaviour, which the GPU test records next to the wrapper's (tests_gpu/test_contexts_gpu.py).

Where the checks run is a place: `Gpu` (CUDA streams, graphs, Inductor) or, in the fast tests'
workers, `FakePlace` (`sage_qual.testing.FakeCuda`'s stream and capture states; TorchDynamo with
the aot_eager backend; no reduce-overhead on a CPU, so that check runs as the default mode there).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from sage_qual import limits
from sage_qual.kernels.contexts import COMPILE, CONTEXTS
from sage_qual.qualification.evidence.report_model import ContextRun, safe_contexts
from sage_qual.qualification.measure import accuracy

BUSY_MATMULS = 8  # 8192^2 bf16 matmuls queued before the inputs: milliseconds of the side stream
COMPILE_CALLS = 3  # the third call of reduce-overhead is the first replay of its CUDA graph


class Gpu:
    device = "cuda"

    def side_stream(self, call, q, k, v):
        """`call` on copies of q, k, v made on a busy side stream, run there."""
        busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(BUSY_MATMULS):
                busy = busy @ busy * 1e-4
            out = call(*(t.clone() for t in (q, k, v)))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return out

    def captured(self, call, q, k, v):
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

    def compiled(self, counter, inputs, mode):
        fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), mode=mode)
        outs = [counter(fn, *values).clone() for values in inputs]  # a graph's output is overwritten
        torch.cuda.synchronize()
        return outs

    def kernel_shape(self, shape):
        return tuple(shape)


class FakePlace:
    """The fake GPU of the fast tests (`sage_qual.testing.FakeCuda` must be the platform)."""
    device = "cpu"

    def __init__(self, shape=(1, 2, 64, 64)):
        self.shape = shape

    @staticmethod
    def _cuda():
        from sage_qual.serving import platform

        return platform.current()

    def side_stream(self, call, q, k, v):
        with self._cuda().side_stream():
            return call(*(t.clone() for t in (q, k, v)))

    def captured(self, call, q, k, v):
        """A replay recomputes what was recorded: a fake capture run on the new values (a legacy
        kernel's output there is what nothing wrote, as a replay of an empty graph)."""
        with self._cuda().capture():
            return call(*(t.clone() for t in (q, k, v)))

    def compiled(self, counter, inputs, mode):
        fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend="aot_eager")
        return [counter(fn, *values).clone() for values in inputs]

    def kernel_shape(self, shape):
        return self.shape


def _compare(outs, expected, torch_outs) -> dict:
    """Every output against the eager one (bit for bit, and `accuracy.errors`' worst relative L2 and
    element error, null where not finite) and torch's (relative L2)."""
    found = [accuracy.errors(o, e) for o, e in zip(outs, expected, strict=True)]
    against_torch = [accuracy.errors(o, t).rel_l2 for o, t in zip(outs, torch_outs, strict=True)]
    return {"bit_identical": all(torch.equal(o, e) for o, e in zip(outs, expected, strict=True)),
            "finite": all(f.finite for f in found),
            "max_abs_diff": _finite_or_none(max(f.max_abs_error for f in found)),
            "rel_l2": _finite_or_none(max(f.rel_l2 for f in found)),
            "torch_rel_l2": _finite_or_none(max(against_torch))}


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None  # NaN and inf as null


class _Served:
    """Calls as the wrapper serves them (a scope around torch's SDPA), counting served calls."""

    def __init__(self):
        self.calls = self.served = 0
        self.fallbacks: dict[str, int] = {}

    def __call__(self, fn, *args):
        import sage_qual

        with sage_qual.sage_attention_scope() as report:
            out = fn(*args)
        self.calls += report.calls
        self.served += report.served
        for reason, count in report.fallbacks.items():
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + count
        return out


class _Direct(_Served):
    """A kernel called without the wrapper: every call counts as served (nothing can fall back)."""

    def __call__(self, fn, *args, **kwargs):
        self.calls += 1
        self.served += 1
        return fn(*args, **kwargs)


def _run(name: str, counter: _Served, measure) -> ContextRun:
    """`measure()` gives (outputs, the eager outputs, torch's outputs) on the same values."""
    try:
        outs, expected, torch_outs = measure()
    except Exception as error:  # a context the kernel cannot run in: recorded, never raised
        first = (str(error).strip().splitlines() or [""])[0]
        return ContextRun(name, counter.calls, counter.served, False, False,
                          fallbacks=dict(counter.fallbacks), error=f"{type(error).__name__}: {first}"[:500])
    return ContextRun(name, counter.calls, counter.served, fallbacks=dict(counter.fallbacks),
                      **_compare(outs, expected, torch_outs))


def _install(variant, contexts) -> None:
    import sage_qual
    from sage_qual.serving import audit, platform
    from sage_qual.serving.config import WrapperConfig

    sage_qual.uninstall()
    audit.RETIRED.clear()  # a trial of its own (within check_variant's set-aside): no earlier one holds
    capability = platform.current().capability(0)
    status = sage_qual.install(config=WrapperConfig(min_query_tokens=1, min_key_tokens=1,
                                                    kernel_table={capability: (variant.name,)},
                                                    contexts=contexts))
    if not status.enabled:
        raise RuntimeError(f"install() with {variant.name} forced: {status.reason}")


def _values(place, shape, dtype, seed: int):
    generator = torch.Generator(place.device).manual_seed(seed)
    return tuple(torch.randn(shape, device=place.device, dtype=dtype, generator=generator) for _ in range(3))


def check_variant(variant, place=None, shape=limits.CONTEXT_CHECK_SHAPE, dtype=torch.bfloat16, seed: int = 0,
                  through: str = "wrapper", contexts: tuple[str, ...] | None = CONTEXTS) -> list[ContextRun]:
    """Every check of `variant` (a `variants.Variant` this GPU runs) at `place` (default: the GPU).
    `contexts`: what the wrapper trusts during the stream checks (default: all, to measure the
    kernel; None: the built-in rule). The compile checks then run with the contexts the stream
    checks certified, plus compile (with None: the built-in rule again). The wrapper is installed
    afresh for each check, so a check that retires the GPU does not decide the next."""
    import sage_qual
    from sage_qual.serving.torch_sdpa import TORCH_SDPA

    place = place or Gpu()
    shape = place.kernel_shape(shape)
    inputs = [_values(place, shape, dtype, seed + n) for n in range(COMPILE_CALLS)]
    torch_outs = [TORCH_SDPA(*values) for values in inputs]  # also warms torch's SDPA up before a capture
    q, k, v = inputs[0]
    stream_checks = (("side_stream", place.side_stream), ("capture", place.captured))
    if through == "kernel":
        from sage_qual.kernels import sage_package
        from sage_qual.kernels.providers import PROVIDERS

        package = sage_package.load(PROVIDERS[variant.provider])
        kernel = functools.partial(variant.invoke, package.kernel(variant))
        keywords = {"sm_scale": shape[-1] ** -0.5}
        expected = kernel(q, k, v, **keywords)
        runs = []
        for name, context in stream_checks:
            counter = _Direct()
            runs.append(_run(name, counter, lambda context=context, counter=counter: (
                [context(lambda *t: counter(kernel, *t, **keywords), q, k, v)], [expected], torch_outs[:1])))
        return runs

    from sage_qual.serving import audit

    set_aside = audit.retirements_set_aside()  # what the process had retired holds again after the checks
    set_aside.__enter__()
    try:
        _install(variant, contexts)
        eager = _Served()
        expected = [eager(F.scaled_dot_product_attention, *values) for values in inputs]
        if eager.served != len(inputs):
            raise RuntimeError(f"{variant.name}: the eager calls were not all served ({eager.fallbacks})")
        runs = []
        for name, context in stream_checks:
            _install(variant, contexts)
            counter = _Served()
            runs.append(_run(name, counter, lambda context=context, counter=counter: (
                [context(lambda *t: counter(F.scaled_dot_product_attention, *t), q, k, v)], expected[:1],
                torch_outs[:1])))
        if contexts is not None:
            contexts = tuple(c for c in safe_contexts(runs) if c != COMPILE and c in contexts) + (COMPILE,)
        for name, mode in (("compile", None), ("compile_reduce_overhead", "reduce-overhead")):
            _install(variant, contexts)
            torch._dynamo.reset()
            counter = _Served()
            runs.append(_run(name, counter, lambda mode=mode, counter=counter: (
                place.compiled(counter, inputs, mode), expected, torch_outs)))
    finally:
        torch._dynamo.reset()
        sage_qual.uninstall()
        set_aside.__exit__(None, None, None)
    return runs
