"""The register's rows (the fields: ``hazards.model.Hazard``; what each means: the
``hazards`` package docstring)."""

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
        evidence=(
            "0.24.0 CONN:480, 0.25.0-0.28.0 CONN:523, 0.29.0 CONN:518, 0.30.0 CONN:520: "
            "`self._request_filenames.pop(req_id)` without a default; file names are "
            "recorded only for scheduled_new_reqs (0.24.0 CONN:443-463)",
            "0.24.0 v1/core/sched/scheduler.py:2057 (_free_request -> _connector_finished -> "
            "request_finished for an aborted waiting request), :2060 (its id into "
            "finished_req_ids), :2446-2449 (`assert req_id in self.requests` for each "
            "finished_sending id); 0.24.0 CONN:527-531 (get_finished reports every finished "
            "id without a copy event)",
            "0.31.0 CONN:532-538 (pop with a default, return False, None) and CONN:587-593 "
            "(get_finished reports only requests with a copy): the fix",
            "not affected: 0.17.0-0.21.0 pop with a default and never hold blocks (0.17.0 "
            "CONN:326-330, no get_finished); 0.22.0-0.23.0 pop with a default, hold every "
            "request and report it (0.22.0 CONN:458-481)",
        ),
        measured=(
            "vllm-cpu 0.24.0 and 0.25.0, in-process engine, tiny dense Qwen3, max_num_seqs=1, "
            "three 50-token prompts, the third aborted before any step: unpatched KeyError "
            "from request_finished (in finish_requests); patched no error, the two other files "
            "50 rows, their own token ids, every row within 0.01 of a transformers forward; "
            "connector half alone: AssertionError in Scheduler._update_from_kv_xfer_finished "
            "(tests/test_hazards_e2e.py)"
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
        evidence=(
            "0.25.0 v1/core/sched/scheduler.py:812-826, 0.26.0 :843-857, 0.27.0 :881-895, "
            "0.28.0 :934-948: pad to 1 + num_spec_tokens unless "
            "num_computed_tokens + num_new_tokens > max_model_len",
            "0.25.0 v1/worker/gpu_model_runner.py:4440-4453 (_input_fits_in_drafter: "
            "max_seq_len + num_spec_tokens <= max_model_len) and :4534-4570 (the drafter runs "
            "only when it fits); the same in 0.26.0-0.28.0 (:4481, :4537, :4652)",
            "0.29.0 scheduler.py:961-977 (and 0.30.0-0.33.0): pad only when num_computed + 1 + "
            "num_spec + num_sampled_tokens_per_step <= max_model_len: the fix",
            "not affected: 0.17.0-0.24.0 have no such padding; their running requests are "
            "capped at max_model_len - 1 (0.24.0 scheduler.py:470-478)",
        ),
        measured=(
            "vllm-cpu 0.25.0, in-process engine, tiny dense Qwen3, block size 16, "
            "max_model_len 66, prefix caching on (tests/test_hazards_e2e.py, prefix case): "
            "P (65 tokens, 64 cached) was scheduled with 2 tokens beside R's decode and Q's "
            "20-token prefill, _input_fits_in_drafter answered False for that step, and "
            "P's file had its last position wrong (3 of 195 rows) and Q's file all 20 "
            "positions (60 of 60 rows) against a transformers forward; W, S, R right. "
            "The same prompts on 0.24.0: P scheduled with 1 token, every file right. "
            "refuse-config: that 0.25.0 engine start logs one WARNING naming the hazard, "
            "--no-enable-prefix-caching and --max-model-len 65; 0.24.0 logs none; with "
            "VLLM_HSFIX_STRICT=1 the start fails with HsfixError (tests/test_refuse_config.py)"
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
        evidence=(
            "0.22.0 CONN:344-351 (slot_mapping[offset:offset + num_tokens] over the step's "
            "slot mapping, num_tokens = the full prompt) and CONN:423-432 (only "
            "scheduled_new_reqs, token_ids = prompt_token_ids); 0.23.0's file is identical",
            "0.22.0 config/vllm.py:738-746: VllmConfig refuses chunked prefill with this "
            "connector (--no-enable-chunked-prefill is required there)",
            "not this mechanism: 0.17.0-0.21.0 build each request's slot mapping from its own "
            "block ids (0.17.0 CONN:64-72, :265-274); 0.24.0+ save at finish from the "
            "request's block ids (0.24.0 CONN:308-330, :495-500)",
        ),
        measured=(
            "vllm-cpu 0.22.0, the same run as drafter-skip's (tests/test_hazards_e2e.py): "
            "S (65 tokens, 64 from the prefix cache, alone in its step) saved 1 row for 65 "
            "token ids; in the step with R's decode, P (1 new token) saved 23 rows for 65 "
            "token ids and Q 0 rows for 20; W and R (nothing cached, alone) right. On 0.24.0 "
            "and 0.25.0 the same S, P (0.24.0) and Q (0.24.0) files are right. "
            "refuse-config: that 0.22.0 engine start logs one WARNING naming the hazard and "
            "--no-enable-prefix-caching; strict mode fails the start (tests/test_refuse_config.py)"
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
        evidence=(
            "0.18.0 model_executor/models/deepseek_v2.py:1239, 0.21.0/0.22.0 :1313, 0.23.0 "
            ":1328, 0.24.0 :1339: `if idx in self.aux_hidden_state_layers` before each layer "
            "only; 0.25.0 :1489 (0.26.0-0.33.0 likewise) adds the final layer's output",
            "0.17.0 deepseek_v2.py captures no aux states at all (the family cannot be an "
            "extraction target there: a start-up error, not data)",
            "0.22.0 v1/spec_decode/extract_hidden_states.py:120-124, 0.24.0 :125-129: "
            "torch.stack then slice assignment into the [tokens, N, hidden] buffer",
            "tensor parallelism before 0.25.0: 0.24.0 deepseek_v2.py:369-386, the "
            "sequence-parallel MoE gathers its output back to all tokens before the layer "
            "returns, so captured states are whole; 0.25.0's all-gather (:1462-1469) "
            "matches its own new between-layer sharding",
        ),
        measured=(
            "vllm-cpu 0.24.0, tiny DeepSeek-V3 (4 dense layers, VLLM_MLA_DISABLE=1: the CPU "
            "build has no MLA): aux ids [1, 2, 3, 4] kill the worker at the first prefill "
            "(RuntimeError: The expanded size of the tensor (4) must match the existing size "
            "(3)); [2, 4] write files whose two slots are identical. Patched, both write what "
            "vllm-cpu 0.25.0 writes for the same prompts (tests/test_aux_final_layer.py)"
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
        evidence=(
            "0.22.0 CONN:280-298 and 0.24.0 CONN:277-295 (_write_tensors: event.synchronize(), "
            "save_file(tensors, filename), then close the lock fd in finally); the same code "
            "through 0.33.0 (fingerprint 12f890abe9d72188 in 0.22.0-0.33.0)",
            "strace of save_file on a path that exists: safetensors 0.7.0 "
            "openat(path, O_WRONLY|O_CREAT|O_TRUNC); 0.8.0 openat(dir/.tmpXXXXXX, O_EXCL) then "
            "renameat onto the path",
        ),
        measured=(
            "the release's _write_tensors killed mid-write (SIGXFSZ at a 1 MB file-size "
            "limit, 8 MB of tensors, an older complete file at the path): with safetensors "
            "0.7.0's in-place write the path holds a 1 MB truncated file; patched, the older "
            "file is intact and only a temporary file is left; with safetensors 0.8.0 the "
            "release alone already leaves the older file intact (tests/test_hazards.py)"
        ),
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
        evidence=(
            "0.17.0 CONN:209-217: save_kv_layer calls safetensors.torch.save_file on the "
            "final path, synchronously, no lock",
        ),
        measured="not measured: read from source; the safetensors behaviour is torn-files'",
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
            "wide-state path uses); shown on the real kernels of an AMX Xeon: the release's "
            "kernel refuses the wide state, the patched one gives exactly what the release's "
            "gives on a narrow state. Not shown end to end there: on that machine vLLM's "
            "chunk_gated_delta_rule_cpu then dies with SIGILL in every hybrid run, without "
            "vllm-hsfix and without a speculative method too (hsfix_demo/cpu_support.py)"
        ),
        workaround=(
            "vLLM's CPU build on an AMX CPU only: upgrade to 0.26.0 or later. No vLLM setting "
            "of 0.22-0.25 selects the torch path: the GDN op calls "
            "torch.cpu._is_amx_tile_supported() itself, envs.py has no ISA switch, and the CPU "
            "platform sets VLLM_SSM_CONV_STATE_LAYOUT=SD on AMX over any user value (DS would "
            "fail the AMX path too). Otherwise run on a CPU (or VM CPU model) that does not "
            "report AMX, or make torch.cpu._is_amx_tile_supported answer False in every vLLM "
            "process before vLLM reads it (a vllm.general_plugins plugin, as this project's "
            "CPU harness does), which also moves vLLM's CPU attention, MoE and linear kernels "
            "off AMX (slower) and leaves prefix caching and chunked prefill at vLLM's non-AMX "
            "defaults"
        ),
        evidence=(
            "0.22.0 GDN:59-60 (`if torch.cpu._is_amx_tile_supported():` to "
            "cpu_gdn_attention_core_amx), :220-225 (the SD conv state transposed, no width "
            "check), :254 causal_conv1d_update_cpu, :300 causal_conv1d_fwd_cpu",
            "0.23.0-0.25.0 GDN (one file, sha256 18b557576422...): :60 "
            "`is_amx = torch.cpu._is_amx_tile_supported()`, :101 causal_conv1d_update_cpu, "
            ":162 causal_conv1d_fwd_cpu, both on the whole conv state",
            "0.22.0-0.25.0 model_executor/layers/mamba/mamba_utils.py:224-226 (conv state "
            "`conv_kernel_size - 1 + num_spec` wide); 0.24.0 models/qwen3_next.py:855-867 "
            "(num_spec = speculative_config.num_speculative_tokens); platforms/cpu.py sets "
            "VLLM_SSM_CONV_STATE_LAYOUT=SD on AMX (0.22.0 :230-231, 0.23.0-0.24.0 :240-241, "
            "0.25.0 :233-234); 0.24.0 envs.py: no ISA or AMX switch among the VLLM_CPU_* "
            "variables",
            "0.25.0 sdist csrc/cpu/sgl-kernels/conv.cpp:589 (causal_conv1d_fwd_cpu) and :693 "
            "(causal_conv1d_update_cpu): CHECK_EQ(conv_states.size(2), width - 1); "
            "sgl-kernels/common.h:188: CHECK_EQ is a TORCH_CHECK (a RuntimeError)",
            "0.26.0 GDN:64 (`spec_decode_cache = state_len > (width - 1)`): a wider state goes "
            "to a torch-only path, the AMX kernels only at width - 1 (:102): the fix; "
            "0.27.0-0.30.0 :68, 0.31.0 :166, 0.32.0 :172, 0.33.0 :190 the same check, and "
            "from 0.27.0 the wide state goes to the kernels (0.27.0 GDN:416-436, "
            "num_accepted_tokens in _custom_ops), which accept it (0.31.0 conv.cpp:673, :780, "
            "0.32.0-0.33.0 :685, :792 CHECK_GE(state_len, width - 1))",
            "not affected: 0.17.0-0.20.0 have no GDN file and no causal_conv1d_*_cpu op in "
            "_custom_ops.py; 0.21.0 GDN is torch only (:88 causal_conv1d_update_torch, :152 "
            "causal_conv1d_torch, no AMX branch)",
        ),
        measured=(
            "the dispatch on an AMX CPU and the engine's death: not measured here (no AMX on "
            "the machines this project runs on); read from source. The kernels' check, "
            "measured by a one-off script (not in the suite) calling vllm-cpu's own _C.abi3.so "
            "ops directly on this AVX-512-BF16 CPU without AMX, SD conv state of 64 channels, "
            "width 4: 0.24.0's causal_conv1d_update_cpu and causal_conv1d_fwd_cpu run with 3 "
            "columns and raise RuntimeError `CHECK_EQ(conv_states.size(2), width - 1) failed. "
            "4 vs 3` with 4 (the process lives on); 0.32.0's run with both. On a 2-core Xeon "
            "with AMX (KVM guest), vllm-cpu 0.24.0: the engine dies at the first prompt of the "
            "tiny Qwen3.5 hybrid with that RuntimeError (unpatched); with the patch the "
            "convolution passes, and the next AMX kernel (chunk_gated_delta_rule_cpu) dies "
            "with SIGILL, as it does without vllm-hsfix and without a speculative method"
        ),
    ),
)
