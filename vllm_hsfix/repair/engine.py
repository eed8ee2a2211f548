"""Running vLLM to regenerate hidden states: an engine of our own, or a running server.

:class:`LocalEngine` starts vLLM's offline ``LLM`` in this process (its engine core
and workers in theirs, as vLLM decides) with ``extract_hidden_states`` and
``ExampleHiddenStatesConnector`` writing into a scratch directory, exactly the set-up
that wrote the dataset, and sends the targets' token ids in batches of many prompts
(one engine per file format, never one per file; fp8 files through hs-connectors'
``FP8HiddenStatesConnector``, their own writer). Prefix caching is off: on
0.22-0.23 it cuts saved states short and on 0.25-0.28 it can skip writes
(``vllm_hsfix.hazards``). ``max_tokens=1``: only the prompt's states are wanted.

:class:`EndpointEngine` uses an already running ``vllm serve`` instead (the way
speculators generates data): one completion request per target with the token ids as
the prompt; the server's connector writes the file, whose path comes back in the
response's ``kv_transfer_params`` and must be readable here (a shared filesystem).

Either way a file is taken only once its writer has released the connector's
``.lock`` (the writer holds it exclusively until the file is complete).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..audit.scan import writer_holds_lock

WAIT_S = 300.0
FP8_CONNECTOR = ("FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector")


@dataclass
class EngineSpec:
    model: str
    aux_layers: tuple[int, ...]
    max_model_len: int
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    engine_args: dict[str, Any] = field(default_factory=dict)
    fp8: bool = False  # hs-connectors' FP8HiddenStatesConnector (speculators' fp8 backend)


def writer_done(path: str) -> bool:
    """The file exists and its writer no longer holds ``path.lock`` (no ``.lock``: it
    was written without the lock protocol, ``use_synchronization_lock`` off)."""
    return os.path.exists(path) and not writer_holds_lock(path)


class LocalEngine:
    """vLLM's ``LLM`` with the hidden-states connector writing into ``scratch``."""

    def __init__(self, spec: EngineSpec, scratch: str) -> None:
        self.spec = spec
        self.scratch = scratch
        self.llm: Any = None

    def kwargs(self) -> dict[str, Any]:
        s = self.spec
        kw: dict[str, Any] = {
            "model": s.model,
            "skip_tokenizer_init": True,
            "enable_prefix_caching": False,
            "enable_chunked_prefill": False,
            # No compilation: a repair sends each prompt once, and the compile (minutes on
            # vLLM's CPU build, inductor) costs more than it saves (--engine-arg
            # enforce_eager=false to compile anyway).
            "enforce_eager": True,
            "max_model_len": s.max_model_len,
            "tensor_parallel_size": s.tensor_parallel_size,
            "data_parallel_size": s.data_parallel_size,
            "seed": 0,
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": list(s.aux_layers)}
                },
            },
            "kv_transfer_config": {
                "kv_connector": "ExampleHiddenStatesConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self.scratch},
            },
        }
        if s.fp8:  # the files' own writer: hs-connectors' subclass of vLLM's connector
            kw["kv_transfer_config"].update(
                kv_connector=FP8_CONNECTOR[0], kv_connector_module_path=FP8_CONNECTOR[1]
            )
        kw.update(s.engine_args)
        return kw

    def start(self) -> None:
        from vllm import LLM

        self.llm = LLM(**self.kwargs())

    def generate(self, prompts: Sequence[list[int]]) -> list[str | None]:
        """The file each prompt's states went to (None: no file), once written."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=0.0)
        outs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False
        )
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        deadline = time.monotonic() + WAIT_S
        while not all(p is None or writer_done(p) for p in paths):
            if time.monotonic() > deadline:
                break
            # The connector finishes a write in a later engine step: give it one.
            self.llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
        return [p if p is not None and writer_done(p) else None for p in paths]

    def close(self) -> None:
        self.llm = None


class EndpointEngine:
    """A running ``vllm serve`` (with vllm-hsfix in it) at ``url``."""

    def __init__(self, url: str, model: str | None, timeout: float = WAIT_S) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = timeout

    def start(self) -> None:
        if self.model is None:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as r:
                self.model = json.load(r)["data"][0]["id"]

    def _one(self, ids: list[int]) -> str | None:
        body = json.dumps(
            {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        ).encode()
        req = urllib.request.Request(
            self.url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            doc = json.load(r)
        path = (doc.get("kv_transfer_params") or {}).get("hidden_states_path")
        deadline = time.monotonic() + self.timeout
        while path and not writer_done(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return path if path and writer_done(path) else None

    def generate(self, prompts: Sequence[list[int]]) -> list[str | None]:
        from concurrent.futures import ThreadPoolExecutor

        # Many requests in flight: the server batches them as it would any clients'.
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
            return list(pool.map(self._one, [list(p) for p in prompts]))

    def close(self) -> None:
        pass
