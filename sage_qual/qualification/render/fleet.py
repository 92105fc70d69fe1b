"""The fleet table `sage-qual merge` prints, in Markdown."""

from __future__ import annotations

from sage_qual.qualification.decide.fleet import FleetRow, FleetVerdict
from sage_qual.qualification.families import FAMILIES
from sage_qual.qualification.render.markdown import markdown_table


def merge_markdown(rows: list[FleetRow]) -> str:
    names = [f.name for f in FAMILIES if any(f.name in row.families for row in rows)]
    targets = any(row.target for row in rows)  # certify --target reports: which integration
    hosts = {}  # two reports from one host: each row names its report file
    for row in rows:
        hosts.setdefault(row.host, set()).add(row.report)
    files = any(len(reports) > 1 for reports in hosts.values())
    header = (["host"] + ["report"] * files + ["GPU", "sm", "GPUs", "driver", "torch", "sageattention"]
              + ["target"] * targets + names)
    body = []
    for row in rows:
        cells = [row.host] + [row.report] * files + [
            row.gpu, "%d%d" % tuple(row.capability), str(len(row.devices)), row.driver or "-", row.torch,
            sageattention(row)]
        if targets:
            cells.append(row.target or "(variants)")
        for name in names:
            if row.undecidable:
                cells.append("decides nothing (below)")
            elif name not in row.families:
                cells.append("not run")
            else:
                cells.append(cell(row.families[name]))
        body.append(cells)
    refused = list(dict.fromkeys(row.undecidable for row in rows if row.undecidable))
    return "\n".join(markdown_table(header, body) + [""] * bool(refused) + [f"- {why}" for why in refused])


def sageattention(row: FleetRow) -> str:
    """Its version and build (two builds of one version are two rows to tell apart), and the other
    providers' beside it."""
    build = f" ({row.sageattention_source})" if row.sageattention_source else ""
    return "; ".join((row.sageattention + build if row.sageattention else "-",) + row.other_providers)


def cell(found: FleetVerdict) -> str:
    """What an enabled family serves (`Served.short`), else the verdict and its reason kinds."""
    if found.served is None:
        return f"{found.verdict.value}: " + ", ".join(kind.value for kind in found.reasons)
    return f"enable: {found.served.short()}"
