"""Provenance from a real engine: every file a worker writes names its aux layers and
engine settings, on every release, whether or not a patch there has an in-situ check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CACHE, INSTALL
from support.digest import header

from hsfix_demo import e2e

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm]


def test_every_file_names_its_aux_layers_and_engine_with_the_check_off(tmp_path: Path) -> None:
    """``VLLM_HSFIX_VERIFY=0``: no in-situ check runs, the stamps are still complete."""
    case = e2e.CASES["dense-mp"]
    env = {"VLLM_HSFIX_PROVENANCE": "1", "VLLM_HSFIX_VERIFY": "0"}
    r = e2e.run_case(case, patched=True, workdir=tmp_path, models=CACHE / "models", extra_env=env)
    assert r.ok_run, r.error
    assert r.rows_correct == r.rows > 0, r.as_dict()
    assert len(r.files) == r.requests == 4
    for path in r.files:
        meta = header(Path(path))["__metadata__"]
        assert meta["vllm_hsfix.vllm"] == INSTALL.version, meta
        assert meta["vllm_hsfix.aux_layers"] == ",".join(map(str, case.aux_ids)), meta
        engine = json.loads(meta["vllm_hsfix.engine"])
        assert engine["dtype"] == "bfloat16" and engine["max_model_len"] == e2e.MAX_MODEL_LEN
        assert meta["vllm_hsfix.in_situ_check"] == "not run", meta
