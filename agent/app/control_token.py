"""The control API's bearer token, read again when its file changes.

Kubernetes rotates a mounted Secret by swapping the file (a symlink flip): the token is
compared against what the file holds now. Each check looks at the file's identity (device,
inode, size, modification time, a cheap ``stat``) and reads it again when that changed;
SIGHUP reads it again whatever the stat says. A file that cannot be read, or is empty,
disables the control API until it can (fail closed): the old token never stays valid.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from pathlib import Path
from typing import Literal

from pydantic import SecretStr

from kvpilot.collectors.safe_files import MAX_TOKEN_FILE_BYTES, UnsafeFile, read_small_file

log = logging.getLogger(__name__)

TokenCheck = Literal["ok", "disabled", "refused"]


class ControlToken:
    """What a POST must carry: a fixed token, or the one a file holds at the time of asking."""

    def __init__(self, token: SecretStr | None = None, token_file: Path | None = None) -> None:
        self._fixed = token
        self._file = token_file
        self._lock = threading.Lock()
        self._seen: tuple[int, ...] | None = None
        self._current: SecretStr | None = None
        self.problem: str | None = None  # why a token file gives no token, when it does not

    @property
    def configured(self) -> bool:
        return self._fixed is not None or self._file is not None

    def current(self) -> SecretStr | None:
        """The token valid now (the file is read again when it changed); None: disabled."""
        if self._file is None:
            return self._fixed
        try:
            st = os.stat(self._file)
            identity: tuple[int, ...] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError as exc:
            return self._failed(None, f"cannot read {self._file}: {exc.strerror or exc}")
        with self._lock:
            if identity == self._seen:
                return self._current
        return self._read(identity)

    def reread(self) -> None:
        """Forget what was read (SIGHUP): the next check reads the file again."""
        with self._lock:
            self._seen = None

    def check(self, authorization: str) -> TokenCheck:
        """Whether an `Authorization` header value is the bearer token (in constant time)."""
        token = self.current()
        if token is None:
            return "disabled"
        expected = f"Bearer {token.get_secret_value()}"
        return "ok" if hmac.compare_digest(authorization.encode(), expected.encode()) else "refused"

    def disabled_reason(self) -> str:
        if not self.configured:
            return "the control API is disabled: configure api.token"
        return "the control API is disabled: api.token_file gives no token"

    def _read(self, identity: tuple[int, ...]) -> SecretStr | None:
        assert self._file is not None
        try:  # a FIFO or a device there must not hang the API nor fill memory
            data = read_small_file(self._file, MAX_TOKEN_FILE_BYTES)
        except UnsafeFile as exc:
            return self._failed(identity, f"{self._file} is {exc.strerror}")
        except OSError as exc:
            return self._failed(identity, f"cannot read {self._file}: {exc.strerror or exc}")
        text = data.decode("utf-8", errors="replace").strip()
        if not text:
            return self._failed(identity, f"{self._file} is empty")
        with self._lock:
            changed = self._current is not None and self._seen is not None
            self._seen, self._current = identity, SecretStr(text)
            if self.problem is not None or changed:
                log.info("control API: the token was read again from %s", self._file)
            self.problem = None
            return self._current

    def _failed(self, identity: tuple[int, ...] | None, problem: str) -> SecretStr | None:
        """Disabled until the file gives a token again; says why once per problem."""
        with self._lock:
            if problem != self.problem:
                log.warning("control API: disabled until its token file is readable: %s", problem)
            self._seen, self._current, self.problem = identity, None, problem
        return None


def control_token(token: ControlToken | SecretStr | None) -> ControlToken:
    """A `ControlToken` for what a caller gives (a fixed token or none, in tests)."""
    return token if isinstance(token, ControlToken) else ControlToken(token)
