"""Stage 2 (a vLLM release's environment): the same prompts' hidden states three ways.

``fixes-off``: vLLM's ``extract_hidden_states`` with vllm-hsfix's fixes off as the demo
turns them off (``hsfix_demo.e2e.unpatched_env``: every row but the three without which
vLLM's CPU build saves nothing); ``vllm-hsfix``: the same run with vllm-hsfix active;
``reference``: the verifier's fp32 ``transformers`` forward, shaped as vLLM saves it.
Each run is ``hsfix_demo/_case.py`` (``LLM``, worker in its own process), supervised as
the demo supervises it. ``python -m acceptance.extract ARGS.json`` prints
``ACCEPTANCE {json}`` with the rows right per dataset.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hsfix_demo import cpu_support, e2e

AUX_IDS = (1, 2, 3, 4)  # three for the draft, the last layer's output for its targets
MAX_NUM_SEQS = 16  # requests finish while others wait: blocks are handed out again


def vllm_run(model: Path, batch: list[list[int]], patched: bool, work: Path) -> list[dict]:
    """One ``_case.py`` run; the saved file of each prompt, loaded."""
    from safetensors.torch import load_file

    out = Path(tempfile.mkdtemp(prefix="patched-" if patched else "off-", dir=work))
    args = {"model": str(model), "aux_ids": list(AUX_IDS), "mp": True, "hybrid": True,
            "language_model_only": False, "max_model_len": e2e.MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS, "out": str(out / "hs"), "prompts": batch,
            "engine": {}}  # fmt: skip
    (out / "args.json").write_text(json.dumps(args))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(e2e.plugin_dir(work)), env.get("PYTHONPATH", "")])
    for key in ("VLLM_HSFIX_DISABLE", "VLLM_HSFIX_DISABLED_PATCHES"):
        env.pop(key, None)
    if not patched:
        env.update(e2e.unpatched_env())
    log = out / "run.log"
    _, rc, killed = e2e.supervise(
        [sys.executable, str(e2e.CASE_SCRIPT), str(out / "args.json")], env, log
    )
    text = log.read_text(errors="replace") if log.exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("HSFIX_CASE_RESULT ")), None)
    if killed or rc != 0 or line is None:
        raise SystemExit(f"vLLM run failed ({killed or rc}): {e2e.one_line(str(log))}")
    return [load_file(p) for p in json.loads(line.split(" ", 1)[1])["paths"]]


def reference(model_dir: Path, batch: list[list[int]], group: int = 16) -> list[dict]:
    """The fp32 ``transformers`` forward's rows, as the connector saves them (aux id k:
    ``hidden_states[k]``; the last id: the last layer's output before the final norm).
    Prompts run ``group`` at a time, right-padded: every layer is causal, so a prompt's
    rows do not see the padding after it."""
    import torch

    from vllm_hsfix.audit import reference as audit_reference

    model = audit_reference.load_model(model_dir)
    last_layer = audit_reference.decoder_layers(model)[-1]
    out: list[dict] = []
    for start in range(0, len(batch), group):
        part = batch[start : start + group]
        ids = torch.zeros(len(part), max(map(len, part)), dtype=torch.long)
        for i, p in enumerate(part):
            ids[i, : len(p)] = torch.tensor(p)
        kept: list[Any] = []
        hook = last_layer.register_forward_hook(lambda _m, _a, o, k=kept: k.append(o))
        try:
            with torch.no_grad():
                hs = model(ids, output_hidden_states=True).hidden_states
        finally:
            hook.remove()
        last = kept[-1][0] if isinstance(kept[-1], tuple) else kept[-1]
        rows = torch.stack([*(hs[k] for k in AUX_IDS[:-1]), last], dim=2)
        out += [{"hidden_states": rows[i, : len(p)].to(torch.bfloat16),
                 "token_ids": torch.tensor(p)} for i, p in enumerate(part)]  # fmt: skip
    return out


def save(files: list[dict], where: Path) -> None:
    """Each prompt's hidden states and token ids, one safetensors file each."""
    from safetensors.torch import save_file

    where.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(files):
        tensors = {"hidden_states": f["hidden_states"].contiguous(), "token_ids": f["token_ids"]}
        save_file(tensors, str(where / f"{i:04d}.safetensors"))


def main() -> None:
    """Extract the datasets the arguments name into ``out/<name>/`` (``heldout``: the
    reference rows of the held-out prompts); print the rows right of each."""
    a = json.loads(Path(sys.argv[1]).read_text())
    ok, why = cpu_support.cpu_moe_support()
    if not ok:
        print("ACCEPTANCE " + json.dumps({"skip": why}), flush=True)
        return
    model, out, batch = Path(a["model"]), Path(a["out"]), a["prompts"]
    work = Path(tempfile.mkdtemp(prefix="extract-", dir=a.get("work")))
    t0 = time.monotonic()
    ref = reference(model, batch)
    save(reference(model, a["heldout"]), out / "heldout")
    result: dict[str, Any] = {"reference_s": round(time.monotonic() - t0, 1)}
    for name in a["datasets"]:
        t0 = time.monotonic()
        files = ref if name == "reference" else vllm_run(model, batch, name == "vllm-hsfix", work)
        rows = e2e.compare(files, [r["hidden_states"].float() for r in ref], batch, AUX_IDS)
        save(files, out / name)
        result[name] = {"rows_right": [rows["rows_correct"], rows["rows"]],
                        "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip
        print(f"extract {name}: rows right {rows['rows_correct']}/{rows['rows']}",
              file=sys.stderr, flush=True)  # fmt: skip
    print("ACCEPTANCE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
