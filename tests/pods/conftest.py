"""The pod tests: the images built once (or found built), podman's readiness checked."""

from __future__ import annotations

import os

import pytest

from tests.pods.images import Images, ensure_images
from tests.pods.podman import podman_missing


@pytest.fixture(scope="session")
def images() -> Images:
    if reason := podman_missing():
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the pod tests: {reason}")
        pytest.skip(reason)
    return ensure_images()
