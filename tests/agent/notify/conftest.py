"""Fixtures for the notifier tests: a real HTTP receiver and a real Alertmanager."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.notify.alertmanager_server import AlertmanagerServer, find_binary
from tests.agent.notify.notify_receiver import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertmanagerServer]:
    binary = find_binary()
    if binary is None:
        pytest.skip("prometheus-alertmanager is not installed")
    server = AlertmanagerServer(binary, Path(tmp_path_factory.mktemp("alertmanager")))
    server.start()
    yield server
    server.stop()
