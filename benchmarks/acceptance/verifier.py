"""Stage 1 (torch-2.11.0 environment): make the tiny hybrid verifier learnable.

A random-weight verifier is noise a draft cannot imitate (a draft trained on one
accepted about 0 tokens). So the tiny Qwen3-Next hybrid (``hsfix_demo.tiny_model`` kind
``hybrid-moe``: its layer kinds, head dims and MoE kept) is trained briefly with
``transformers`` on :mod:`acceptance.language`, then saved in bf16 as vLLM reads it.
``python -m acceptance.verifier ARGS.json`` prints ``ACCEPTANCE {json}``.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from acceptance import language

LENGTH = 64
BATCH = 8


def greedy_accuracy(model: Any, seqs: list[list[int]]) -> float:
    """How often the verifier's greedy next token is the language's next token in its
    mode (positions after the first 16, where the mode can be read from the context)."""
    import torch

    right = total = 0
    with torch.no_grad():
        for ids in seqs:
            pred = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
            z = mode_of(ids)
            for t in range(16, len(ids) - 1):
                want = language.FIRST + language.PERM[z][ids[t] - language.FIRST]
                right += pred[t] == want
                total += 1
    return right / max(total, 1)


def mode_of(ids: list[int]) -> int:
    """The mode most of the sequence's transitions follow."""
    xs = [t - language.FIRST for t in ids]
    votes = [sum(p[a] == b for a, b in itertools.pairwise(xs)) for p in language.PERM]
    return max(range(language.MODES), key=votes.__getitem__)


def train(out: Path, steps: int) -> dict[str, Any]:
    """Train the tiny verifier ``steps`` steps on the language; save it to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from hsfix_demo import tiny_model

    torch.manual_seed(0)
    base = tiny_model.build(out.parent / "hybrid-moe-random", "hybrid-moe")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    t0 = time.monotonic()
    for step in range(steps):
        batch = torch.tensor(language.prompts(10_000 + step, BATCH, LENGTH, LENGTH))
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"verifier step {step} loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.eval()
    acc = greedy_accuracy(model, language.prompts(99, 16, LENGTH, LENGTH))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return {"loss": float(loss.item()), "greedy_accuracy": acc, "train_s": time.monotonic() - t0}


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    a = json.loads(Path(sys.argv[1]).read_text())
    result = train(Path(a["out"]), a["steps"])
    print("ACCEPTANCE " + json.dumps(result), flush=True)
