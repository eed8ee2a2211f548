"""One in-process vLLM engine driven through aborts before scheduling; prints
``HSFIX_ABORT_RESULT {json}``. With ``max_num_seqs=1`` the third of three prompts is aborted
before any step, in rounds ``release``, ``patched`` and ``request-finished-only`` (last: it
breaks the engine)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from support.extraction import kv_transfer_config, speculative_config
from support.lockfile import written

CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def describe(exc: BaseException) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "function": last.name if last else None,
        "file": os.path.basename(last.filename) if last else None,
        "line": last.line if last else None,
        "functions": [f.name for f in frames],
    }


def run_round(engine: Any, tag: str, prompts: list[list[int]], sp: Any) -> dict[str, Any]:
    """Queue every prompt, abort the last while it still waits (``max_num_seqs=1``: before
    any step, so it was never scheduled), then step until the others' files are written."""
    ids = [f"{tag}-r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    result: dict[str, Any] = {"aborted": ids[-1], "abort_error": None, "step_error": None}
    try:
        engine.abort_request([ids[-1]])
    except Exception as exc:
        result["abort_error"] = describe(exc)
    paths: dict[str, str | None] = {}
    steps = 0
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            waiting = [r for r in ids[:-1] if r not in paths]
            files = [p for p in paths.values() if p]
            if not waiting and all(written(p) for p in files):
                # A few more steps: the worker's report of the writes reaches the scheduler.
                for _ in range(3):
                    engine.step()
                    steps += 1
                break
            for out in engine.step():
                if out.finished:
                    paths[out.request_id] = (out.kv_transfer_params or {}).get("hidden_states_path")
            steps += 1
    except Exception as exc:
        result["step_error"] = describe(exc)
    result.update(
        steps=steps,
        paths={rid: paths.get(rid) for rid in ids[:-1]},
        aborted_output=ids[-1] in paths,
    )
    return result


def switch(cls: type, on: dict[str, bool]) -> dict[str, bool]:
    """Turn the patch's wrapper on each named method on or off; return what is live."""
    from vllm_hsfix.patches._wrap import ours_in
    from vllm_hsfix.patches.abort_before_scheduling import fix as abort_unscheduled

    live = {}
    for name in abort_unscheduled.METHODS:
        wrapper = ours_in(cls.__dict__.get(name), abort_unscheduled.PATCH_ID)
        if wrapper is None:
            live[name] = False
            continue
        wrapper.hsfix_set_active(on[name])
        live[name] = wrapper.hsfix_active
    return live


def make_llm(args: dict[str, Any]) -> Any:
    """The engine: ``max_num_seqs=1``, the tiny model, the connector."""
    from vllm import LLM

    return LLM(
        model=args["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_model_len=256,
        max_num_seqs=1,
        seed=0,
        speculative_config=speculative_config(args["aux_ids"]),
        kv_transfer_config=kv_transfer_config(args["out"]),
    )


def main() -> None:
    with open(sys.argv[1]) as fh:
        args = json.load(fh)
    import vllm_hsfix
    from vllm_hsfix.patches.abort_before_scheduling import fix as abort_unscheduled

    vllm_hsfix.apply()
    from vllm import SamplingParams

    t0 = time.monotonic()
    llm = make_llm(args)
    startup = time.monotonic() - t0
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = args["prompts"]
    cls = sys.modules[CONNECTOR].ExampleHiddenStatesConnector
    statuses = {k: v["status"] for k, v in vllm_hsfix.status()["patches"].items()}
    off = dict.fromkeys(abort_unscheduled.METHODS, False)
    on = dict.fromkeys(abort_unscheduled.METHODS, True)
    rounds: dict[str, Any] = {"release": {"live": switch(cls, off)}}
    rounds["release"].update(run_round(engine, "a", prompts, sp))
    rounds["patched"] = {"live": switch(cls, on)}
    rounds["patched"].update(run_round(engine, "b", prompts, sp))
    if args.get("half"):
        half = {**off, "request_finished": True}
        rounds["request-finished-only"] = {"live": switch(cls, half)}
        rounds["request-finished-only"].update(run_round(engine, "c", prompts, sp))
    print(
        "HSFIX_ABORT_RESULT "
        + json.dumps(
            {"startup_s": round(startup, 1), "patches": statuses, "rounds": rounds}, default=str
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
