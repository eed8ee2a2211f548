"""The package's one exception type, at the bottom so every layer can raise it.

Imported by ``import vllm_hsfix`` in every process: no imports here (not even
``from __future__``, a module like any other; see ``tests/test_import_cost.py``)."""


class HsfixError(RuntimeError):
    """The fix cannot be put in place and the user asked to be told by an exception:
    strict mode (``VLLM_HSFIX_STRICT=1``), or an integrity path that fails closed."""
