"""The embedded default for ``vllm-hsfix demo`` and the end-to-end tests: tiny
random-weight verifiers built offline with ``transformers`` (no hub access)."""
