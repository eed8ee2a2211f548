"""The demo (``python3 scripts/demo.py``, ``python -m hsfix_demo``) and the end-to-end
tests' harness: tiny random-weight verifiers built offline with ``transformers`` (no hub
access), engine runs, the comparison. Beside the package, not in its wheel."""
