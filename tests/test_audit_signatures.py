"""Hazard signatures in the audit (issue 19): findings that name the hazard of the
register whose mark they carry. Crafted files here (each damaged the way the hazard
damages a file); files the real releases wrote are audited in ``test_hazards.py``
(a writer killed mid-write) and ``test_hazards_e2e.py`` (0.22.0's prefix caching).
The aux-layer broadcast needs a DeepSeek-V2-backbone model, which no CPU here runs:
crafted only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from support.hsfiles import hs_file

from vllm_hsfix import hazards
from vllm_hsfix.audit import pipeline, reports


def test_every_signature_names_a_row_of_the_register() -> None:
    ids = {h.id for h in hazards.HAZARDS}
    assert set(reports.HAZARD_IDS) <= ids


def hazard_of(path: Path) -> dict[str, str]:
    rep = pipeline.check_file(path)
    return {p.code: p.hazard for p in rep.problems}


def test_fewer_rows_than_token_ids_is_prefix_cache_slicing(tmp_path: Path) -> None:
    f = tmp_path / "short.safetensors"
    save_file(
        {"hidden_states": torch.randn(1, 3, 32).bfloat16(), "token_ids": torch.arange(65)},
        str(f),
    )
    assert hazard_of(f) == {"token_mismatch": "prefix-cache-slicing"}
    longer = tmp_path / "long.safetensors"  # more rows than ids: not this hazard's mark
    save_file(
        {"hidden_states": torch.randn(9, 3, 32).bfloat16(), "token_ids": torch.arange(5)},
        str(longer),
    )
    assert hazard_of(longer) == {"token_mismatch": ""}


def test_a_truncated_file_is_torn_files(tmp_path: Path) -> None:
    full = hs_file(tmp_path / "full.safetensors", tokens=64)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    rep = pipeline.check_file(cut)
    assert {p.code: p.hazard for p in rep.problems}.get("truncated") == "torn-files"
    assert "hazard torn-files" in rep.reason()


def test_one_state_in_two_aux_slots_is_aux_final_layer_dropped(tmp_path: Path) -> None:
    def broadcast(hs: torch.Tensor, ids: torch.Tensor) -> None:
        hs[:, 2] = hs[:, 1]  # what 0.18-0.24 save for ids [k, num_hidden_layers]

    f = hs_file(tmp_path / "b.safetensors", tokens=20, edit=broadcast)
    rep = pipeline.check_file(f)
    assert rep.verdict == "corrupt"
    assert {p.code: p.hazard for p in rep.problems} == {
        "aux_layers_identical": "aux-final-layer-dropped"
    }
    assert "aux layers 1 and 2 hold identical rows at all 20" in rep.reason()
    ok = hs_file(tmp_path / "ok.safetensors", tokens=20)
    assert pipeline.check_file(ok).verdict == "ok"  # real layers never agree everywhere
