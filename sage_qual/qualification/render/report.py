"""report.md and report.html of a certify report: its evidence (`report_model`) and the verdicts
the caller drew from it (`verdict.decide()`), as blocks turned into Markdown or HTML, with plots.
"""

from __future__ import annotations

import base64
import html
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sage_qual.kernels.contexts import CHECKS
from sage_qual.kernels.variants import VARIANTS, capability_label, gpu_label
from sage_qual.qualification.decide import verdict
from sage_qual.qualification.decide.checked import status_line
from sage_qual.qualification.evidence import report_model
from sage_qual.qualification.evidence.report_model import Report
from sage_qual.qualification.render import plots
from sage_qual.qualification.render.markdown import markdown_table, safe_text
from sage_qual.verdicts import fitness

if TYPE_CHECKING:  # selection reads fixtures with torch; rendering imports neither
    from sage_qual.qualification.selection import LeftOut

# Rendering -------------------------------------------------------------------------------------
# A report is rendered as a list of blocks, each turned into Markdown or HTML. Every block is built
# from the typed record (`parse` or `load`), never from report.json's dict, so what renders is what
# the checks passed.

@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Paragraph:
    text: str  # Markdown: `code` spans become <code> in HTML


@dataclass(frozen=True)
class Preformatted:
    text: str


@dataclass(frozen=True)
class Table:
    headers: list[str]
    rows: list[list]


@dataclass(frozen=True)
class Image:
    file: str  # next to report.md
    alt: str


Block = Heading | Paragraph | Preformatted | Table | Image


def render(data: Report, out_dir: Path, decisions: list[verdict.GpuDecision],
           left_out: Sequence[LeftOut] = ()) -> list[Path]:
    """Write report.md, report.html and the plots for the report `data` (from `checked.parse` or
    `checked.load`) and its `decisions` (`verdict.decide(data)`) into `out_dir`; a --quick run's
    report names what the run's selection left out (`left_out`). Reads nothing; returns the files."""
    out_dir = Path(out_dir)
    images = plots.plots(data, decisions, out_dir)
    blocks = _blocks(data, decisions, images, left_out)
    (out_dir / "report.md").write_text(safe_text(_markdown(blocks)), encoding="utf-8")
    (out_dir / "report.html").write_text(safe_text(_html(blocks, out_dir, data)), encoding="utf-8")
    return [out_dir / "report.md", out_dir / "report.html"] + [out_dir / name for name in images.values()]


