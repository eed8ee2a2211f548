"""``python -m vllm_hsfix.audit PATH...`` is ``vllm-hsfix audit PATH...``."""

import sys

from .command import main

sys.exit(main())
