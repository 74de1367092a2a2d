"""The statistics summary as a document of blocks, rendered to Markdown (summary.md) and to an
HTML fragment (summary.html, the report's landing page): one owner for what the tables say,
two renderings of it.

Inline text may use `**strong**` and `` `code` ``, the only Markdown the summary needs; the
HTML renderer escapes everything else.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

LEFT, RIGHT = "left", "right"


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Text:
    text: str
    items: list[str] = field(default_factory=list)  # a list that follows the paragraph


@dataclass(frozen=True)
class Table:
    head: list[str]
    align: list[str]  # LEFT or RIGHT per column
    rows: list[list[str]]

    def __post_init__(self):
        if len(self.align) != len(self.head) or any(len(r) != len(self.head) for r in self.rows):
            raise ValueError(f"table {self.head[:2]}: every row needs {len(self.head)} cells")


Block = Heading | Text | Table


def markdown(blocks: list[Block]) -> str:
    parts = []
    for b in blocks:
        if isinstance(b, Heading):
            parts.append("#" * b.level + " " + b.text)
        elif isinstance(b, Text):
            parts.append("\n".join([b.text] + [f"- {i}" for i in b.items]))
        else:
            lines = ["| " + " | ".join(b.head) + " |"]
            lines.append("|" + "".join("---:|" if a == RIGHT else "---|" for a in b.align))
            lines += ["| " + " | ".join(r) + " |" for r in b.rows]
            parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


_INLINE = re.compile(r"\*\*(.+?)\*\*|`([^`]+)`")


def inline_html(text: str) -> str:
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos : m.start()]))
        strong, code = m.groups()
        out.append(
            f"<strong>{html.escape(strong)}</strong>"
            if strong is not None
            else f"<code>{html.escape(code)}</code>"
        )
        pos = m.end()
    out.append(html.escape(text[pos:]))
    return "".join(out)


# Scoped to the fragment: compact tables that fit the report's content column at 1400 px
# (headers and long labels wrap, numbers do not), a row per line, numbers right-aligned.
STYLE = """\
#tokenmill-stats { font-size: 13px; line-height: 1.35; max-width: 100%; }
#tokenmill-stats h1 { font-size: 1.4em; margin: 0 0 .5em; }
#tokenmill-stats h2 { font-size: 1.15em; margin: 1.2em 0 .4em; }
#tokenmill-stats p, #tokenmill-stats ul { margin: .4em 0; max-width: 72em; }
#tokenmill-stats table { border-collapse: collapse; margin: .3em 0 .8em; width: auto; }
#tokenmill-stats th, #tokenmill-stats td {
  border: 1px solid #d4d4d8; padding: 2px 6px; text-align: left; vertical-align: top;
}
#tokenmill-stats th { background: #f4f4f5; font-weight: 600; }
#tokenmill-stats td.num, #tokenmill-stats th.num { text-align: right; }
#tokenmill-stats td.num { white-space: nowrap; }
#tokenmill-stats tbody tr:nth-child(even) td { background: #fafafa; }
#tokenmill-stats code { font-size: .95em; }
#tokenmill-stats code::before, #tokenmill-stats code::after { content: none; }
"""


def html_fragment(blocks: list[Block]) -> str:
    """A self-contained fragment (its own scoped style), for a report page or a browser."""
    out = [f'<section id="tokenmill-stats">\n<style>\n{STYLE}</style>']
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{inline_html(b.text)}</h{b.level}>")
        elif isinstance(b, Text):
            out.append(f"<p>{inline_html(b.text)}</p>")
            if b.items:
                out.append(
                    "<ul>" + "".join(f"<li>{inline_html(i)}</li>" for i in b.items) + "</ul>"
                )
        else:
            cls = [' class="num"' if a == RIGHT else "" for a in b.align]
            head = "".join(
                f"<th{c}>{inline_html(h)}</th>" for c, h in zip(cls, b.head, strict=True)
            )
            body = "\n".join(
                "<tr>"
                + "".join(f"<td{c}>{inline_html(v)}</td>" for c, v in zip(cls, r, strict=True))
                + "</tr>"
                for r in b.rows
            )
            out.append(
                f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>"
            )
    out.append("</section>")
    return "\n".join(out) + "\n"
