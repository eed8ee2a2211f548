"""Child programs: real files, run by path in a fresh interpreter (``support.procs``)
or imported by child processes (``processes``). They import the ``support`` package,
so the ``tests`` directory is on their ``sys.path``."""
