"""One abort before scheduling, the engine core in a process of its own (test_hazards_serve.py).

Prints ``HSFIX_ABORT_MP_RESULT {json}``. ``abort_case.py``'s round in vLLM's default
layout: vllm-hsfix is active there through its plugin only, and an exception kills the
engine core (the next call raises ``EngineDeadError``)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from support.children.abort_case import describe, make_llm, submit_and_abort
from support.lockfile import written


def run_round(llm: Any, prompts: list[list[int]], sp: Any) -> dict[str, Any]:
    """``abort_case.run_round`` for an engine core of its own process: there ``step()``
    waits for the engine's next output, and an idle engine sends none, so once the
    requests are done the writes are pushed along by short extra requests (the
    worker saves a finished request's rows in a later step, as in test_serve.py)."""
    engine = llm.llm_engine
    ids = [f"m-r{i}" for i in range(len(prompts))]
    result = submit_and_abort(engine, ids, prompts, sp)
    paths: dict[str, str | None] = {}
    steps = 0
    deadline = time.monotonic() + 240
    try:
        while len(paths) < len(ids) - 1 and time.monotonic() < deadline:
            for out in engine.step():
                if out.finished:
                    paths[out.request_id] = (out.kv_transfer_params or {}).get("hidden_states_path")
            steps += 1
        extra = 0
        while not all(written(p or "") for p in paths.values()) and time.monotonic() < deadline:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
            extra += 1
        result["extra_requests"] = extra
    except Exception as exc:
        result["step_error"] = describe(exc)
    result.update(steps=steps, paths={rid: paths.get(rid) for rid in ids[:-1]})
    return result


def main() -> None:
    with open(sys.argv[1]) as fh:
        args = json.load(fh)
    from vllm import SamplingParams

    t0 = time.monotonic()
    llm = make_llm(args)
    startup = time.monotonic() - t0
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    result = run_round(llm, args["prompts"], sp)
    # A later request on the same engine: alive or not.
    later: dict[str, object] = {"ok": False, "error": None}
    try:
        out = llm.generate([{"prompt_token_ids": args["prompts"][0][:10]}], sp, use_tqdm=False)
        later["ok"] = bool(out and out[0].outputs)
    except Exception as exc:
        later["error"] = f"{type(exc).__name__}: {exc}"
    print(
        "HSFIX_ABORT_MP_RESULT "
        + json.dumps(
            {"startup_s": round(startup, 1), "round": result, "later": later}, default=str
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
