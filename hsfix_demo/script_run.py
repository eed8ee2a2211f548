"""The demo's user-script case: a user's plain extraction script, run as they run it.

``hsfix_demo/user_script.py`` is what such a script looks like (no vllm-hsfix
import, no stand-ins); this module runs it with and without vllm-hsfix and compares its
files row by row with the transformers reference, as the engine cases do
(:mod:`.e2e`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import tiny_model
from .e2e import RUN_TIMEOUT_S, USER_SCRIPT, compare, prompts, reference, supervise

# "saved PATH tokens N hidden_states (N, L, H)", one line per prompt (user_script.py).
SAVED_LINE = re.compile(r"^saved (\S+) tokens (\d+) hidden_states ")
# An exception as vLLM logs it, with or without its process prefix and log header:
# "(Worker pid=1) ERROR 12-01 01:33:42 [multiproc_executor.py:1000] TypeError: ...".
ERROR_LINE = re.compile(r"(?:^|\] |^\(\w+ pid=\d+\) )((?:[\w.]+\.)?\w*(?:Error|Exception): .+)$")
# A traceback frame in the connector's file: 'File ".../example_hidden_states_connector.py",
# line 337, in save_kv_layer'.
CONNECTOR_FRAME = re.compile(r'example_hidden_states_connector\.py", line \d+, in (\w+)')


@dataclass
class ScriptRun:
    """One run of the user's script: how it ended, its files, and their comparison."""

    vllm: str
    hsfix: bool  # vllm-hsfix active (else VLLM_HSFIX_DISABLE=1)
    rc: int | None
    wall_s: float
    files: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # distinct exception lines, in order
    connector_frames: list[str] = field(default_factory=list)  # connector functions in them
    killed: str | None = None
    statuses: list[dict[str, Any]] = field(default_factory=list)
    comparison: dict[str, Any] = field(default_factory=dict)
    log: str = ""
    pid: int = 0

    @property
    def ok(self) -> bool:
        """The script ended normally and every row of every file matches the reference."""
        c = self.comparison
        return (
            self.rc == 0
            and bool(c)
            and c["rows"] > 0
            and c["rows_correct"] == c["rows"]
            and c["requests_correct"] == c["requests"]
        )

    def summary(self) -> str:
        who = "vllm-hsfix active" if self.hsfix else "VLLM_HSFIX_DISABLE=1"
        if self.comparison:
            c = self.comparison
            return (
                f"vLLM {self.vllm}, {who}: exit {self.rc}, {c['requests_correct']}/"
                f"{c['requests']} files and {c['rows_correct']}/{c['rows']} rows correct, "
                f"max rel err {c['max_rel_err']:.4f}, {self.wall_s:.0f} s"
            )
        cause = self.errors[0] if self.errors else (self.killed or "no error line logged")
        return f"vLLM {self.vllm}, {who}: FAILED (exit {self.rc}): {cause}, {self.wall_s:.0f} s"


def error_lines(text: str) -> list[str]:
    """The distinct exception lines of a log, first seen first."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        m = ERROR_LINE.search(line.strip())
        if m:
            seen.setdefault(m.group(1).strip(), None)
    return list(seen)


def run_user_script(
    *,
    hsfix: bool,
    workdir: Path,
    models: Path,
    kind: str = "dense",
    aux_ids: tuple[int, ...] = (1, 2, 3),
    timeout: float = RUN_TIMEOUT_S,
) -> ScriptRun:
    """Run ``user_script.py`` as a user would: its own interpreter, no harness plugin,
    only the environment a CPU needs (``VLLM_CPU_KVCACHE_SPACE``) and, for the run
    without vllm-hsfix, ``VLLM_HSFIX_DISABLE=1``. Its files are compared row by row
    with the transformers reference (same threshold as the cases).
    The run is exactly what a user's machine does."""
    from safetensors.torch import load_file

    from vllm_hsfix import detect

    inst = detect.detect()
    model = tiny_model.build(models / kind, kind)
    batch = prompts(count=2)
    tag = "with-hsfix" if hsfix else "without-hsfix"
    out_dir = Path(tempfile.mkdtemp(prefix=f"user-script-{tag}-", dir=workdir))
    (out_dir / "prompts.json").write_text(json.dumps(batch))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_HSFIX_", "HSFIX_"))}
    env.pop("VLLM_PLUGINS", None)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        VLLM_HSFIX_STATUS_DIR=str(out_dir / "status"),
        TOKENIZERS_PARALLELISM="false",
    )
    if not hsfix:
        env["VLLM_HSFIX_DISABLE"] = "1"
    cmd = [
        sys.executable,
        str(USER_SCRIPT),
        str(model),
        str(out_dir / "hs"),
        str(out_dir / "prompts.json"),
        "--layers",
        ",".join(map(str, aux_ids)),
    ]
    log = out_dir / "run.log"
    t0 = time.monotonic()
    pid, rc, killed = supervise(cmd, env, log, timeout)
    text = log.read_text(errors="replace") if log.exists() else ""
    run = ScriptRun(
        inst.version or "?",
        hsfix,
        rc,
        round(time.monotonic() - t0, 1),
        files=[m.group(1) for m in map(SAVED_LINE.match, text.splitlines()) if m],
        errors=error_lines(text),
        connector_frames=list(dict.fromkeys(CONNECTOR_FRAME.findall(text))),
        killed=killed,
        log=str(log),
        pid=pid,
    )
    for f in sorted((out_dir / "status").glob("*.json")):
        st = json.loads(f.read_text())
        run.statuses.append(
            {
                "role": st["role"],
                "patches": {k: v["status"] for k, v in st["patches"].items()},
                "verify": st.get("verify"),
            }
        )
    if rc == 0 and len(run.files) == len(batch):
        saved = [load_file(p) for p in run.files]
        run.comparison = compare(saved, reference(model, batch, aux_ids), batch, aux_ids)
    return run
