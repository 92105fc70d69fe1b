"""`sage-qual fixtures list [DIR]` and `sage-qual fixtures show FILE|NAME [--json]`.

Bad input (a missing directory, a file that is not a valid fixture) prints one line on stderr and
returns exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from pathlib import Path

from sage_qual.errors import ExitCode, UsageError
from sage_qual.verdicts import fitness


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("fixtures", help="list and inspect activation fixtures")
    commands = parser.add_subparsers(dest="fixtures_command", required=True)
    listing = commands.add_parser("list", help="one line per fixture file in a directory")
    listing.add_argument("directory", nargs="?", help="default: the repository's fixtures/ directory")
    listing.set_defaults(func=_list)
    show = commands.add_parser("show", help="shapes, channel statistics, bounds and provenance of a fixture")
    show.add_argument("file", help="a fixture file, or a name as `fixtures list` prints it (from the "
                                   "repository's fixtures/ directory)")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(func=_show)


def _fail(message: str) -> int:
    print(f"sage-qual fixtures: {message}", file=sys.stderr)
    return ExitCode.USAGE


def _shape(shape) -> str:
    return "x".join(str(n) for n in shape)


def _list(args: argparse.Namespace) -> int:
    from sage_qual.fixtures.fileformat import FixtureError, list_fixtures, load_fixture, shipped_dir

    directory = args.directory or shipped_dir()
    if directory is None:
        return _fail("no fixtures/ directory next to the package; give a DIR")
    try:
        paths = list_fixtures(directory)
    except FixtureError as error:
        return _fail(str(error))
    status = 0
    for path in paths:
        try:
            f = load_fixture(path)
        except FixtureError as error:
            status = _fail(str(error))
            continue
        masked = "" if f.mask is None else f"  masked ({_shape(f.mask.shape)})"
        print(f"{f.name:<34} {f.family:<16} {f.kind:<9} q {_shape(f.q.shape):<15} kv {_shape(f.k.shape):<15} "
              f"{str(f.dtype).replace('torch.', ''):<9} {path.stat().st_size / 1e6:.2f} MB{masked}")
    return status


def resolve(name: str) -> Path:
    """The file a `fixtures show` argument names: a path as given, or a bare fixture name (as
    `fixtures list` prints it) in the repository's fixtures/ directory."""
    from sage_qual.fixtures.fileformat import SUFFIX, FixtureError, list_fixtures, shipped_dir

    path = Path(name)
    if path.exists() or len(path.parts) > 1:
        return path
    shipped = shipped_dir()
    candidate = shipped / (name if path.suffix == SUFFIX else name + SUFFIX) if shipped else None
    if candidate is None or not candidate.exists():
        known = ", ".join(p.name.removesuffix(SUFFIX) for p in list_fixtures(shipped)) if shipped else ""
        raise FixtureError(name, "name", "no such file, and no shipped fixture of that name",
                           f"give a path or one of: {known}" if known else "give the path of a fixture file")
    return candidate


def _show(args: argparse.Namespace) -> int:
    from sage_qual.fixtures import known
    from sage_qual.fixtures.fileformat import FixtureError, describe, load_fixture
    from sage_qual.qualification.selection import check_finite

    try:
        path = resolve(args.file)
        fixture = load_fixture(path)
    except FixtureError as error:
        raise UsageError(str(error)) from None
    check_finite(fixture, path)  # what certify and gate would refuse, said here first
    info = {**describe(fixture), "known_failures": known.failures(fixture)}
    # one line, as every --json answer (jsonfile.line); no NaN, which JSON has not
    print(json.dumps(_finite(info), allow_nan=False) if args.json else render(info))
    return ExitCode.OK


def _finite(value):
    """JSON has no NaN or infinity (a kernel's non-finite result in the calibration): null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _channels(stats: dict) -> str:
    top = ", ".join(f"{c}: {m:.4g}" for c, m in stats["top_channels"])
    outliers = ", ".join(f"{c} ({m:.4g})" for c, m in stats["outlier_channels"]) or "none"
    return (f"max {stats['max_abs']:.4g}; top channels {top}; median channel max "
            f"{stats['median_channel_max']:.4g}; outlier channels {outliers}")


def _value(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={json.dumps(v)}" for k, v in value.items())
    return str(value)


def render(info: dict) -> str:
    """describe()'s dict as text for a terminal."""
    lines = [
        f"{info['name']}  ({info['kind']}, family {info['family']})",
        f"  file         {info['path']}, {info['size_bytes']} bytes, sha256 {info['sha256']}",
        (f"  tensors      {info['dtype']} {info['layout']}: q {info['shapes']['q']}, "
         f"k {info['shapes']['k']}, v {info['shapes']['v']}; query heads per K/V head: {info['gqa_group']}"),
        f"  source       {_value(info['source'])}",
    ]
    if info["mask"] is not None:
        lines.append(
            f"  attn_mask    bool {info['mask']}: a masked call, run only by a variant that takes a mask"
        )
    lines += [f"  |{name}|{' ' * 10} {_channels(info['channels'][name])}" for name in ("q", "k", "v")]
    lines.append(f"  outliers     {info['outlier_rule']}")
    v_mean = info["v_mean"]
    lines.append(f"  V mean       overall {v_mean['overall']:.4g}; largest |channel mean| "
                 f"{v_mean['max_abs_channel_mean']:.4g} (channel {v_mean['channel']})")
    lines += [f"  fitness bound {cls:<5} relative L2 <= {b['max_rel_l2']}, cosine >= {b['min_cosine']}"
              for cls, b in info["bounds"].items()]
    if info["bounds"]:
        first_class, stated = next(iter(info["bounds"].items()))
        bound = fitness.bound_for(info["name"], info["kind"], first_class, stated)
        lines.append(f"  bound source {bound.source}")
    else:
        lines.append("  bound source none: the file states no bound")
    if info["published"]:
        lines.append(f"  published    {_value(info['published'])}")
    calibration = info["calibration"]
    if isinstance(calibration, dict):
        lines.append(f"  calibration  {calibration.get('status', '')}")
        if calibration.get("reproduction"):
            lines += textwrap.wrap("reproduction: " + calibration["reproduction"], width=100,
                                   initial_indent="    ", subsequent_indent="      ")
        for title in ("kernels", "emulated"):
            if title == "emulated" and calibration.get("emulation"):
                lines.append(f"    emulated by {calibration['emulation']}")
            for variant, numbers in calibration.get(title, {}).items():
                lines.append(f"    {title} {variant}: {_value(numbers)}")
        if "torch_sdpa_cpu" in calibration:
            lines.append(
                f"    torch SDPA on the CPU that wrote the file: {_value(calibration['torch_sdpa_cpu'])} "
                "(another CPU's kernels give another number)"
            )
    elif calibration:
        lines.append(f"  calibration  {calibration}")
    lines += [f"  known        {line}" if n == 0 else f"               {line}"
              for n, line in enumerate(info["known_failures"])]
    lines.append("  provenance")
    lines += textwrap.wrap(info["provenance"], width=100, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)
