"""The report's plots: an accuracy heatmap per GPU and the speedup curves per GPU model (matplotlib;
none without it)."""

from __future__ import annotations

import math
from pathlib import Path

from sage_qual.qualification.decide import verdict
from sage_qual.qualification.evidence import report_model
from sage_qual.qualification.evidence.report_model import Report


# Plots -----------------------------------------------------------------------------------------
def plots(data: Report, decisions: list[verdict.GpuDecision], out_dir: Path) -> dict[str, str]:
    """Plot files by what they show ("cuda:N" heatmaps, GPU names for speedups); none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    images = {}
    published = None
    if data.predicted:  # its budget is the prediction plus a margin: the published bound says more
        published = {f.name: f.bounds for f in data.fixtures}
    for device in data.devices:
        if device.cells:
            name = (
                "accuracy-cpu.png" if data.predicted else f"accuracy-cuda{device.index}.png"
            )  # where it ran
            _heatmap(plt, device, out_dir / name, published)
            images[f"cuda:{device.index}"] = name
    for n, gpu in enumerate(decisions):
        name = f"speedup-{n}.png"
        if _speedup_plot(plt, data, gpu, out_dir / name):
            images[gpu.name] = name
    return images


# Heatmap geometry in inches: a row per variant, a column per fixture, and room for labels, title
# and colour bar, so a one-variant run (certify --quick) is not squashed into a strip.
ROW_INCHES, COLUMN_INCHES, MIN_HEIGHT_INCHES = 0.5, 1.1, 3.2


def heat_ratio(cell: report_model.Cell, published: dict | None = None) -> float | None:
    """What a heatmap cell shows: relative L2 over the cell's budget, or over the fixture's published
    bound for its class when `published` (fixture -> class -> limits) is given; None: no number."""
    limit = cell.budget
    if published is not None:
        limit = published.get(cell.fixture, {}).get(cell.accuracy_class)
    if cell.metrics is None or cell.metrics.rel_l2 is None or limit is None:
        return None
    return cell.metrics.rel_l2 / limit.max_rel_l2


def heat_cell(cell: report_model.Cell, published: dict | None = None) -> tuple[float, str]:
    """A heatmap cell: the log10 of its ratio (`heat_ratio`; NaN, the white of NO_NUMBER, where it has
    none) and its text. A non-finite output is past every bound: the scale's top (1), never white."""
    if cell.measured and cell.metrics is not None and cell.metrics.finite is False:
        return 1.0, f"{cell.outcome.value}\nnot finite"
    ratio = heat_ratio(cell, published)
    if ratio is None:
        return math.nan, cell.outcome.value
    return math.log10(max(ratio, 1e-2)), f"{cell.outcome.value}\n{ratio:.2f}"


NO_NUMBER = "#ffffff"  # the heatmap's colour for a cell that did not run (a non-finite one is the top colour)


def _heatmap(plt, device: report_model.Device, path: Path, published: dict | None = None) -> None:
    """Relative L2 over the cell's budget; with `published` (fixture -> class -> limits, for a
    predicted report) over the fixture's published bound instead."""
    import numpy as np

    variants = list(dict.fromkeys(c.variant for c in device.cells))
    fixtures = list(dict.fromkeys(c.fixture for c in device.cells))
    values = np.full((len(variants), len(fixtures)), np.nan)
    height = max(MIN_HEIGHT_INCHES, 2.2 + ROW_INCHES * len(variants))
    figure, axes = plt.subplots(figsize=(3 + COLUMN_INCHES * len(fixtures), height))
    # Sequential and colour-blind safe (cividis: dark blue = far within the bound, yellow = over it);
    # the outcome word is printed in every cell, so nothing rests on colour alone. A cell without a
    # number is white, a colour cividis never takes (its grey middle meant both, issue 43).
    colours = plt.get_cmap("cividis").with_extremes(bad=NO_NUMBER)
    for c in device.cells:
        i, j = variants.index(c.variant), fixtures.index(c.fixture)
        values[i, j], text = heat_cell(c, published)
        dark = not math.isnan(values[i, j]) and values[i, j] < -0.5
        axes.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    shown = axes.imshow(values, cmap=colours, vmin=-2, vmax=1, aspect="auto")
    axes.set_xticks(range(len(fixtures)), fixtures, rotation=40, ha="right", fontsize=8)
    axes.set_yticks(range(len(variants)), variants, fontsize=8)
    if published is not None:
        figure.colorbar(shown, ax=axes, label="log10(predicted rel. L2 / fitness bound)")
        axes.set_title("numerics model (CPU): predicted relative L2 / the fixture's fitness bound (> 1: "
                       "over it; top colour: not finite; white: did not run)", fontsize=9)
    else:
        figure.colorbar(shown, ax=axes, label="log10(rel. L2 / budget)")
        axes.set_title("cuda:%d %s: relative L2 / budget against float32 (> 1 fails; top colour: not "
                       "finite; white: did not run)" % (device.index, device.name), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _speedup_plot(plt, data: Report, gpu: verdict.GpuDecision, path: Path) -> bool:
    """Speedup over the fastest SDPA backend against tokens, generic self-attention, per head size:
    the median ratio, with a bar down to the lower 95 % bound the decisions use."""
    generic = {k: s.shape for k, s in data.shapes.items()
               if not any(u.family for u in s.uses) and s.shape.q_tokens == s.shape.kv_tokens}
    head_dims = sorted({s.head_dim for s in generic.values()}, reverse=True)
    if not head_dims:
        return False
    figure, axes = plt.subplots(1, len(head_dims), figsize=(6 * len(head_dims), 4.2), squeeze=False)
    for ax, head_dim in zip(axes[0], head_dims, strict=True):
        keys = sorted((k for k, s in generic.items() if s.head_dim == head_dim),
                      key=lambda k: generic[k].q_tokens)
        for variant in (v for v, info in gpu.variants.items() if info.runnable):
            points = [(generic[k].q_tokens, *gpu.speedups[(variant, k)]) for k in keys
                      if (variant, k) in gpu.speedups]
            if not points:
                continue
            tokens = [p[0] for p in points]
            medians = [p[2] for p in points]
            below = [max(0.0, p[2] - p[1]) for p in points]
            line = ax.errorbar(tokens, medians, yerr=[below, [0.0] * len(points)], marker="o", capsize=2,
                               label=variant).lines[0]
            even = gpu.variants[variant].break_even
            if even and head_dim in even.head_dims:
                ax.axvline(even.min_query_tokens, color=line.get_color(), linestyle=":", linewidth=1)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (self-attention, 24 heads)")
        ax.set_ylabel("speedup over the fastest SDPA backend")
        ax.set_title(f"{gpu.name}, head_dim {head_dim} (bars: to the lower 95 % bound; dotted: "
                     "break-even)", fontsize=9)
        if ax.get_legend_handles_labels()[0]:  # no variant timed at this head size: no legend
            ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


