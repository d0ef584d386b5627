"""The images the pod tests run: a Debian base, and the shipped image built from it.

No container registry is reachable here, so the `Dockerfile`'s base image (its build
argument PYTHON_IMAGE) is made from Debian's packages with mmdebstrap; everything else is
built as a user builds it, by `scripts/build-image`. Each image is tagged with a hash of its
inputs and built once per machine: while the inputs are unchanged it is reused.

`python -m tests.pods.images` builds both; `scripts/test` runs it beside the unit tests, and
the pod tests' fixture waits on the same lock instead of building twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.pods.podman import CACHE, ROOT, environment, image_exists, podman

# The stand-in for python:3.11-slim-bookworm. libnuma1 and libstdc++6 are for the vLLM
# container, which runs the suite's own virtualenv from this base; /root is made traversable
# so that an interpreter under /root (pyenv's) can be mounted for a non-root UID.
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-pip", "python3-venv", "libnuma1", "libstdc++6")
BASE_HOOK = 'chmod 755 "$1/root"'
BASE_ENV = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    # Debian marks its Python externally managed; the Dockerfile installs with pip as the
    # python image allows.
    "ENV PIP_BREAK_SYSTEM_PACKAGES=1",
)
# What the Dockerfile's build copies, plus the Dockerfile and the script that runs it.
BUILD_INPUTS = ("Dockerfile", "scripts/build-image", "pyproject.toml", "README.md")
BUILD_TREES = ("kvpilot_ns", "collectors", "rig", "tuner", "dashboards", "agent")
# pip inside the build reaches the package registry only with this machine's pip settings
# and CA bundle, mounted read-only (folders that do not exist are left out).
PIP_MOUNTS = ("/etc/xdg/pip", "/etc/pip.conf", "/etc/ssl/certs")


@dataclass(frozen=True, slots=True)
class Images:
    base: str
    kvpilot: str


def _digest(parts: list[bytes]) -> str:
    sha = hashlib.sha256()
    for part in parts:
        sha.update(len(part).to_bytes(8, "big") + part)
    return sha.hexdigest()[:16]


def base_image() -> str:
    recipe = [BASE_SUITE, *BASE_PACKAGES, BASE_HOOK, *BASE_ENV]
    return f"localhost/kvpilot-test-base:{_digest([r.encode() for r in recipe])}"


def kvpilot_image(base: str) -> str:
    files = [ROOT / name for name in BUILD_INPUTS]
    for tree in BUILD_TREES:
        files += sorted(
            p for p in (ROOT / tree).rglob("*") if p.is_file() and "__pycache__" not in p.parts
        )
    parts = [base.encode()]
    for path in files:
        parts += [str(path.relative_to(ROOT)).encode(), path.read_bytes()]
    return f"localhost/kvpilot-test:{_digest(parts)}"


def _build_base(tag: str) -> None:
    with tempfile.TemporaryDirectory(prefix="kvpilot-base-") as tmp:
        tar = Path(tmp) / "base.tar"
        subprocess.run(
            [
                "mmdebstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                f"--customize-hook={BASE_HOOK}",
                BASE_SUITE,
                str(tar),
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        changes = [arg for env in BASE_ENV for arg in ("--change", env)]
        podman("import", *changes, str(tar), tag, timeout=300)


def _build_kvpilot(tag: str, base: str) -> None:
    mounts = [f"-v={p}:{p}:ro" for p in PIP_MOUNTS if Path(p).exists()]
    result = subprocess.run(
        [
            str(ROOT / "scripts" / "build-image"),
            "--tag",
            tag,
            "--",
            "--runtime",
            "runc",
            "--network",
            "host",
            "--build-arg",
            f"PYTHON_IMAGE={base}",
            *mounts,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=environment(),
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"scripts/build-image failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )


def ensure_images() -> Images:
    """Both images, built now unless an earlier build (this run's or a past one) made them."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a build in progress elsewhere is waited for
        base = base_image()
        if not image_exists(base):
            _build_base(base)
        kvpilot = kvpilot_image(base)
        if not image_exists(kvpilot):
            _build_kvpilot(kvpilot, base)
        return Images(base=base, kvpilot=kvpilot)


if __name__ == "__main__":
    images = ensure_images()
    print(f"images ready: {images.base} {images.kvpilot}", file=sys.stderr)
