"""Known hazards' signatures: findings a hazard of ``vllm_hsfix.hazards`` leaves in
its files are named after it (``Problem.hazard``)."""

from __future__ import annotations

from .reports import FileReport, Problem

PREFIX_CACHE_SLICING = "prefix-cache-slicing"
TORN_FILES = "torn-files"
AUX_FINAL_LAYER_DROPPED = "aux-final-layer-dropped"
HAZARD_IDS = (PREFIX_CACHE_SLICING, TORN_FILES, AUX_FINAL_LAYER_DROPPED)

_NOTES = {
    PREFIX_CACHE_SLICING: (
        "the signature of hazard prefix-cache-slicing: vLLM 0.22-0.23 with prefix "
        "caching on saves fewer rows than token ids"
    ),
    TORN_FILES: (
        "the signature of hazard torn-files: a writer killed mid-write (safetensors < "
        "0.8.0 writes the final path in place; vllm-hsfix's atomic-writes prevents it)"
    ),
    AUX_FINAL_LAYER_DROPPED: (
        "the signature of hazard aux-final-layer-dropped: an aux layer id equal to "
        "num_hidden_layers on DeepSeek-V2-backbone models, vLLM 0.18-0.24, saves one "
        "state into both slots"
    ),
}


def _hazard_of(p: Problem, rep: FileReport) -> str:
    if p.code == "token_mismatch" and rep.n_tokens is not None and rep.n_token_ids is not None:
        return PREFIX_CACHE_SLICING if rep.n_tokens < rep.n_token_ids else ""
    if p.code == "truncated":
        return TORN_FILES
    if p.code == "aux_layers_identical":
        return AUX_FINAL_LAYER_DROPPED
    return ""


def attribute(rep: FileReport) -> None:
    """Name the hazard behind each finding of ``rep`` that carries a known signature."""
    for p in rep.problems:
        hazard = _hazard_of(p, rep)
        if hazard and not p.hazard:
            p.hazard = hazard
            p.detail += f" ({_NOTES[hazard]})"
