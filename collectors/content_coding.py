"""A scraped body's Content-Encoding undone within the body's size cap.

Scrapes ask for ``identity``, yet some servers compress all the same. gzip (and its old name
x-gzip) and deflate (zlib-wrapped as the RFC says, or raw as some servers send it) are
inflated as the body arrives, never past the cap: a decompression bomb costs at most the
cap's worth of output, then the read stops. Output comes in slices of `SLICE_BYTES`, so
that the caller can let its event loop run between them (16 MiB inflate in about 60-180 ms
here; a slice in a few). One coding only: a stack of codings would
multiply what a small body can cost, and no exporter sends one.
"""

from __future__ import annotations

import zlib

_GZIP_WBITS = 16 + zlib.MAX_WBITS
_ZLIB_WBITS = zlib.MAX_WBITS
_RAW_WBITS = -zlib.MAX_WBITS
_CODINGS = {"gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}
SLICE_BYTES = 1 << 20


class EncodingError(ValueError):
    """The body is not what its Content-Encoding says, or the coding is not supported."""


class InflatedTooLarge(Exception):
    """The body inflates past the cap; `seen` says how far the read went."""

    def __init__(self, seen: str) -> None:
        super().__init__(seen)
        self.seen = seen


def inflater_for(content_encoding: str | None, cap: int) -> Inflater | None:
    """The inflater for a response's Content-Encoding; None when the body is as sent.
    Raises EncodingError for a coding this client does not undo."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in _CODINGS:
        shown = ", ".join(codings)[:64]
        raise EncodingError(
            f"the body is sent with Content-Encoding {shown!r}; only one of gzip or deflate "
            "is undone (identity is asked for)"
        )
    return Inflater(_CODINGS[codings[0]], cap)


class Inflater:
    """Inflates one body piece by piece; the output never grows past `cap` + 1 bytes."""

    def __init__(self, coding: str, cap: int) -> None:
        self.coding = coding
        self._cap = cap
        self._produced = 0
        self._fed = False
        self._pending = b""  # deflate: the first bytes, until the zlib header can be told
        self._tail = b""  # input not inflated yet: the last slice was full
        self.more = False  # `feed(b"")` has more output for what was fed
        self._inflate: zlib._Decompress | None = (
            zlib.decompressobj(_GZIP_WBITS) if coding == "gzip" else None
        )

    def feed(self, data: bytes) -> bytes:
        """At most a slice of output for the next piece of the body; while `more` is set,
        `feed(b"")` gives the next slice."""
        self._fed = self._fed or bool(data)
        if self._inflate is None:
            self._pending += data
            if len(self._pending) < 2:
                return b""
            data, self._pending = self._pending, b""
            self._inflate = zlib.decompressobj(_ZLIB_WBITS if _zlib_header(data) else _RAW_WBITS)
        inflate = self._inflate
        if inflate.eof:
            if data:
                raise EncodingError(f"bytes follow the end of the {self.coding} stream")
            return b""
        ask = min(self._cap - self._produced + 1, SLICE_BYTES)  # a byte past the cap: a bomb
        try:
            out = inflate.decompress(self._tail + data, ask)
        except zlib.error as e:
            raise EncodingError(
                f"the body says Content-Encoding {self.coding} but is not {self.coding} data ({e})"
            ) from None
        self._produced += len(out)
        if self._produced > self._cap:
            raise InflatedTooLarge(f"it inflates past {self._cap} bytes")
        self._tail = inflate.unconsumed_tail
        # a full slice may leave output inside zlib even when all input was taken
        self.more = not inflate.eof and (bool(self._tail) or len(out) == ask)
        if inflate.eof and inflate.unused_data:
            raise EncodingError(f"bytes follow the end of the {self.coding} stream")
        return out

    def finish(self) -> bytes:
        """The output still held, once the whole body was fed; a cut stream is an error."""
        if not self._fed:
            return b""  # no body at all: nothing was encoded
        out = self.feed(b"") if self._pending else b""
        if self._inflate is None or not self._inflate.eof:
            raise EncodingError(f"the {self.coding} stream ends before its end")
        return out


def _zlib_header(data: bytes) -> bool:
    """Whether `data` starts as a zlib stream (RFC 1950: deflate method, checksum of 31)."""
    return data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
