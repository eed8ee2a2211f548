"""One in-process vLLM engine, prefix caching on, for the two prefix hazards; prints
``HSFIX_PREFIX_RESULT {json}``. 0.22-0.23: rows cut with the full prompt length under a
prefix hit; 0.25-0.28: a cached prompt beside a decode padded up to ``max_model_len``, so
``_input_fits_in_drafter`` says no. Block size 16, ``max_model_len`` 66: W fills the
cache, S hits it, R decodes, then P and Q arrive together; each step is recorded."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from support.children.abort_case import describe
from support.extraction import kv_transfer_config, speculative_config
from support.lockfile import written


def main() -> None:
    with open(sys.argv[1]) as fh:
        args = json.load(fh)
    import wrapt

    import vllm_hsfix

    vllm_hsfix.apply()
    fits: list[bool] = []

    def record_fits(module: Any) -> None:
        def observe(wrapped: Any, instance: Any, a: Any, kw: Any) -> Any:
            answer = wrapped(*a, **kw)
            fits.append(bool(answer))
            return answer

        if hasattr(module.GPUModelRunner, "_input_fits_in_drafter"):
            wrapt.wrap_function_wrapper(module, "GPUModelRunner._input_fits_in_drafter", observe)

    wrapt.register_post_import_hook(record_fits, "vllm.v1.worker.gpu_model_runner")
    # What vllm-hsfix says at WARNING or above during the run.
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                said.append(record.getMessage())

    logging.getLogger("vllm_hsfix").addHandler(Keep())
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=True,
        enable_chunked_prefill=False,
        block_size=16,
        max_model_len=args["max_model_len"],
        max_num_seqs=4,
        seed=0,
        speculative_config=speculative_config(args["aux_ids"]),
        kv_transfer_config=kv_transfer_config(args["out"]),
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    steps: list[dict[str, Any]] = []
    real_schedule = scheduler.schedule

    def schedule(*a: Any, **kw: Any) -> Any:
        out = real_schedule(*a, **kw)
        steps.append(
            {
                "tokens": {k.split("-")[0]: v for k, v in out.num_scheduled_tokens.items()},
                "spec": sorted(k.split("-")[0] for k in out.scheduled_spec_decode_tokens),
            }
        )
        return out

    scheduler.schedule = schedule
    one = SamplingParams(max_tokens=1, temperature=0.0)
    decode = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    p = args["prompts"]
    paths: dict[str, str | None] = {}
    produced: dict[str, int] = {}
    error = None

    def step() -> None:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids) if out.outputs else 0
            if out.finished:
                paths[out.request_id] = (out.kv_transfer_params or {}).get("hidden_states_path")

    def until(done: Any, limit: float = 120) -> None:
        deadline = time.monotonic() + limit
        while not done() and time.monotonic() < deadline:
            step()

    try:
        engine.add_request("W", {"prompt_token_ids": p["W"]}, one)
        until(lambda: "W" in paths and written(paths["W"] or ""))
        engine.add_request("S", {"prompt_token_ids": p["S"]}, one)
        until(lambda: "S" in paths and written(paths["S"] or ""))
        engine.add_request("R", {"prompt_token_ids": p["R"]}, decode)
        until(lambda: produced.get("R", 0) >= 2)
        mark = len(fits)
        engine.add_request("P", {"prompt_token_ids": p["P"]}, one)
        engine.add_request("Q", {"prompt_token_ids": p["Q"]}, one)
        until(lambda: all(r in paths and written(paths[r] or "") for r in "WSRPQ"))
        for _ in range(3):
            step()
    except Exception as exc:
        error = describe(exc)
        mark = len(fits)
    patches = {k: v["status"] for k, v in vllm_hsfix.status()["patches"].items()}
    print(
        "HSFIX_PREFIX_RESULT "
        + json.dumps(
            {
                "paths": paths,
                "fits": fits,
                "fits_after_pq": fits[mark:],
                "steps": steps,
                "error": error,
                "block_size": engine.vllm_config.cache_config.block_size,
                "patches": patches,
                "hsfix_warnings": said,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
