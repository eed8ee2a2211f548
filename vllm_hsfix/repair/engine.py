"""The repair's vLLM process: ``python -m vllm_hsfix.repair.engine JOB.json``.

A process of its own, so that ``VLLM_HSFIX_STATUS_DIR`` is set before vllm-hsfix
activates and the guard runs where vLLM runs. It starts vLLM's offline ``LLM`` with
``extract_hidden_states`` and the hidden-states connector writing into a scratch
directory (the set-up that wrote the dataset), or uses a running ``vllm serve``
(``--endpoint``: the file's path comes back in ``kv_transfer_params``), and sends the
targets' token ids in batches; a file is taken once its writer released its ``.lock``.

It tells the repair what happens on stdout, one JSON object per line (vLLM's own
stdout goes to stderr, the log); the reader ignores a line cut short by a kill::

    {"event": "bad_arg", "key": K, "why": W}  vLLM has no engine argument K, or
                                              rejected its value (exit 2)
    {"event": "guard", "problems": [...]}     the engine started; problems: the fix
                                              is not active there (exit 3)
    {"event": "file", "index": I, "path": P}  prompt I's new file (P null: none)
    {"event": "done"}                         every prompt answered

It stops between batches when the repair is gone (exit 4); :mod:`.watch` ends it
(exit 5) when one of vLLM's processes dies under it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import IO, Any

from .files import writer_done

WAIT_S = 300.0
FP8_CONNECTOR = ("FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector")
# Exceptions of vLLM's argument and config checks: a user's value among them is named.
REJECTED = ("ValueError", "TypeError", "ValidationError", "AssertionError")


def llm_kwargs(spec: dict[str, Any], scratch: str) -> dict[str, Any]:
    """vLLM's ``LLM`` arguments: no prefix caching (0.22-0.23 cut saved states short,
    0.25-0.28 can skip writes), no compilation (each prompt runs once), then the
    engine settings over them."""
    connector = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": scratch},
    }
    if spec["fp8"]:
        connector.update(kv_connector=FP8_CONNECTOR[0], kv_connector_module_path=FP8_CONNECTOR[1])
    aux = {"eagle_aux_hidden_state_layer_ids": list(spec["aux"])}
    return {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "enforce_eager": True,
        "max_model_len": spec["max_len"],
        "tensor_parallel_size": spec["tensor_parallel_size"],
        "data_parallel_size": spec["data_parallel_size"],
        "seed": 0,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": aux},
        },
        "kv_transfer_config": connector,
        **spec["engine_args"],
    }


class LocalEngine:
    def __init__(self, kwargs: dict[str, Any]) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(**kwargs)
        self.params = SamplingParams(max_tokens=1, temperature=0.0)

    def generate(self, prompts: Sequence[list[int]]) -> list[str | None]:
        """The file each prompt's states went to (None: no file), once written."""
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False
        )
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        deadline = time.monotonic() + WAIT_S
        while not all(p is None or writer_done(p) for p in paths) and time.monotonic() < deadline:
            # The connector finishes a write in a later engine step: give it one.
            self.llm.generate([{"prompt_token_ids": [1, 2, 3]}], self.params, use_tqdm=False)
        return [p if p is not None and writer_done(p) else None for p in paths]


class EndpointEngine:
    def __init__(self, url: str, model: str | None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        if model is None:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as r:
                self.model = json.load(r)["data"][0]["id"]

    def _one(self, ids: list[int]) -> str | None:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        req = urllib.request.Request(
            self.url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            path = (json.load(r).get("kv_transfer_params") or {}).get("hidden_states_path")
        deadline = time.monotonic() + WAIT_S
        while path and not writer_done(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return path if path and writer_done(path) else None

    def generate(self, prompts: Sequence[list[int]]) -> list[str | None]:
        from concurrent.futures import ThreadPoolExecutor

        # Many requests in flight: the server batches them as it would any clients'.
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
            return list(pool.map(self._one, prompts))


def unknown_args(user: dict[str, object]) -> list[tuple[str, str]]:
    """The user's engine arguments that vLLM's ``LLM`` / ``EngineArgs`` do not take."""
    import dataclasses
    import difflib
    import inspect

    import vllm
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    known |= set(inspect.signature(vllm.LLM.__init__).parameters) - {"self", "kwargs"}
    out = []
    for key in (k for k in user if k not in known):
        near = difflib.get_close_matches(key, sorted(known), n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        version = getattr(vllm, "__version__", "?")
        out.append((key, f"vLLM {version} has no engine argument {key!r}{hint}"))
    return out


def rejected(exc: BaseException, user: dict[str, object]) -> tuple[str, str] | None:
    """(key, vLLM's message) when ``exc`` is vLLM rejecting one of the user's values."""
    import re

    if not any(t in type(exc).__name__ for t in REJECTED):
        return None
    for key in user:
        if re.search(rf"\b{re.escape(key)}\b", str(exc)):
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            return key, f"{type(exc).__name__}: " + " / ".join(lines[:4])
    return None


def channel() -> Callable[..., None]:
    """``send(event=..., ...)`` on this process's stdout; fd 1 then points at stderr,
    so that nothing vLLM prints can fall between two messages."""
    out: IO[str] = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)

    def send(**msg: Any) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    return send


def main(argv: list[str]) -> int:
    from .guard import in_engine
    from .watch import EngineWatch

    with open(argv[0], encoding="utf-8") as f:
        job = json.load(f)
    send, parent, user = channel(), os.getppid(), job["user_args"]
    engine: LocalEngine | EndpointEngine
    if job["endpoint"]:
        engine = EndpointEngine(job["endpoint"], job["served"])
    else:
        bad = unknown_args(user)
        for key, why in bad:
            send(event="bad_arg", key=key, why=why)
        if bad:
            return 2
        try:
            engine = LocalEngine(job["kwargs"])
        except Exception as exc:
            if found := rejected(exc, user):
                send(event="bad_arg", key=found[0], why=found[1])
            raise
    problems = [] if job["endpoint"] else in_engine(job["status_dir"], job["needed"])
    send(event="guard", problems=problems)
    if problems:
        return 3
    watch = EngineWatch()  # a vLLM process killed under us must not leave us waiting
    if not job["endpoint"]:
        watch.start()
    try:
        prompts, size = job["prompts"], job["batch_size"]
        for start in range(0, len(prompts), size):
            if os.getppid() != parent:
                return 4  # the repair was killed: stop, leave nothing running
            for k, path in enumerate(engine.generate(prompts[start : start + size])):
                send(event="file", index=start + k, path=path)
    except BaseException:
        watch.tell()  # vLLM raised because one of its processes died: which, and how
        raise
    finally:
        watch.stop()
    send(event="done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
