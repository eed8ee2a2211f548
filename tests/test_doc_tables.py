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


def _docstring_rows() -> dict[str, str]:
    """The lines of the patch table in ``vllm_hsfix/patches/__init__.py``'s docstring, by
    patch id (read from the file's text, not through the module)."""
    import ast

    src = (ROOT / "vllm_hsfix" / "patches" / "__init__.py").read_text()
    doc = ast.get_docstring(ast.parse(src)) or ""
    table = doc.split("=====", 1)[1].rsplit("=====", 1)[0]  # between the rules
    rows = {}
    for line in table.splitlines():
        if line.startswith("``") and "``" in line[2:]:
            rows[line[2:].split("``", 1)[0]] = line
    return rows


def test_the_docstring_table_says_what_each_row_says() -> None:
    """The docstring's table names every row once, with its range, platform and the
    end of its target; a drifted or missing line fails naming the row."""
    from vllm_hsfix.patches import PATCHES

    rows = _docstring_rows()
    assert set(rows) == {p.id for p in PATCHES}, sorted(rows)
    for p in PATCHES:
        major, minor, _ = (int(x) for x in p.fixed_in.split("."))
        line = rows[p.id]
        assert f"{p.first} - {major}.{minor - 1}.x" in line, (p.id, line)
        assert f" {p.platform} " in line, (p.id, line)
        assert p.target.rsplit(".", 1)[-1] in line, (p.id, line)
