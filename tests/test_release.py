"""What a user installs from: the licence, and every link to a release derived from
pyproject's version (docs/release.md: the tag `v<version>` is a release step)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# The files a user reads links in: the docs, the README and the manifests.
LINKED = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "deploy").rglob("*.yaml")]
REF = re.compile(r"\?ref=([^\s)\"'`]+)")
GITHUB = re.compile(r"https://github\.com/kvpilot/kvpilot/(?:blob|tree)/([^/\s]+)/([^\s)\"'`#]+)")


def test_the_licence_is_apache_2_in_full() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "9. Accepting Warranty or Additional Liability." in text
    assert "END OF TERMS AND CONDITIONS" in text
    license_field = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert license_field == "Apache-2.0"


def test_every_ref_and_github_link_names_this_versions_tag() -> None:
    tag = f"v{VERSION}"
    refs = [(p, m.group(1)) for p in LINKED for m in REF.finditer(p.read_text())]
    links = [(p, m.group(1), m.group(2)) for p in LINKED for m in GITHUB.finditer(p.read_text())]
    assert refs, "docs/deploy.md names the Component by ?ref="
    assert [(str(p), r) for p, r in refs if r != tag] == []
    assert [(str(p), r) for p, r, _ in links if r != tag] == []
    # Each blob or tree link points at a path that exists in this checkout.
    assert [(str(p), path) for p, _, path in links if not (ROOT / path).exists()] == []


def test_the_release_note_names_the_tag_as_a_step() -> None:
    assert f"tag v{VERSION}" in (ROOT / "docs" / "release.md").read_text()


def test_the_image_carries_the_labels_a_registry_shows() -> None:
    """The built image's values are checked in tests/pods/test_base_pod.py."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    for key in ("created", "url", "documentation", "base.name", "source", "version", "revision"):
        assert f"org.opencontainers.image.{key}=" in dockerfile, key
    assert "KVPILOT_CREATED=${created}" in (ROOT / "scripts" / "build-image").read_text()
