"""``nested-text-config``: the drafter's config keeps the verifier's nested text_config
as a config object, so ``SpeculativeConfig`` builds for Qwen3-VL, Gemma 3 multimodal and
Llama 4 verifiers (docs/patches.md). Goes when: 0.19.x is no longer supported.
"""

from __future__ import annotations

import ast
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._probe import class_def, expect, finds, fingerprints, params, probes
from .._wrap import Replacement, wrap
from ..hooks import Hooks

PATCH_ID = "nested-text-config"
ATTRIBUTE, METHOD = "ExtractHiddenStatesConfig", "__init__"


# The fix, 0.20.0's rule: where the verifier's config is a config object whose text
# config is a distinct object, that object (not the dict ``to_dict()`` made of it) is
# the new config's ``text_config``.
def nested_text_config(model: Any) -> Any:
    """The verifier config's own nested text config, or None (none, or not an object)."""
    from transformers import PretrainedConfig

    if not isinstance(model, PretrainedConfig):
        return None
    text = model.get_text_config()
    return None if text is model else text


def _installed(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    model = kwargs["model"] if "model" in kwargs else (args[0] if args else None)
    out = wrapped(*args, **kwargs)
    text = nested_text_config(model)
    if text is not None:
        instance.text_config = text
    return out


def apply(module: Any, shape: str, hooks: Hooks) -> list[Replacement]:
    return [wrap(getattr(module, ATTRIBUTE), METHOD, _installed, PATCH_ID)]


# The gate for code of no tested build: 0.17-0.19's __init__ (the model's dict merged
# with the keyword arguments, then ``super().__init__``, the text config never put back).
SHAPE = "flattened"


def shape_check(tree: ast.Module) -> Probe:
    fn = method(class_def(tree, ATTRIBUTE), METHOD)
    if fn is None:
        return Probe(None, detail=f"no method {ATTRIBUTE}.{METHOD} in the module")
    if finds(fn, "_.get_text_config()") or finds(fn, "_['text_config']"):
        return Probe(None, fixed=True, detail="the nested text config is put back")
    return expect(
        SHAPE,
        "a nested text_config flattened to a dict",
        {
            f"{METHOD}(self, model, method, **kwargs)": params(fn)
            == ("self", "model", "method", "**kwargs"),
            "model.to_dict() merged into super().__init__(**...)": finds(fn, "model.to_dict()")
            and any(
                isinstance(n, ast.Call)
                and ast.unparse(n.func) == "super().__init__"
                and [k.arg for k in n.keywords] == [None]
                for n in ast.walk(fn)
            ),
        },
    )


TARGET = f"{ATTRIBUTE}.{METHOD}"
probe_tree, probe = probes(
    PATCH_ID, lambda tree: fingerprints(tree, (TARGET,)), shape_check, (TARGET,)
)


def check_text_config(module: Any) -> list[str]:
    """The live config built from a composite verifier config (transformers' LLaVA with
    a Llama text config): vLLM's own ``get_hf_text_config`` must find its attention heads."""
    from transformers import LlavaConfig
    from vllm.transformers_utils.config import get_hf_text_config

    text = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128}  # fmt: skip
    verifier = LlavaConfig(text_config=text)
    config = getattr(module, ATTRIBUTE)(verifier, eagle_aux_hidden_state_layer_ids=[1])
    got = get_hf_text_config(config)
    if getattr(got, "num_attention_heads", None) != 4:
        return [f"the text config is a {type(got).__name__}, without its attention heads"]
    return []


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    name = f"{ATTRIBUTE} keeps a composite verifier's text config an object"
    return checks.one(name, lambda: check_text_config(module))
