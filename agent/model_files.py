"""Where the served model's `config.json` is, for the planner: the configured path, else the
folder `--model` names (a mounted model), else the Hugging Face cache's snapshot of the model
id (the cache volume the sidecar mounts read-only).

The cache is laid out as the `huggingface_hub` library writes it:
`HUB/models--ORG--NAME/refs/REVISION` holds a commit hash, and
`HUB/models--ORG--NAME/snapshots/HASH/config.json` the file. HUB is `HF_HUB_CACHE` (or the
older `HUGGINGFACE_HUB_CACHE`), else `HF_HOME/hub`, where `HF_HOME` defaults to
`XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

CONFIG = "config.json"
# A revision names a ref or a commit; nothing in it may climb out of the cache's folders.
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


class ModelConfigNotFound(ValueError):
    """No config.json in any place looked; the message lists them all."""

    def __init__(self, model: str | None, looked: list[str]) -> None:
        where = "; ".join(looked) or "nowhere (no model and no model_config)"
        super().__init__(
            f"cannot find the config.json of model {model!r}: looked at {where}. Set "
            "runtime.model_config, mount the model folder, or mount the Hugging Face cache "
            "(HF_HOME) into kvpilot's container"
        )
        self.looked = tuple(looked)


def hub_cache(environ: Mapping[str, str], home: Path) -> Path:
    """The Hugging Face hub cache folder, as `huggingface_hub` resolves it."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(name):
            return Path(environ[name]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    xdg = environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else home / ".cache") / "huggingface" / "hub"


def find_model_config(
    model: str | None,
    *,
    configured: Path | None = None,
    revision: str | None = None,
    environ: Mapping[str, str],
    home: Path,
) -> Path:
    """The model's config.json: `configured` (a file or its folder) when given, else in the
    folder `model` names, else in the hub cache's snapshot of `model` at `revision` (a ref,
    `main` by default, or a commit hash). Raises ModelConfigNotFound listing every place."""
    looked: list[str] = []
    if configured is not None:
        path = configured / CONFIG if configured.is_dir() else configured
        if path.is_file():
            return path
        looked.append(f"{path} (runtime.model_config)")
        raise ModelConfigNotFound(model, looked)  # a configured path that is wrong is wrong
    if not model:
        raise ModelConfigNotFound(model, looked)
    folder = Path(model).expanduser()
    if (folder / CONFIG).is_file():
        return folder / CONFIG
    looked.append(f"{folder / CONFIG} (--model as a folder)")
    repo = _repo_folder(model)
    if repo is None:
        raise ModelConfigNotFound(model, looked)
    hub = hub_cache(environ, home)
    found = _snapshot_config(hub / repo, revision or "main", looked)
    if found is None:
        raise ModelConfigNotFound(model, looked)
    return found


def _repo_folder(model: str) -> str | None:
    """`models--ORG--NAME` for a model id `ORG/NAME` (or `NAME`); None for anything else."""
    parts = model.split("/")
    if len(parts) > 2 or not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", p) for p in parts):
        return None
    return "models--" + "--".join(parts)


def _snapshot_config(repo: Path, revision: str, looked: list[str]) -> Path | None:
    if not _REVISION.match(revision) or ".." in revision.split("/"):
        looked.append(f"{repo} (revision {revision!r} is not a ref or commit)")
        return None
    ref = repo / "refs" / revision
    commit = revision
    if ref.is_file():
        commit = ref.read_text(errors="replace").strip()
    else:
        looked.append(f"{ref} (the Hugging Face cache's ref)")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", commit):
        looked.append(f"{ref} (holds no commit hash)")
        return None
    path = repo / "snapshots" / commit / CONFIG
    if path.is_file():
        return path
    looked.append(f"{path} (the Hugging Face cache's snapshot)")
    return None
