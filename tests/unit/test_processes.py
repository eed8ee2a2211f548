"""Activation reaches the processes vLLM and users start (real vLLM 0.24.0)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import clean_env, cli_rows_as_declared, declared_all, last_json
from support.commands import cli
from support.procs import child

pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("scatter-clamp")]

HERE = Path(__file__).resolve().parents[1]
CHILD = str(HERE / "support" / "children" / "processes.py")


def test_vllm_hsfix_run_reaches_the_child_and_the_grandchild() -> None:
    out = cli("run", "--", sys.executable, CHILD, "--child")
    data = last_json(out.stdout)
    assert data["active"] and data["sources"][0] == "bootstrap"
    assert cli_rows_as_declared(data["patches"]) == declared_all()
    grandchild = data["child"]
    assert grandchild["pid"] != data["pid"]
    assert grandchild["active"] and grandchild["sources"][0] == "bootstrap"
    assert cli_rows_as_declared(grandchild["patches"]) == declared_all()


def test_a_users_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    marker = tmp_path / "marker.txt"
    (user / "sitecustomize.py").write_text(
        f"import os\nopen({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
    )
    env = clean_env()
    env["PYTHONPATH"] = f"{user}{os.pathsep}{env['PYTHONPATH']}"
    out = cli("run", "--", sys.executable, CHILD, "--child", env=env)
    data = last_json(out.stdout)
    pids = marker.read_text().split()
    # Once per interpreter, never twice in one: the `vllm-hsfix run` interpreter itself,
    # the command it execs (same pid), and the grandchild. The chain does not recurse.
    assert pids == [str(data["pid"]), str(data["pid"]), str(data["child"]["pid"])]
    assert (
        cli_rows_as_declared(data["patches"]) == declared_all()
        and cli_rows_as_declared(data["child"]["patches"]) == declared_all()
    )


def test_a_broken_user_sitecustomize_is_reported_and_activation_goes_on(tmp_path: Path) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("raise RuntimeError('user sitecustomize is broken')\n")
    env = clean_env()
    env["PYTHONPATH"] = f"{user}{os.pathsep}{env['PYTHONPATH']}"
    out = cli("run", "--", sys.executable, CHILD, env=env)
    assert "user sitecustomize is broken" in out.stderr
    assert cli_rows_as_declared(last_json(out.stdout)["patches"]) == declared_all()


def test_vllm_plugins_leaving_us_out_is_said_once_and_the_plugin_does_not_load() -> None:
    out = child("startup.py", "plugins", env=clean_env(VLLM_PLUGINS="some_other_plugin"))
    data = last_json(out.stdout)
    assert "plugin" not in data["sources"]  # vLLM honoured the allow-list
    assert out.stderr.count("VLLM_PLUGINS='some_other_plugin' leaves out 'vllm_hsfix'") == 1
