"""The README's patch table is the patch table's rows (``scripts/doc_tables.py``).

Static (no torch, no vLLM): runs on every supported Python.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "doc_tables.py"


def check(
    readme_text: str | None = None, tmp: Path | None = None
) -> subprocess.CompletedProcess[str]:
    code = f"import sys; sys.argv = ['x', '--check']; sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
    code += "import doc_tables\n"
    if readme_text is not None and tmp is not None:
        (tmp / "README.md").write_text(readme_text)
        code += f"doc_tables.README = __import__('pathlib').Path({str(tmp / 'README.md')!r})\n"
    code += "sys.exit(doc_tables.main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_the_readme_table_is_generated_from_the_rows() -> None:
    proc = check()
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_drifted_row_is_named(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("| `atomic-writes` |"))
    proc = check(text.replace(line, line.replace("0.22.0", "0.21.0")), tmp_path)
    assert proc.returncode == 1
    assert "drifted from the row: atomic-writes" in proc.stdout, proc.stdout
    assert proc.stdout.count("drifted") == 2  # the row, and the line no row has
