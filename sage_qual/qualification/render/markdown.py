"""The Markdown every sage-qual file and terminal table shares: text any UTF-8 file takes, and
tables whose cells cannot split their rows."""

from __future__ import annotations


def safe_text(text: str) -> str:
    """Text any UTF-8 file or terminal takes: a lone surrogate (a host name read from undecodable
    bytes) becomes its escape, \\udcff, instead of failing the write."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def markdown_cell(value) -> str:
    """One table cell: `|` escaped and line breaks as spaces, so a value cannot split its row."""
    return " ".join(safe_text(str(value)).replace("|", "\\|").splitlines())


def markdown_row(values) -> str:
    return "| " + " | ".join(map(markdown_cell, values)) + " |"


def markdown_table(headers, rows) -> list[str]:
    """Every Markdown table sage-qual writes: the header, its rule, one escaped row per entry."""
    return [markdown_row(headers), "|" + "---|" * len(headers), *map(markdown_row, rows)]


