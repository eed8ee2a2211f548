"""Only what pyproject.toml cannot say: ship ``vllm_hsfix_dist.pth`` at the top of
site-packages (the ``cpu-dist-name`` row: ``vllm serve`` on vLLM's CPU build), in
wheels and in editable installs alike."""

from __future__ import annotations

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "vllm_hsfix_dist.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    """build_py, plus the .pth file at the root of the build (= site-packages)."""

    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass: dict[str, type] = {"build_py": BuildPyWithPth}
try:
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        """An editable install's wheel gets the .pth too: setuptools writes into the
        wheel whatever lies in its unpacked directory, which this hook is handed."""

        def _install_namespaces(self, installation_dir: str, pth_prefix: str) -> None:
            super()._install_namespaces(installation_dir, pth_prefix)
            shutil.copy(os.path.join(HERE, PTH), os.path.join(installation_dir, PTH))

    cmdclass["editable_wheel"] = EditableWheelWithPth
except ImportError:  # setuptools < 64: no PEP 660 editable wheels
    pass

setup(cmdclass=cmdclass)
