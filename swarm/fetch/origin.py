"""The model's origin: HTTP(S) URLs of the unmodified upstream files, read in byte ranges.

``Origin(base)`` reads ``<base>/<relpath>`` (a Hugging Face ``.../resolve/<revision>`` URL is
such a base). Every read is a ``Range: bytes=a-(b-1)`` GET; a server that ignores Range and
answers 200 with the whole file is handled by skipping to ``a`` in the stream and closing it at
``b`` (counted: the skipped bytes are fetched too, so ``received`` shows the cost). A cut
connection resumes from the last byte received, up to ``retries`` times. A bearer token comes
from ``HF_TOKEN`` (never printed). httpx is the only HTTP library here; its errors become
:class:`FetchError` naming the URL.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Iterator
from urllib.parse import quote

import httpx

from swarm.errors import ModelError

CHUNK = 1 << 20
TIMEOUT_S = 30.0  # connect and between bytes: an origin silent this long has failed
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class FetchError(ModelError):
    """A model's bytes could not be fetched, or are not the bytes the manifest names."""


class Origin:
    """Ranged reads from one base URL; ``received`` counts every body byte that arrived."""

    def __init__(self, base: str, *, token: str | None = None, retries: int = 3,
                 transport: httpx.BaseTransport | None = None) -> None:  # fmt: skip
        self.base = base.rstrip("/")
        token = token if token is not None else os.environ.get("HF_TOKEN") or None
        headers = {"User-Agent": "shard-swarm", "Accept-Encoding": "identity"}  # byte ranges of the file itself
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.client = httpx.Client(headers=headers, timeout=TIMEOUT_S, follow_redirects=True, transport=transport)
        self.retries = retries
        self.received = 0
        self.ranges_ignored = 0  # answers of 200 to a Range request
        self._sizes: dict[str, int | None] = {}

    def __repr__(self) -> str:
        return f"Origin({self.base!r})"  # never the token

    def url(self, path: str) -> str:
        return f"{self.base}/{quote(path)}"

    def close(self) -> None:
        self.client.close()

    def size(self, path: str) -> int | None:
        """The file's length (None: the origin has no such file)."""
        if path not in self._sizes:
            try:
                r = self.client.head(self.url(path))
            except httpx.HTTPError as e:
                raise FetchError(f"{self.url(path)}: {type(e).__name__}: {e}") from None
            if r.status_code == 404:
                self._sizes[path] = None
            elif r.status_code >= 400:
                raise FetchError(f"{self.url(path)}: HTTP {r.status_code}{_hint(r.status_code)}")
            else:
                length = r.headers.get("x-linked-size") or r.headers.get("content-length")
                if length is None:
                    raise FetchError(f"{self.url(path)}: the origin does not say the file's length")
                self._sizes[path] = int(length)
        return self._sizes[path]

    def stream(self, path: str, start: int, end: int, on_bytes: Callable[[int], None] | None = None) -> Iterator[bytes]:
        """Bytes [start, end) of ``path`` in chunks, resuming after a cut connection."""
        pos, attempt = start, 0
        while pos < end:
            try:
                for chunk in self._one_stream(path, pos, end):
                    pos += len(chunk)
                    attempt = 0
                    if on_bytes is not None:
                        on_bytes(len(chunk))
                    yield chunk
                if pos < end:
                    raise httpx.RemoteProtocolError(f"the answer ended at byte {pos} of [{start}, {end})")
            except (httpx.TransportError, httpx.RemoteProtocolError) as e:
                attempt += 1
                if attempt > self.retries:
                    raise FetchError(f"{self.url(path)}: bytes [{pos}, {end}): {type(e).__name__}: {e} "
                                     f"(gave up after {self.retries} retries)") from None  # fmt: skip
                time.sleep(min(0.2 * 2**attempt, 2.0))

    def _one_stream(self, path: str, start: int, end: int) -> Iterator[bytes]:
        url = self.url(path)
        with self.client.stream("GET", url, headers={"Range": f"bytes={start}-{end - 1}"}) as r:
            if r.status_code == 206:
                m = _RANGE.fullmatch(r.headers.get("content-range", ""))
                if m is None or int(m.group(1)) != start:
                    raise FetchError(f"{url}: asked for bytes from {start}, got Content-Range "
                                     f"{r.headers.get('content-range')!r}")  # fmt: skip
                skip = 0
            elif r.status_code == 200:  # Range ignored: the whole file comes; skip to start
                self.ranges_ignored += 1
                skip = start
            elif r.status_code == 416:
                raise FetchError(f"{url}: bytes [{start}, {end}) are past the end of the origin's file (has it changed?)")
            else:
                raise FetchError(f"{url}: HTTP {r.status_code}{_hint(r.status_code)}")
            want = end - start
            for chunk in r.iter_bytes(CHUNK):
                self.received += len(chunk)
                if skip:
                    cut = min(skip, len(chunk))
                    chunk, skip = chunk[cut:], skip - cut
                if not chunk:
                    continue
                chunk = chunk[:want]
                want -= len(chunk)
                yield chunk
                if want == 0:
                    return

    def read(self, path: str, start: int, end: int) -> bytes:
        return b"".join(self.stream(path, start, end))

    def hash_ranges(self, path: str, ranges: list[tuple[int, int]]) -> list[str]:
        """sha256 of each range, from one streamed pass over the file (to build a manifest)."""
        if not ranges:
            return []
        lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
        hs = [hashlib.sha256() for _ in ranges]
        pos = lo
        for chunk in self.stream(path, lo, hi):
            a0, b0 = pos, pos + len(chunk)
            for h, (a, b) in zip(hs, ranges, strict=True):
                if a < b0 and b > a0:
                    h.update(chunk[max(a, a0) - a0 : min(b, b0) - a0])
            pos = b0
        return [h.hexdigest() for h in hs]


def _hint(status: int) -> str:
    if status in (401, 403):
        return " (a gated or private model: set HF_TOKEN to a token that may read it)"
    if status == 404:
        return " (no such file at the origin: check the invite's origin URL and revision)"
    return ""
