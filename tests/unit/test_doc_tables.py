"""The README's patch table is the patch table's rows (static)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "doc_tables.py"


def test_the_readme_table_is_generated_from_the_rows() -> None:
    cmd = [sys.executable, SCRIPT, "--check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_drifted_row_is_named() -> None:
    spec = importlib.util.spec_from_file_location("doc_tables", SCRIPT)
    doc_tables = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(doc_tables)  # type: ignore[union-attr]
    text = (ROOT / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("| `atomic-writes` |"))
    bad = doc_tables.drifted(text.replace(line, line.replace("0.22.0", "0.21.0")))
    # The row, and the line no row has.
    assert bad[0] == "atomic-writes" and bad[1].startswith("(a line no row has"), bad
    assert len(bad) == 2, bad
