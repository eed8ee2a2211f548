"""The package version, in a module of its own so any layer can read it without
importing the package's ``__init__`` (which activates the package)."""

__version__ = "0.3.0"
