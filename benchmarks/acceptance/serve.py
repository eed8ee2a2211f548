"""Stage 4 (a vLLM release that serves EAGLE-3 on this CPU: 0.32.0): a draft's
acceptance in vLLM's own speculative decoding, greedy, on held-out prompts.

``python -m acceptance.serve ARGS.json`` starts ``LLM`` with the verifier and
``speculative_config={"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 3}``,
generates, and prints ``ACCEPTANCE {json}`` with vLLM's spec-decode counters (drafts,
draft tokens, accepted tokens) and the generated token ids.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SPEC_TOKENS = 3
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def counters(llm: Any) -> dict[str, float]:
    """vLLM's spec-decode counters, summed over engines."""
    got = dict.fromkeys(COUNTERS, 0.0)
    for m in llm.get_metrics():
        for c in COUNTERS:
            if m.name == f"vllm:spec_decode_{c}":
                got[c] += float(m.value)
    return got


def main() -> None:
    """One engine, one draft: generate greedily and report the counters."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    a = json.loads(Path(sys.argv[1]).read_text())
    t0 = time.monotonic()
    llm = LLM(
        model=a["verifier"], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
        max_model_len=256, seed=0, max_num_seqs=8, enable_prefix_caching=False,
        disable_log_stats=False,
        speculative_config={"method": "eagle3", "model": a["draft"],
                            "num_speculative_tokens": SPEC_TOKENS},
    )  # fmt: skip
    startup = time.monotonic() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=a["max_tokens"], ignore_eos=True)
    t1 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in a["prompts"]], sp, use_tqdm=False)
    c = counters(llm)
    result = {**c, "startup_s": round(startup, 1), "generate_s": round(time.monotonic() - t1, 1),
              "tokens": [list(o.outputs[0].token_ids) for o in outs]}  # fmt: skip
    print("ACCEPTANCE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
