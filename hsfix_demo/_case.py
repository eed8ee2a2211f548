"""One vLLM run: extract hidden states for token-id prompts, print where they went.

``python _case.py ARGS.json`` (written by ``e2e.run_case``). Prints one line
``HSFIX_CASE_RESULT {json}`` with the file of each request and the number of engine
steps the run took (counted around ``LLMEngine.step``, harness only).

Run as a script in its own interpreter (``python _case.py JSON``), so the run does
not import vllm_hsfix itself: whether the fix is active is decided only by vLLM's
plugin loading and the environment, exactly as in a user's job.
"""

import fcntl
import json
import os
import sys
import time


def wait_for(path, deadline):
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.exists(path + ".lock"):
            with open(path + ".lock") as lf:
                try:
                    fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    pass
        time.sleep(0.2)
    return False


def main():
    with open(sys.argv[1]) as fh:
        args = json.load(fh)
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=args["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_model_len=args["max_model_len"],
        seed=0,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": args["aux_ids"]}
            },
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": args["out"]},
        },
    )
    if args["hybrid"]:
        kwargs["mamba_ssm_cache_dtype"] = "float32"
    if args["language_model_only"]:
        kwargs["language_model_only"] = True
    if args["max_num_seqs"]:
        # Few running at once: requests finish while others wait, so freed blocks are
        # handed out again (vLLM reuses the most recently freed first).
        kwargs["max_num_seqs"] = args["max_num_seqs"]
    if args["mp"]:
        kwargs["distributed_executor_backend"] = "mp"
    kwargs.update(args.get("engine") or {})  # a case's own engine settings win
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    t_start = time.monotonic() - t0
    engine = llm.llm_engine
    steps = [0]
    real_step = engine.step

    def counted_step(*a, **kw):
        steps[0] += 1
        return real_step(*a, **kw)

    engine.step = counted_step
    sp = SamplingParams(max_tokens=args.get("max_tokens") or 1, temperature=0.0)
    t1 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], sp, use_tqdm=False)
    paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
    deadline = time.monotonic() + 120
    kicks = 0
    while not all(p and wait_for(p, min(deadline, time.monotonic() + 3)) for p in paths):
        if time.monotonic() > deadline:
            break
        # Writes happen in later engine steps: give the engine something to step.
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
        kicks += 1
    t_gen = time.monotonic() - t1
    config = llm.llm_engine.vllm_config
    print(
        "HSFIX_CASE_RESULT "
        + json.dumps(
            {
                "paths": paths,
                "kicks": kicks,
                "steps": steps[0],
                "global_block_size": config.cache_config.block_size,
                "startup_s": round(t_start, 2),
                "generate_s": round(t_gen, 2),
                "prompt_tokens": sum(len(p) for p in args["prompts"]),
            }
        ),
        flush=True,
    )
    del llm


if __name__ == "__main__":
    main()