def _number(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def _status(data: Report) -> str:
    return status_line(data.complete, data.started, data.finished, data.stopped)


def _uses(uses: list[report_model.ShapeUse]) -> str:
    """The family calls and sweep points a shape stands for, as the tables show them."""
    return "; ".join((u.family + " " if u.family else "") + u.label for u in uses)


def _reasons(record: report_model.Cell | report_model.LongCheck) -> str:
    """The reasons a cell or long check failed, else its detail (why it did not run)."""
    return "; ".join(r.detail for r in record.reasons) or record.detail


def _blocks(data: Report, decisions: list[verdict.GpuDecision], images: dict,
            left_out: Sequence[LeftOut]) -> list[Block]:
    predicted = "PREDICTED " if data.predicted else ""
    blocks = [Heading(1, f"{predicted}SageAttention certification, {data.host}"), Paragraph(_status(data)),
              Paragraph(f"Command: `{data.command}`")]
    if predicted:
        blocks.append(Paragraph("PREDICTED: every cell below was computed by the CPU numerics model of its "
                                "variant (certify --emulate); no GPU ran and nothing here was measured. "
                                "`sage-qual gate` refuses this report: certify on the GPU to enable a "
                                "family."))
    if data.target:
        blocks.append(Paragraph(f"Target: `{data.target}` (certify --target): this integration stands "
                                "where a variant stands in every table below."))
    from sage_qual.serving import environment  # imports torch: only where a report is rendered

    blocks += [Heading(2, "Environment"), Preformatted(environment.render_text(data.environment))]
    blocks += [Heading(2, "Fixtures"), Table(["fixture", "family", "kind", "q", "k/v", "dtype", "sha256"],
               [[f.name + (" (masked)" if f.masked else ""), f.family, f.kind.value, "x".join(map(str, f.q)),
                 "x".join(map(str, f.k)), f.dtype.value, f.sha256] for f in data.fixtures])]
    blocks += _fitness_blocks(data)
    if any(f.masked for f in data.fixtures):
        blocks.append(
            Paragraph(
                "A masked fixture is a call with an attn_mask: only the variants that take a mask "
                "run it, and it decides whether masked calls are served, not the family."
            )
        )
    if any(f.kind == report_model.FixtureKind.REPLICA for f in data.fixtures):
        blocks.append(Paragraph("Fixtures of kind 'replica' are generated to reproduce published statistics, "
                                "not recorded from a model: every verdict below rests on them as such."))
    if data.options.quick:
        blocks += _left_out_blocks(left_out)
    for gpu in decisions:
        blocks += _predicted_blocks(gpu) if predicted else _gpu_blocks(gpu, images)
    for device in data.devices:
        blocks += _device_blocks(data, device, images)
    return blocks


def _fitness_blocks(data: Report) -> list[Block]:
    """Each fixture's fitness bound per accuracy class, with its source: what the second judge holds
    every output to, beside the budget its numerics model derives."""
    rows = []
    for f in data.fixtures:
        bounds = {
            name.value: fitness.bound_for(f.name, f.kind.value, name.value, bound)
            for name, bound in f.bounds.items()
        }
        numbers = "; ".join(
            f"{name} {b.max_rel_l2:g}" + (f" / {b.min_cosine:g}" if b.min_cosine is not None else "")
            for name, b in sorted(bounds.items())
        )
        first = next(iter(bounds.values()))
        unread = f" Cosine not read: {first.unread}." if first.unread else ""
        rows.append([f.name, numbers, first.source + unread])
    return [Heading(3, "Fitness bounds"),
            Paragraph("A cell passes only when it conforms to its numerics model (its budget) and is fit for "
                      "the family: within the fixture's bound below for its accuracy class (relative L2 / "
                      "worst head cosine). A failure says which judge: 'off its model' (kind accuracy) or "
                      "'unfit for the family' (kind unfit)."),
            Table(["fixture", "bound per class (relative L2 / cosine)", "source"], rows)]


def _left_out_blocks(left_out: Sequence[LeftOut]) -> list[Block]:
    rows = [[f.fixture, f.family, "; ".join(f.failures)] for f in left_out]
    text = ("A --quick run: the smallest fixture of each family and every fixture a committed GPU report "
            "saw fail (its known failures run). The verdicts below say nothing about the fixtures it left "
            "out, listed here, so a family can pass here and fail the full run. `sage-qual gate` refuses "
            "this report.")
    blocks = [Heading(2, "Left out by --quick"), Paragraph(text)]
    if rows:
        blocks.append(Table(["fixture", "family", "known failures (the committed H200 reports)"], rows))
    return blocks
def _predicted_blocks(gpu: verdict.GpuDecision) -> list[Block]:
    """A predicted report's verdicts: per family, whether each variant would pass every fixture (a GPU
    runs the variant its compute capability defaults to, named beside it), as the terminal says, and
    why each failing variant would fail; speed was not timed, so nothing here speaks of speed."""
    variants = list(gpu.variants)
    header = (
        ["family"]
        + [
            f"{name} ({', '.join(map(capability_label, VARIANTS[name].native_on)) or 'no GPU default'})"
            if name in VARIANTS
            else name
            for name in variants
        ]
        + ["why not"]
    )
    rows = []
    for v in gpu.families + [gpu.default]:
        if {r.kind for r in v.reasons} == {report_model.ReasonKind.NO_FIXTURES}:
            cells = ["not predicted: no fixture of the family ran"] * len(variants)
        else:
            cells = ["would pass" if v.evidence(name) == verdict.Evidence.SAFE else "would fail"
                     for name in variants]
        why = "; ".join(f"{f.variant} on {f.fixture}: {f.reason.detail}"
                        for found in v.results.findings.values() for f in found)
        rows.append([v.family or "(default: all fixtures)", *cells, why or "-"])
    return [Heading(2, "Predicted accuracy verdicts"),
            Paragraph("From the numerics model's cells below, accuracy only, per variant: a GPU runs the "
                      "variant its compute capability defaults to (in brackets), so a family would pass "
                      "there only where that variant would. Speed: not timed (no GPU ran), so no variant is "
                      "enabled and no break-even exists: certify on the GPU for those."),
            Paragraph(PREDICTION_SCOPE),
            Table(header, rows)]


# What the verdict table of a predicted report states beside its verdicts (issue 26): a predicted
# cell's budget is its own prediction plus the margin, so only these can fail it.
PREDICTION_SCOPE = (
    "What a prediction can find: an output of the modelled arithmetic that is not finite (an fp16 "
    "accumulator overflowing, a zero V channel under FP8), an error of the modelled arithmetic that is "
    "unfit for the family (past the fixture's fitness bound), and a hazard the model names (memory it "
    "cannot see: such a cell is predicted to fail). What it cannot find: an error beyond the model's "
    "arithmetic, since a cell's budget is the model's own error plus 10 %, so a finite prediction conforms "
    "to it; a kernel or build defect; memory, speed, and side-stream, capture or compile behaviour.")


def verdict_rows(gpu: verdict.GpuDecision) -> list[list[str]]:
    """The verdict table of one GPU model, as report.md and report.html show it."""
    return [
        [
            v.family or "(default: all fixtures)",
            v.verdict.value,
            v.variant or "-",
            v.served.text() if v.served else "-",
            ", ".join(f"{k} {x:.2f}x" for k, x in v.speedups.items()) or "-",
            "; ".join(r.detail for r in v.reasons + v.range_reasons) or "-",
        ]
        for v in gpu.families + [gpu.default]
    ]


def _gpu_blocks(gpu: verdict.GpuDecision, images: dict) -> list[Block]:
    devices = ", ".join(f"cuda:{i}" for i in gpu.devices)
    variants = []
    for name, v in gpu.variants.items():
        even = v.break_even
        runs = ("not run" if not v.ran and not v.reasons else
                "yes" if v.runnable else "no: " + "; ".join(v.reasons))
        served = "-" if even is None else (f"{even.min_query_tokens} / {even.min_key_tokens}, head_dim "
                                           f"{'/'.join(map(str, even.head_dims))}")
        shapes = f"{even.served_shapes} / {even.measured_shapes}" if even else "-"
        variants.append([name, runs, served, shapes])
    blocks = [Heading(2, f"{gpu.model}, {devices}"),
              Heading(3, "Verdicts"),
              Paragraph("enable: a variant passed every fixture and its measured speed serves some of the "
                        "family's shapes; safe, no speedup: it passed, but its measured speed serves none of "
                        "them (a profile serves nothing); keep off: no variant passed. Speedups are the "
                        "lower end of a 95 % confidence interval. An enabled family is served from its "
                        "break-even up to the longest call its long checks verified, in the layouts whose "
                        "views gave the contiguous output bit for bit."),
              Table(["family", "verdict", "variant", "served (verified range and layouts)",
                     "speedup at its shapes", "reasons"], verdict_rows(gpu)),
              Heading(3, "Break-even per variant"),
              Paragraph("The head sizes and the query and key lengths from which each variant measured "
                        "faster than the fastest SDPA backend (lower 95 % bound) at every measured shape; "
                        "'-' where it never was (or does not run here)."),
              Table(["variant", "runs here", "served from (query / key tokens)",
                     "shapes served / measured"], variants)]
    if gpu.name in images:
        blocks.append(Image(images[gpu.name], "speedup against the fastest SDPA backend"))
    return blocks


def _cell_row(c: report_model.Cell) -> list:
    accuracy = ["-", "-"]
    if c.budget and c.metrics:
        accuracy = [f"{_number(c.metrics.rel_l2)} (<= {_number(c.budget.max_rel_l2)})",
                    f"{_number(c.metrics.worst_head_cosine, 4)} (>= {_number(c.budget.min_cosine, 4)})"]
    smooth = c.smooth_k_on
    return [c.variant, c.fixture, c.outcome.value, *accuracy, _number(c.error_vs_sdpa),
            _number(c.extra_bytes_per_element),
            f"{_number(smooth.rel_l2)} / {_number(smooth.worst_head_cosine, 4)}" if smooth else "-",
            _reasons(c)]


def _device_blocks(data: Report, device: report_model.Device, images: dict) -> list[Block]:
    predicted = data.predicted
    blocks = [Heading(2, "Predicted by the numerics model (CPU)" if predicted else
                      "cuda:%d %s" % (device.index, gpu_label(device.name, device.capability)))]
    key = f"cuda:{device.index}"
    if key in images:
        alt = ("predicted relative L2 over the fixture's published bound" if predicted
               else "accuracy: relative L2 over its budget, per variant and fixture")
        blocks.append(Image(images[key], alt))
    blocks += [Heading(3, "Accuracy and memory per variant and fixture"),
               Paragraph("Against a float32 reference; 'x SDPA' is the error over that of PyTorch SDPA in "
                         "the input precision; memory is the extra peak in bytes per q/k/v element; "
                         "'smooth_k on' gives relative L2 / worst cosine with K smoothing on (outlier "
                         "fixtures; the wrapper runs it off)."),
               *_folded(["variant", "fixture", "outcome", "relative L2", "worst head cosine", "x SDPA",
                         "bytes/elem", "smooth_k on", "reasons"], [_cell_row(c) for c in device.cells])]
    headers, rows = _speed_table(data, device)
    blocks += [Heading(3, "Speed"), Table(headers, rows) if rows else
               Paragraph("Not timed" + (" (a predicted report: no GPU ran)." if predicted else "."))]
    if device.long:
        blocks += [Heading(3, "Long calls and layouts"),
                   Paragraph("Each variant at the families' longest calls and the sweep lengths past the "
                             f"fixtures, on {device.long[0].inputs or 'synthetic tensors'}: relative "
                             "L2 of sampled query rows against float32 (budget from the numerics model on "
                             "the same rows), and whether each layout's output equals the contiguous call's "
                             "bit for bit" + (ROWS_MOVED if any(c.rows_identical is not None
                                                                for c in device.long) else "") + "."),
                   *_folded(["variant", "call", "used by", "outcome", "relative L2", "layouts identical",
                             "reasons"], [_long_row(c) for c in device.long])]
    if device.span is not None:
        blocks += _span_blocks(device.span)
    if device.contexts is not None:
        blocks += _context_blocks(device.contexts)
    problems = [r for r in [*device.cells, *device.speed, *(device.long or []), *(device.span or []),
                            *(device.contexts or [])] if r.stderr_tail or r.traceback]
    if problems:
        blocks.append(Heading(3, "Crashes, hangs and errors"))
        for r in problems:
            blocks += [Paragraph(f"{_what_ran(r)}: {r.outcome.value}: {r.detail}"),
                       Preformatted((r.stderr_tail or r.traceback)[-2000:])]
    return blocks


# A reason this long, given by this many rows of one table, is said once under the table, and each of
# those rows points to it: a predicted report repeated one 95-character sentence in 96 rows (issue 43).
FOLD_CHARS, FOLD_ROWS = 40, 3


def _folded(headers: list[str], rows: list[list[str]]) -> list[Block]:
    """The table, its last column's repeated long reasons each replaced by "note N", and the notes."""
    counts = Counter(row[-1] for row in rows)
    notes = [text for text, n in counts.items() if n >= FOLD_ROWS and len(text) >= FOLD_CHARS]
    labels = {text: f"note {n}" for n, text in enumerate(notes, 1)}
    table = Table(headers, [row[:-1] + [labels.get(row[-1], row[-1])] for row in rows])
    return [table] + [Paragraph(f"{labels[text]} ({counts[text]} rows): {text}") for text in notes]


def _what_ran(r: report_model.Cell | report_model.Speed | report_model.LongCheck
              | report_model.SpanProbe | report_model.ContextCheck) -> str:
    """Which kernel ran on what, for the heading of a crash's stderr."""
    if isinstance(r, report_model.ContextCheck):
        return f"{r.variant} in every execution context (context check)"
    if isinstance(r, report_model.Cell):
        return f"{r.variant} on {r.fixture}"
    if isinstance(r, report_model.Speed):
        return f"{r.kernel} on {r.shape}"
    if isinstance(r, report_model.LongCheck):
        return f"{r.variant} on {r.shape.q_tokens} tokens, {r.shape.heads} heads (long check)"
    return f"{r.variant} on a span of {r.span:,} elements ({r.layout}, span probe)"


def _context_run(run: report_model.ContextRun | None) -> str:
    if run is None:
        return "-"
    if run.passed:
        return "identical"
    if run.error:
        return f"error: {run.error[:80]}"
    if run.served < run.calls:
        return f"served {run.served}/{run.calls}"
    return "not finite" if not run.finite else f"differs (rel L2 {_number(run.rel_l2)})"


def _context_blocks(checks: list[report_model.ContextCheck]) -> list[Block]:
    """Each variant in each execution context: identical to the eager default-stream call, or not."""
    rows = []
    for check in checks:
        runs = {run.name: run for run in check.runs}
        shape = "x".join(map(str, check.ran_shape or check.shape))
        checked = [_context_run(runs.get(name)) for name in CHECKS]
        rows.append([check.variant, shape, *checked, check.decided()])
    return [Heading(3, "Execution contexts"),
            Paragraph("Each variant served through the wrapper on a busy side stream, captured in a CUDA "
                      "graph and replayed on new values, and under torch.compile (default mode and "
                      "reduce-overhead); 'identical' means every output equals the same call made eagerly "
                      "on the default stream, bit for bit. The profile lets a variant serve only in the "
                      "contexts every check of which passed; elsewhere it falls back (reasons stream, "
                      "capture, compile)."),
            Table(["variant", "call", *CHECKS, "served"], rows)]


def _span_blocks(probes: list[report_model.SpanProbe]) -> list[Block]:
    """The span probes and, per variant, the largest span right in every layout."""
    from sage_qual.qualification.decide.profile import largest_safe

    safe = {v: largest_safe(probes, v) for v in dict.fromkeys(p.variant for p in probes)}
    said = "; ".join(f"{v}: {'none' if n is None else f'{n:,} elements'}" for v, n in safe.items())
    rows = [[p.variant, p.layout, f"{p.side} {p.limit:,}", f"{p.span:,}",
             f"{p.tokens:,} x {p.heads} heads x {p.head_dim}, {p.kv_tokens:,} keys"
             + (f" (ran {p.ran_tokens} tokens, {p.ran_heads} heads)" if p.ran_tokens else ""),
             p.outcome.value, _number(p.rel_l2), p.detail] for p in probes]
    return [Heading(3, "Span limits"),
            Paragraph("Each probed variant called directly on one long query near the kernels' 32-bit "
                      "element limit, contiguous and as a view into a fused QKV projection; right means "
                      "relative L2 of sampled rows against float32 under 0.15; a crash is a fault or an "
                      "abort, contained in its worker. Largest span right in every layout, with every "
                      f"smaller probe right: {said or 'none probed'}. The profile's max_span_elements takes "
                      "the smallest of these over the variants it serves, never above 2^31 - 1."),
            Table(["variant", "layout", "side of limit", "query span", "call", "outcome", "relative L2",
                   "detail"], rows)]


ROWS_MOVED = ("; 'rows moved': every row's output unchanged, bit for bit, with the query's 128-row blocks "
              "reversed")


def _long_row(c: report_model.LongCheck) -> list:
    shape = c.shape
    heads = shape.heads if shape.heads == shape.kv_heads else f"{shape.heads}/{shape.kv_heads}"
    call = (f"{shape.q_tokens:,} / {shape.kv_tokens:,} tokens, {heads} heads x {shape.head_dim} "
            f"{shape.dtype.value}")
    if c.ran_tokens or c.ran_heads:
        call += f" (ran {c.ran_tokens or shape.q_tokens} tokens, {c.ran_heads or heads} heads)"
    accuracy = "-"
    if c.budget and c.metrics:
        accuracy = f"{_number(c.metrics.rel_l2)} (<= {_number(c.budget.max_rel_l2)})"
    identical = ", ".join(f"{name} {'yes' if same else 'NO'}" for name, same in c.identical.items())
    if c.rows_identical is not None:
        moved = f"rows moved {'yes' if c.rows_identical else 'NO'}"
        identical = f"{moved}, {identical}" if identical else moved
    return [c.variant, call, _uses(c.uses), c.outcome.value, accuracy, identical or "-", _reasons(c)]


def _speed_table(data: Report, device: report_model.Device) -> tuple[list, list]:
    variants = [v for v in data.options.variants if v not in device.not_supported]
    by = {(r.kernel, r.shape): r for r in device.speed}
    rows = []
    for key, entry in data.shapes.items():
        sdpa = by.get(("sdpa", key))
        if sdpa is None:
            continue
        row = [key, _uses(entry.uses), f"{_number(sdpa.ms)} ms ({sdpa.best_backend or sdpa.outcome.value})"]
        for v in variants:
            r = by.get((v, key))
            if r is None:
                row.append("")
            elif r.ms and sdpa.ms:
                row.append(f"{r.ms:.3g} ms ({sdpa.ms / r.ms:.2f}x)")
            else:
                row.append(r.outcome.value)
        rows.append(row)
    return ["shape", "used by", "fastest SDPA"] + variants, rows


def _markdown(blocks: list[Block]) -> str:
    lines = []
    for block in blocks:
        if isinstance(block, Heading):  # a heading is one line, whatever a host name holds
            lines += ["#" * block.level + " " + " ".join(block.text.splitlines()), ""]
        elif isinstance(block, Paragraph):
            lines += [block.text, ""]
        elif isinstance(block, Preformatted):
            lines += ["```text", block.text.rstrip(), "```", ""]
        elif isinstance(block, Image):
            lines += [f"![{block.alt}]({block.file})", ""]
        else:
            lines += markdown_table(block.headers, block.rows) + [""]
    return "\n".join(lines)


def _inline_html(text: str) -> str:
    """Escaped text with Markdown's `code` spans as <code>, so the page shows no backticks."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _html(blocks: list[Block], out_dir: Path, data: Report) -> str:
    parts = []
    for block in blocks:
        if isinstance(block, Heading):
            parts.append(f"<h{block.level}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            parts.append(f"<p>{_inline_html(block.text)}</p>")
        elif isinstance(block, Preformatted):
            parts.append(f"<pre>{html.escape(block.text)}</pre>")
        elif isinstance(block, Image):  # embedded, so the page is one self-contained file
            encoded = base64.b64encode((out_dir / block.file).read_bytes()).decode()
            parts.append(f'<img alt="{html.escape(block.alt)}" src="data:image/png;base64,{encoded}">')
        else:
            head = "".join(f"<th>{html.escape(str(h))}</th>" for h in block.headers)
            body = "".join("<tr>" + "".join(f"<td>{_inline_html(str(x))}</td>" for x in row) + "</tr>"
                           for row in block.rows)
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    style = ("body{font-family:sans-serif;margin:2em;max-width:110em}"
             "table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #bbb;padding:.2em .5em;font-size:90%;text-align:left;vertical-align:top}"
             "pre{background:#f4f4f4;padding:1em;overflow:auto}img{max-width:100%}"
             ".partial{background:#fdd;padding:1em;font-weight:bold}")
    banner = "" if data.complete else f'<p class="partial">{html.escape(_status(data))}</p>'
    title = f"sage-qual report {html.escape(data.host)}"
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title><style>{style}</style>"
            f"</head><body>{banner}{''.join(parts)}</body></html>\n")


