#!/usr/bin/env python3
"""The README's patch table, generated from the patch table's rows (stdlib only).

``vllm_hsfix/patches/__init__.py`` is the one place that says what is patched, where,
on which releases and why; the README shows it between the markers
``<!-- patch-table:start -->`` and ``<!-- patch-table:end -->``. This script writes
that block from the rows; ``--check`` only compares and exits 1 naming each row whose
README line drifted (``tests/unit/test_doc_tables.py`` runs it).

    python3 scripts/doc_tables.py           # rewrite the block in README.md
    python3 scripts/doc_tables.py --check   # exit 1 if it is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_hsfix.patches import CONNECTOR, EXTRAS, PATCHES, Extra, PatchSpec  # noqa: E402  (stdlib only)

README = ROOT / "README.md"
START, END = "<!-- patch-table:start -->", "<!-- patch-table:end -->"
HEADER = (
    "| patch id | vLLM releases | platform | wraps (in module) | upstream | why |\n"
    "|---|---|---|---|---|---|"
)
EXTRAS_HEADER = "| extra | wraps (in module) | installed when | why |\n|---|---|---|---|"
SHORT = {
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector": (
        "...example_hidden_states_connector"
    )
}


def _wraps(module: str, names: tuple[str, ...]) -> str:
    return ", ".join(f"`{n}`" for n in names) + f" (`{SHORT.get(module, module)}`)"


def _span(p: PatchSpec) -> str:
    """``0.17.0 - 0.24.x`` (the line before ``fixed_in``), or ``0.22.0 on`` (no fix known)."""
    if p.fixed_in is None:
        return f"{p.first} on"
    major, minor, _ = (int(x) for x in p.fixed_in.split("."))
    return f"{p.first} - {major}.{minor - 1}.x"


def row(p: PatchSpec) -> str:
    platform = "vLLM's CPU build" if p.platform == "cpu" else "any"
    why = p.why.replace("|", "\\|")
    return (
        f"| `{p.id}` | {_span(p)} | {platform} | "
        f"{_wraps(p.module, p.wraps)} | {p.upstream} | {why} |"
    )


def extra_row(e: Extra) -> str:
    return f"| `{e.id}` | {_wraps(CONNECTOR, (e.wraps,))} | {e.when} | {e.why} |"


def table() -> str:
    return "\n".join(
        [HEADER, *(row(p) for p in PATCHES), "", EXTRAS_HEADER, *(extra_row(e) for e in EXTRAS)]
    )


def drifted(text: str) -> list[str]:
    """Ids of the rows whose README line is missing or differs (``[]``: up to date)."""
    if START not in text or END not in text:
        return ["(the README has no patch-table markers)"]
    block = text.split(START, 1)[1].split(END, 1)[0]
    lines = set(block.strip().splitlines())
    rows = {p.id: row(p) for p in PATCHES} | {e.id: extra_row(e) for e in EXTRAS}
    out = [rid for rid, line in rows.items() if line not in lines]
    headers = set(HEADER.splitlines()) | set(EXTRAS_HEADER.splitlines())
    extra = [ln for ln in lines - set(rows.values()) - headers if ln]
    return out + [f"(a line no row has: {ln[:60]}...)" for ln in extra]


def main(argv: list[str]) -> int:
    text = README.read_text()
    if "--check" in argv:
        bad = drifted(text)
        for pid in bad:
            print(f"README.md patch table drifted from the row: {pid}")
        return 1 if bad else 0
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n{table()}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
