"""Plain-data report sections (`Section`, `Table`) and their rendering: rich tables exported
to plain text (no colour, no time stamps, trailing blanks stripped: byte-stable for golden
tests) or GitHub markdown; and the number formats the report, `explain` and the plots share."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Format", "Section", "Table", "fmt_bytes_gb", "fmt_seconds", "fmt_signed_seconds",
           "fmt_bytes", "fmt_count", "fmt_value", "render_sections"]

Format = Literal["text", "md"]
_TEXT_WIDTH = 120


def fmt_seconds(value: float) -> str:
    """Seconds with a unit that keeps three significant figures readable (s, ms, us)."""
    value = float(value)
    magnitude = abs(value)
    if magnitude < 5e-8:  # below the last digit shown: rounding noise of the estimate
        return "0"
    if magnitude >= 1.0:
        return f"{value:.3f} s"
    if magnitude >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def fmt_signed_seconds(value: float) -> str:
    text = fmt_seconds(value)
    return text if text.startswith("-") or text == "0" else "+" + text


def fmt_bytes_gb(value: float) -> str:
    return f"{float(value) / 1e9:.2f}"


def fmt_count(value: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:g}"


def fmt_bytes(value: float) -> str:
    """Bytes in binary units when they are whole MiB, else in decimal GB."""
    mib = value / 2**20
    return f"{mib:g} MiB" if mib == int(mib) and mib < 2**14 else f"{value / 1e9:g} GB"


def fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={fmt_value(v)}" for k, v in value.items())
    return str(value)


# -- layout as plain data, two renderers ------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    title: str = ""
    right: frozenset[int] = frozenset()  # indices of right-aligned (numeric) columns


@dataclass(frozen=True, kw_only=True)
class Section:
    title: str
    lines: tuple[str, ...] = ()
    tables: tuple[Table, ...] = ()
    after: tuple[str, ...] = field(default=())  # lines printed below the tables


def render_sections(sections: list[Section], fmt: Format = "text", *, title: str = "") -> str:
    """Sections as plain text (rich tables, `fmt="text"`) or GitHub markdown (`fmt="md"`)."""
    if fmt == "text":
        return _render_text(sections, title)
    if fmt == "md":
        return _render_md(sections, title)
    raise ValueError(f"fmt must be 'text' or 'md', got {fmt!r}")


def _render_text(sections: list[Section], title: str) -> str:
    from rich import box
    from rich.console import Console
    from rich.table import Table as RichTable
    from rich.text import Text

    console = Console(record=True, width=_TEXT_WIDTH, file=io.StringIO(), color_system=None,
                      force_terminal=False, emoji=False, highlight=False, markup=False,
                      log_time=False, log_path=False)
    if title:
        console.print(Text(title))
        console.print(Text("=" * len(title)))
    for section in sections:
        console.print()
        console.print(Text(section.title))
        console.print(Text("-" * len(section.title)))
        for line in section.lines:
            console.print(Text(line))
        for table in section.tables:
            rich = RichTable(title=table.title or None, title_justify="left", box=box.SIMPLE_HEAD,
                             show_edge=False, pad_edge=False, expand=False)
            for i, name in enumerate(table.columns):
                rich.add_column(Text(name), justify="right" if i in table.right else "left",
                                overflow="fold")
            for row in table.rows:
                rich.add_row(*(Text(cell) for cell in row))
            console.print(rich)
        for line in section.after:
            console.print(Text(line))
    text = console.export_text(clear=True, styles=False)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n") + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _render_md(sections: list[Section], title: str) -> str:
    out: list[str] = [f"# {title}", ""] if title else []
    for section in sections:
        out += [f"## {section.title}", ""]
        out += [f"- {_md_cell(line)}" for line in section.lines]
        out += [""] if section.lines else []
        for table in section.tables:
            out += [f"**{_md_cell(table.title)}**", ""] if table.title else []
            out.append("| " + " | ".join(_md_cell(c) for c in table.columns) + " |")
            out.append("|" + "|".join("---:" if i in table.right else "---"
                                      for i in range(len(table.columns))) + "|")
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows]
            out.append("")
        out += [f"- {_md_cell(line)}" for line in section.after]
        out += [""] if section.after else []
    return "\n".join(out).rstrip("\n") + "\n"


# -- shared comparisons ------------------------------------------------------------------------
