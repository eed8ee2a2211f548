"""Vendor rebuilds of a real release: a build is tested by its targets, not its version;
fixed code is never refused, a changed layout is. Static."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import skeletons as sk


def test_a_build_is_tested_by_its_targets_not_its_version_string(tmp_path: Path) -> None:
    """A 0.24.1 whose targets are 0.24.0's bytes is a tested build; the same files
    under 0.24.0 with one target edited are not."""
    src = sk.cuda_skeleton("0.24.0")
    same = sk.variant(src, tmp_path / "vllm-0.24.1", "0.24.1", None)
    out = sk.status(same, "--json", "--require", "tested")
    report = json.loads(out.stdout)
    assert report["vllm"]["version"] == "0.24.1"
    assert report["tested_build"]["tested"] is True, report["tested_build"]
    assert "matches tested build vllm 0.24.0" in report["tested_build"]["reason"]
    # The static venvs lack vllm-hsfix's entry point; only the tested requirement counts.
    assert not [p for p in report["problems"] if p.startswith("--require tested")], report
    assert {p: v["code"] for p, v in report["patches"].items()} == sk.stated("0.24.0")

    # A vendor's change the fingerprints must see: a statement added to 0.24.0's
    # register_kv_caches (the shape gate may still accept it; "tested" must not).
    connector = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
    anchor = "        # Delay tp rank0 initialization until after distributed init\n"
    changed = sk.variant(
        src,
        tmp_path / "vllm-0.24.0-vendor",
        "0.24.0",
        (connector, anchor, "        self._vendor_hook = None\n" + anchor),
    )
    out = sk.status(changed, "--json", "--require", "tested")
    report = json.loads(out.stdout)
    assert report["tested_build"]["tested"] is False, report["tested_build"]
    assert "untested build of 0.24.0" in report["tested_build"]["reason"]
    assert "register_kv_caches" in report["tested_build"]["reason"]
    # ... which the small shape check, deciding code of no tested build, accepts.
    assert report["patches"]["hidden-group-block-size"]["code"] == "would-apply", report
    assert out.returncode == 1
    assert [p for p in report["problems"] if p.startswith("--require tested")], report


MODEL = "vllm/model_executor/models/extract_hidden_states.py"
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
STORE = "kv_cache[slot_mapping // block_size, slot_mapping % block_size] = to_cache"
SHORT = "kv_cache[slots // bs, slots % bs] = to_cache"


def body(*lines: str) -> str:
    return "".join(f"    {line}\n" for line in lines)


BODY = body("block_size = kv_cache.shape[1]", STORE)
CLAMPED = {
    "clamp-min-keyword": body(
        "block_size = kv_cache.shape[1]", "slot_mapping = slot_mapping.clamp(min=0)", STORE
    ),
    "block-size-after-clamp": body(
        "slot_mapping = slot_mapping.clamp_min(0)", "block_size = kv_cache.shape[1]", STORE
    ),
    "torch-clamp-new-name": body(
        "slots = torch.clamp(slot_mapping, min=0)", "bs = kv_cache.shape[1]", SHORT
    ),
    "in-place": body("slot_mapping.clamp_min_(0)", "block_size = kv_cache.shape[1]", STORE),
    # Two spellings at once (the keyword and the order): the gate follows the slots.
    "clamp-min-keyword-first": body(
        "slot_mapping = slot_mapping.clamp(min=0)", "block_size = kv_cache.shape[1]", STORE
    ),
    "inline": body(
        "bs = kv_cache.shape[1]",
        "kv_cache[slot_mapping.clamp_min(0) // bs, slot_mapping.clamp_min(0) % bs] = to_cache",
    ),
}
NOT_CLAMPED = {
    "clamp-result-unused": body("slots = slot_mapping.clamp_min(0)") + BODY,
    "offset-unclamped": body(
        "slots = slot_mapping.clamp_min(0)",
        "bs = kv_cache.shape[1]",
        "kv_cache[slots // bs, slot_mapping % bs] = to_cache",
    ),
    "clamp-at-minus-one": body(
        "slots = slot_mapping.clamp_min(-1)", "bs = kv_cache.shape[1]", SHORT
    ),
}


def _vendor_status(
    tmp_path: Path, edit: tuple[str, str, str] | None, **env: str
) -> tuple[int, dict]:
    tree = sk.variant(sk.cuda_skeleton("0.24.0"), tmp_path / "vllm-0.24.0", "0.24.0", edit)
    out = sk.status(tree, "--json", **env)
    report = json.loads(out.stdout)
    report["problems"] = [p for p in report["problems"] if "entry point" not in p]
    return out.returncode, report


@pytest.mark.parametrize("variant", sorted(CLAMPED))
def test_a_clamp_in_any_spelling_is_fixed_code(tmp_path: Path, variant: str) -> None:
    _code, report = _vendor_status(tmp_path, (MODEL, BODY, CLAMPED[variant]), VLLM_HSFIX_STRICT="1")
    scatter_rec = report["patches"]["scatter-clamp"]
    assert scatter_rec["code"] == "upstream-fix-present", scatter_rec
    assert "clamped" in scatter_rec["reason"] and report["problems"] == []


@pytest.mark.parametrize("variant", sorted(NOT_CLAMPED))
def test_a_store_not_fed_by_the_clamp_is_refused(tmp_path: Path, variant: str) -> None:
    code, report = _vendor_status(tmp_path, (MODEL, BODY, NOT_CLAMPED[variant]))
    assert report["patches"]["scatter-clamp"]["code"] == "unknown-shape"
    assert code == 1 and any(p.startswith("scatter-clamp") for p in report["problems"])


def test_a_connector_reading_a_head_major_buffer_is_refused(tmp_path: Path) -> None:
    """0.24.0's connector class with 0.29's head-major read: the gate pins the layout
    the patch's block-size check and slot arithmetic are written for."""
    read = "shape[1]\n    return kv_cache[slot_mapping // block_size, slot"
    head_major = "shape[2]\n    return kv_cache[slot_mapping // block_size, :, slot"
    code, report = _vendor_status(tmp_path, (CONNECTOR, read, head_major))
    conn = report["patches"]["hidden-group-block-size"]
    assert conn["code"] == "unknown-shape", conn
    assert "extract_from_kv_cache reads a blocks-first buffer" in conn["reason"]
    assert code == 1 and any(p.startswith("hidden-group") for p in report["problems"])
