"""``import_status.py MODULE``: vllm-hsfix active, vLLM's ``MODULE`` imported (strict mode
raises here when a row cannot apply), then this process's ``vllm_hsfix.status()`` as
the last line, as JSON."""

from __future__ import annotations

import importlib
import json
import sys

import vllm_hsfix

importlib.import_module(sys.argv[1])
print(json.dumps(vllm_hsfix.status(), default=str))
