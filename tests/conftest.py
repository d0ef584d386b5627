"""Shared fixtures: real CPU vLLM servers, one per configuration, shared across tests."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
from collections.abc import Iterator

import pytest

from kvpilot.rig.server import ServerSpec, VllmServer, free_kvpool_port, free_port

# Tiny-llama KV cost: 2 layers * 2 (K and V) * 2 KV heads * 64 head dim * 2 bytes = 1 KiB a
# token, so a 32-token block is 32 KiB.
KV_BYTES_PER_BLOCK = 32 * 1024

# Enough blocks that a moderate load never preempts.
ROOMY = ServerSpec(port=0, kv_cache_memory_bytes=64 * 1024 * 1024)
# 64 blocks of 32 KiB (63 usable, block 0 is the null block), through vLLM's real sizing
# path: 64 requests of ~200 tokens preempt heavily.
PREEMPTING = ServerSpec(port=0, kv_cache_memory_bytes=64 * KV_BYTES_PER_BLOCK)


# What the suite needs from the machine; ./scripts/setup installs all of it.
REQUIRED_COMMANDS = ("promtool", "prometheus")
REQUIRED_ONE_OF = (("prometheus-alertmanager", "alertmanager"),)
REQUIRED_MODULES = ("vllm", "jsonschema", "hypothesis", "pyte")


def pytest_sessionstart(session: pytest.Session) -> None:
    """In CI nothing may be skipped for want of a tool: a missing one fails the run at once."""
    if not os.environ.get("CI"):
        return
    missing = [c for c in REQUIRED_COMMANDS if shutil.which(c) is None]
    missing += [" or ".join(g) for g in REQUIRED_ONE_OF if not any(map(shutil.which, g))]
    missing += [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(
            f"CI needs {', '.join(missing)}: run ./scripts/setup (the README's test command does)"
        )


@pytest.hookimpl(tryfirst=True)  # before -m selects: `-m quiet` sees the marks added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests that want the machine quiet `quiet` and puts them last (a stable sort
    keeps every module's order): the shared servers then close once, not after each.

    `scripts/test` runs the others on two workers with `--dist loadscope`, which keeps each
    module's tests (a class's, in a class) together and in order, in one worker that starts
    their fixtures once. Not `loadgroup`: with pytest 9.2 its `xdist_group` marks no longer
    take effect (xdist 3.8 writes the group into `item._nodeid`, which pytest no longer
    reads; pytest-xdist issue 1386), so one module's tests were dealt to both workers."""
    for item in items:
        if "quiet_machine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.quiet)
    items.sort(key=lambda item: item.get_closest_marker("quiet") is not None)


class ServerPool:
    """Starts each configuration once per session and keeps at most `keep` of them alive."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._servers: dict[ServerSpec, VllmServer] = {}

    def get(self, template: ServerSpec) -> VllmServer:
        if template in self._servers:
            server = self._servers.pop(template)
            self._servers[template] = server  # most recently used last
            if server.process is not None and server.process.poll() is None:
                return server
            server.stop()
            del self._servers[template]
        while len(self._servers) >= self.keep:
            oldest = next(iter(self._servers))
            self._servers.pop(oldest).stop()
        spec = dataclasses.replace(template, port=free_port(), kvpool_port=free_kvpool_port())
        server = VllmServer(spec)
        server.start()
        try:
            server.wait_healthy()
        except BaseException:
            server.stop()
            raise
        self._servers[template] = server
        return server

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    pool = ServerPool()
    yield pool
    pool.close()


@pytest.fixture
def quiet_machine(server_pool: ServerPool) -> None:
    """No shared server idles beside a test that measures latency on pinned cores."""
    server_pool.close()


@pytest.fixture
def vllm_server(server_pool: ServerPool) -> VllmServer:
    """A real CPU vLLM with the kvpool plugin and a roomy KV pool."""
    return server_pool.get(ROOMY)


@pytest.fixture
def preempting_vllm_server(server_pool: ServerPool) -> VllmServer:
    """A real CPU vLLM with the kvpool plugin and 63 usable KV blocks: load preempts."""
    return server_pool.get(PREEMPTING)
