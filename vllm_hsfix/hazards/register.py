"""The register's rows (fields: ``hazards.Hazard``); each row's evidence, read from
the releases' files, and what was measured: ``docs/hazards.md``."""

from __future__ import annotations

from .model import (
    DATA,
    DOCUMENTED,
    PATCH,
    PROCESS,
    REFUSE_CONFIG,
    Hazard,
    range_of,
)

HAZARDS: tuple[Hazard, ...] = (
    Hazard(
        id="abort-before-scheduling",
        **range_of("abort-before-scheduling"),
        trigger=(
            "a request is aborted while it still waits, before the scheduler ever scheduled "
            "it: a client timeout, a cancelled asyncio task, a disconnect behind vllm serve, "
            "LLMEngine.abort_request"
        ),
        effect=(
            "KeyError in ExampleHiddenStatesConnector.request_finished: the engine core dies "
            "(every request of the job with it; behind vllm serve every client then fails). "
            "Declining that request in the connector alone moves the crash to the "
            "scheduler's `assert req_id in self.requests` one step later, because the worker "
            "still reports it as finished sending"
        ),
        loses=PROCESS,
        upstream="vllm-project/vllm#56841 (merged 2026-09-14)",
        action=PATCH,
        patch="abort-before-scheduling",
        why_action=(
            "a backport of both halves of 56841's effect: request_finished declines a request "
            "it has no file for, and the worker does not report it"
        ),
    ),
    Hazard(
        id="drafter-skip",
        first="0.25.0",
        fixed_in="0.29.0",
        trigger=(
            "prefix caching on; a request in decode; a new request whose prompt is "
            "max_model_len - 1 tokens long, all but the last served from the prefix cache "
            "(so max_model_len - 2 is a multiple of the KV block size)"
        ),
        effect=(
            "the scheduler pads that request's one token with the speculative token up to "
            "max_model_len itself; the worker's _input_fits_in_drafter then says no and the "
            "extract_hidden_states drafter, which writes the hidden states into the cache, "
            "does not run for ANY request of that step: the padded request's last row and "
            "every row of the other requests computed in that step are never written, and "
            "their files hold stale cache memory"
        ),
        loses=DATA,
        upstream="vllm-project/vllm#53962 (a crash fix upstream; first released in 0.29.0)",
        action=REFUSE_CONFIG,
        setting=(
            "enable_prefix_caching=False (--no-enable-prefix-caching), or a max_model_len "
            "(--max-model-len) with max_model_len - 2 not a multiple of the scheduler's KV "
            "block size (e.g. one less)"
        ),
        why_action=(
            "the fix is inside Scheduler.schedule's waiting loop (one condition in a 600-line "
            "method): no wrappable target. The trigger is a setting: prefix caching on and "
            "max_model_len - 2 a multiple of the scheduler's block size (with "
            "num_speculative_tokens n: a multiple of it in [max_model_len - 2n, "
            "max_model_len - 1 - n]), checked when the scheduler's connector is built"
        ),
        workaround=(
            "choose max_model_len so that max_model_len - 2 is not a multiple of the block "
            "size, or turn prefix caching off"
        ),
    ),
    Hazard(
        id="prefix-cache-slicing",
        first="0.22.0",
        fixed_in="0.24.0",
        trigger=(
            "prefix caching on (vLLM's default) and a prompt partly served from the prefix "
            "cache; also any step that schedules a new request together with others before "
            "it in the batch (decodes of running requests), and a prompt split by chunked "
            "prefill"
        ),
        effect=(
            "the connector cuts each new request's rows out of the step's slot mapping with "
            "the full prompt length and a running offset from 0: a file gets fewer rows than "
            "token_ids (issue 44485) or rows of another request"
        ),
        loses=DATA,
        upstream=(
            "vllm-project/vllm#44485 (open); the 0.24.0 rewrite saves from the request's "
            "own blocks at finish"
        ),
        action=REFUSE_CONFIG,
        setting="enable_prefix_caching=False (--no-enable-prefix-caching)",
        why_action=(
            "the fix is a different save design (0.24.0's, at request finish from its block "
            "ids): a backport would replace the whole connector. Prefix caching, vLLM's "
            "default and the trigger of issue 44485, is checked when the scheduler's "
            "connector is built; the batch-order and chunked-prefill cases stay documented"
        ),
        workaround=(
            "upgrade to 0.24.0 or later; on 0.22-0.23 run with enable_prefix_caching=False, "
            "enable_chunked_prefill=False and every prompt of a step new (offline batches), "
            "and check every file's row count against its token_ids"
        ),
    ),
    Hazard(
        id="aux-final-layer-dropped",
        **range_of("aux-final-layer"),
        models=(
            "models on vLLM's DeepseekV2Model backbone (model_executor/models/deepseek_v2.py): "
            "DeepSeek V2/V3/V3.2, Kimi K2 (and the text stacks of Kimi K2.5 and Kimi-VL), "
            "GlmMoeDsaForCausalLM, Mistral Large 3"
        ),
        trigger=(
            "eagle_aux_hidden_state_layer_ids contains num_hidden_layers (the last layer's output)"
        ),
        effect=(
            "the backbone captures aux states only at decoder-layer inputs, so that id "
            "matches nothing and N-1 states come back for N ids; the drafter's "
            "`hidden_states[:n] = torch.stack(states, 1)` into an [n, N, hidden] buffer then "
            "fails (N >= 3: RuntimeError, the engine dies at the first step) or, with N = 2, "
            "BROADCASTS the one captured state into both slots: files silently hold the "
            "same layer twice; N = 1 leaves no aux state at all (error)"
        ),
        loses=DATA,
        upstream="vllm-project/vllm#46973 (first released in 0.25.0)",
        action=PATCH,
        patch="aux-final-layer",
        why_action=(
            "a backport of 46973: the release's own DeepseekV2Model.forward with upstream's "
            "capture of the last layer's output (before the final norm) inserted where "
            "upstream puts it, installed as a plain function so vLLM's torch.compile traces it"
        ),
    ),
    Hazard(
        id="torn-files",
        **range_of("atomic-writes"),
        trigger=(
            "the writing process dies mid-write (OOM kill, SIGKILL, node loss) or the disk "
            "fills up, with safetensors < 0.8.0 (or a file system on which 0.8.0's rename "
            "fails, if its proposed in-place fallback, safetensors PR 793, lands)"
        ),
        effect=(
            "the writer thread calls save_file on the final path, which safetensors < 0.8.0 "
            "opens with O_TRUNC and fills in place: a truncated file stays where a complete "
            "one is expected (an earlier complete file there is destroyed), the kernel "
            "releases the dead writer's .lock, and a reader waiting on it reads the "
            "truncated file (safetensors refuses it); a job that checks only that the file "
            "exists counts the request as done. safetensors >= 0.8.0 (PR 764) writes a "
            "temporary file and renames it into place itself"
        ),
        loses=DATA,
        upstream="none in vLLM; safetensors PR 764 (0.8.0) makes save_file rename into place",
        action=PATCH,
        patch="atomic-writes",
        why_action=(
            "beyond upstream, on by default: the release's writer writes a temporary file in "
            "the same directory, then fsync, os.replace, and only then the lock is released; "
            "also covers safetensors < 0.8.0 and adds the fsync 0.8.0 does not promise"
        ),
        workaround="safetensors >= 0.8.0 on a file system that supports rename",
    ),
    Hazard(
        id="torn-files-in-step",
        first="0.17.0",
        fixed_in=None,
        ends="0.22.0",
        trigger="as torn-files: the worker dies mid-write with safetensors < 0.8.0",
        effect=(
            "0.17.0-0.21.x save synchronously inside the step (save_kv_layer) to the final "
            "path, with no .lock at all: a truncated file is indistinguishable from a "
            "complete one until it is loaded"
        ),
        loses=DATA,
        upstream="none; 0.22.0 moved the save to a writer thread with a .lock (still in place)",
        action=DOCUMENTED,
        why_action=(
            "a different writer (inside save_kv_layer, per step) than the one atomic-writes "
            "wraps; not patched"
        ),
        workaround="safetensors >= 0.8.0, which renames into place itself",
    ),
    Hazard(
        id="cpu-amx-gdn-conv-state",
        first="0.22.0",
        fixed_in="0.26.0",
        models=(
            "hybrid models with GDN layers (gated delta net: Qwen3-Next, Qwen3.5/3.6 and "
            "their -A3B MoE models), on vLLM's CPU build on a CPU with AMX (Intel Xeon "
            "Sapphire Rapids and later)"
        ),
        trigger=(
            "vLLM's CPU build on a CPU where torch.cpu._is_amx_tile_supported() is True, a "
            "verifier with GDN layers and any speculative config (extract_hidden_states "
            "counts as one speculative token): the GDN conv state is allocated "
            "width - 1 + num_speculative_tokens columns wide"
        ),
        effect=(
            "the CPU GDN op hands that conv state to the AMX path's causal-conv kernels "
            "(causal_conv1d_fwd_cpu for prefill, causal_conv1d_update_cpu for decode), whose "
            "`CHECK_EQ(conv_states.size(2), width - 1)` is a TORCH_CHECK: RuntimeError in the "
            "worker's model forward at the first prefill that reaches a GDN layer (start-up's "
            "profile run has no attention metadata and skips the op), and the engine core dies "
            "with every request; no file is written. A RuntimeError, not an abort. Without "
            "AMX vLLM takes its torch path, which handles the wider state"
        ),
        loses=PROCESS,
        upstream=(
            "vllm-project/vllm#46090 (CPU speculative decoding for GDN models; first "
            "released in 0.26.0); 0.27.0's kernels take the wide state themselves (#48577)"
        ),
        action=PATCH,
        patch="cpu-gdn-wide-conv-state",
        why_action=(
            "the kernels get the batch's first width - 1 positions of the wide state, staged "
            "in a scratch state of their layout and written back (the positions upstream's "
            "wide-state path uses)"
        ),
        workaround=(
            "upgrade to 0.26.0 or later (no vLLM setting of 0.22-0.25 selects the torch "
            "path), or run on a CPU that does not report AMX (docs/hazards.md)"
        ),
    ),
)
