"""``tp_engine.py MODEL OUT ARGS.json``: the tiny hybrid with ``tensor_parallel_size=2``
generates one token per prompt and prints ``HSFIX_TP_RESULT [path, ...]``."""

from __future__ import annotations

import json
import sys

from vllm import LLM, SamplingParams

from support.extraction import kv_transfer_config, speculative_config

if __name__ == "__main__":
    model, out = sys.argv[1], sys.argv[2]
    with open(sys.argv[3]) as fh:
        args = json.load(fh)
    llm = LLM(
        model=model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
        enable_prefix_caching=False, enable_chunked_prefill=False, max_model_len=256,
        seed=0, tensor_parallel_size=2,
        distributed_executor_backend="mp", mamba_ssm_cache_dtype="float32",
        language_model_only=True, speculative_config=speculative_config(args["aux"]),
        kv_transfer_config=kv_transfer_config(out),
    )  # fmt: skip
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    # The last requests' files are written in later engine steps: one more step.
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
    paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
    print("HSFIX_TP_RESULT " + json.dumps(paths), flush=True)
