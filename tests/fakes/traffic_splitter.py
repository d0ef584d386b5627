"""A weighted HTTP splitter on loopback: the tests' stand-in for a Service's kube-proxy or a
Gateway's HTTPRoute data plane.

It reads its weights from the fake API server (tests/fakes/k8s_apiserver.py) as the real
data planes read theirs from the real one: a Service's Endpoints (an equal share per ready
address, as kube-proxy spreads connections), or an HTTPRoute's first rule (each backendRef's
weight, spread over its Service's ready addresses; a backend with none answers 503 for its
share). It re-reads them every `poll_s` (0.1 s), keeping the last table when the API server
does not answer, and forwards each request, streamed responses (server-sent events) as they
come, to a backend picked by smooth weighted round robin (deterministic, so shares are
exact over a few requests). `counts` says how many requests each backend was sent.
It does none of the rest: no sessions, retries, health checks or connection reuse.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.http_helpers import ServedInThread, send_json

NO_ENDPOINTS = "no endpoints"  # the count key of requests answered 503
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


class TrafficSplitter(ServedInThread):
    """One Service (`service=`) or one HTTPRoute (`route=`) of the fake, served on loopback."""

    def __init__(
        self,
        api_host: str,
        namespace: str,
        *,
        service: str | None = None,
        route: str | None = None,
        port_name: str | None = None,
        poll_s: float = 0.1,
    ) -> None:
        if (service is None) == (route is None):
            raise ValueError("a Service or an HTTPRoute, one of them")
        self.api_host = api_host
        self.namespace = namespace
        self.service = service
        self.route = route
        self.port_name = port_name
        self.poll_s = poll_s
        self.counts: Counter[str] = Counter()
        self.table: dict[str, float] = {}  # backend "ip:port" (or NO_ENDPOINTS) -> weight
        self.reads = 0  # table reads done; a test waits for one after a change
        self.last_error: str | None = None
        self._current: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        super().__init__(self._handler())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> TrafficSplitter:
        self._refresh()
        self._poller.start()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._poller.join(timeout=5)
        super().__exit__(*exc)

    # -- what the tests read ---------------------------------------------------------------

    def count(self, backend: str) -> int:
        with self._lock:
            return self.counts[backend]

    def wait_until(self, condition: Callable[[TrafficSplitter], bool], timeout_s: float) -> None:
        """Wait for `condition(self)` (over the table, counts, reads) or fail at the deadline."""
        deadline = time.monotonic() + timeout_s
        while not condition(self):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"splitter: table {self.table}, counts {dict(self.counts)}, "
                    f"last error {self.last_error}"
                )
            time.sleep(0.01)

    def wait_for_fresh_table(self, timeout_s: float = 5.0) -> dict[str, float]:
        """The table read after this call began (a change made before it is in)."""
        start = self.reads
        self.wait_until(lambda s: s.reads >= start + 2, timeout_s)  # one may have begun before
        with self._lock:
            return dict(self.table)

    # -- the weights -----------------------------------------------------------------------

    def _get(self, path: str) -> dict[str, Any] | None:
        try:
            url = f"{self.api_host}{path}"  # the fake's http://127.0.0.1:port
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def _addresses(self, service: str, port: int | None) -> list[str]:
        """The ready addresses of the Service's port (`port`: its number; None: by name)."""
        name = self.port_name
        if port is not None:
            spec = self._get(f"/api/v1/namespaces/{self.namespace}/services/{service}") or {}
            ports = (spec.get("spec") or {}).get("ports") or ()
            name = next((p.get("name") for p in ports if p.get("port") == port), None)
        found = self._get(f"/api/v1/namespaces/{self.namespace}/endpoints/{service}") or {}
        out = []
        for subset in found.get("subsets") or ():
            numbers = [
                p["port"]
                for p in subset.get("ports") or ()
                if name is None or p.get("name") == name
            ]
            if numbers:
                out += [f"{a['ip']}:{numbers[0]}" for a in subset.get("addresses") or ()]
        return sorted(out)

    def _read_table(self) -> dict[str, float]:
        if self.service is not None:
            return dict.fromkeys(self._addresses(self.service, None), 1.0)
        path = f"/apis/gateway.networking.k8s.io/v1/namespaces/{self.namespace}/httproutes/"
        route = self._get(path + str(self.route)) or {}
        rules = (route.get("spec") or {}).get("rules") or [{}]
        table: dict[str, float] = {}
        for ref in rules[0].get("backendRefs") or ():
            weight = float(ref.get("weight", 1))
            if weight <= 0:
                continue
            addresses = self._addresses(ref["name"], ref.get("port"))
            for address in addresses:
                table[address] = table.get(address, 0.0) + weight / len(addresses)
            if not addresses:
                table[NO_ENDPOINTS] = table.get(NO_ENDPOINTS, 0.0) + weight
        return table

    def _refresh(self) -> None:
        try:
            table = self._read_table()
        except (OSError, ValueError, KeyError) as exc:
            self.last_error = repr(exc)
        else:
            with self._lock:
                if table != self.table:
                    self.table, self._current = table, dict.fromkeys(table, 0.0)
        self.reads += 1

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._refresh()

    def _pick(self) -> str | None:
        """Smooth weighted round robin: every backend gains its weight, the first pays all."""
        with self._lock:
            if not self.table:
                return None
            total = sum(self.table.values())
            for backend, weight in self.table.items():
                self._current[backend] += weight
            chosen = max(self._current, key=lambda b: self._current[b])
            self._current[chosen] -= total
            self.counts[chosen] += 1
            return chosen

    # -- forwarding ------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        splitter = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                backend = splitter._pick()
                if backend in (None, NO_ENDPOINTS):
                    send_json(self, 503, {"error": "no healthy upstream"})
                    return
                host, port = str(backend).rsplit(":", 1)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                upstream = http.client.HTTPConnection(host, int(port), timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    self.send_response(response.status)
                    for key, value in response.getheaders():
                        if key.lower() not in _HOP_HEADERS:
                            self.send_header(key, value)
                    self.send_header("X-Backend", str(backend))
                    self.end_headers()  # no length: the body ends when the connection closes
                    while chunk := response.read1(65536):
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    # A backend gone mid-answer (its pod deleted): the client sees the
                    # connection close, as behind a real proxy. ValueError: a chunk cut short.
                    splitter.last_error = f"{backend}: {exc!r}"
                    self.close_connection = True
                finally:
                    upstream.close()

            do_GET = do_POST = _forward

            def log_message(self, *args: object) -> None:
                """Quiet: the tests read `counts`."""

        return Handler
