"""Every vLLM the rig launches asks for AMX first: `kvpilot rig serve` (`build_env`) and
`kvpilot demo` (its instance's env) put the packaged hook on the child's PYTHONPATH, without
the scripts' help, and the wheel carries the hook."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvpilot.agent.cli.demo.scenario import demo_config
from kvpilot.rig.amx_hook import AMX_HOOK_DIR, with_amx_hook
from kvpilot.rig.server import ServerSpec, build_env

ROOT = Path(__file__).resolve().parents[2]
HOOK = AMX_HOOK_DIR / "sitecustomize.py"
WHICH_SITECUSTOMIZE = "import sitecustomize; print(sitecustomize.__file__)"


def _environ_without_pythonpath() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _sitecustomize_of_a_child(env: dict[str, str]) -> Path:
    """The `sitecustomize` a Python started with `env` runs, as it says itself."""
    done = subprocess.run(
        [sys.executable, "-c", WHICH_SITECUSTOMIZE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip()).resolve()


def test_rig_serve_puts_the_hook_first_on_the_childs_pythonpath() -> None:
    base = {**_environ_without_pythonpath(), "PYTHONPATH": "/opt/elsewhere"}
    env = build_env(ServerSpec(port=8000), base=base)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(AMX_HOOK_DIR), "/opt/elsewhere"]
    assert _sitecustomize_of_a_child(env) == HOOK.resolve()


def test_the_demos_server_gets_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)  # as run outside scripts/demo
    config = demo_config(
        listen_port=8474,
        server_port=8000,
        kvpool_port=8001,
        canary_port=8002,
        state_dir="/tmp/unused",
        webhook_url="http://127.0.0.1:9/hook",
        webhook_secret="s" * 32,
        cpus=None,
    )
    (instance,) = config["runtime"]["instances"]
    # The local runtime adds an instance's env to its own environment.
    env = {**_environ_without_pythonpath(), **instance["env"]}
    assert _sitecustomize_of_a_child(env) == HOOK.resolve()


def test_the_hook_is_put_on_the_path_once() -> None:
    hook = str(AMX_HOOK_DIR)
    twice = with_amx_hook(os.pathsep.join(["/a", hook, "", "/b"]))
    assert twice.split(os.pathsep) == [hook, "/a", "/b"]
    assert with_amx_hook(None) == hook


def test_the_wheel_carries_the_hook() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    rig_folder = ROOT / setuptools["package-dir"]["kvpilot.rig"]
    packaged = HOOK.resolve().relative_to(rig_folder.resolve()).as_posix()
    patterns = setuptools["package-data"]["kvpilot.rig"]
    assert any(fnmatch.fnmatch(packaged, pattern) for pattern in patterns), patterns
