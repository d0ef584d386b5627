"""Agent side: the workers' plugin ports an engine publishes, turned into URLs to scrape.

The engine core's port lists its workers' ports (`kvpool_worker_port`, see `worker_ports`);
each becomes a URL on the engine's own host, scheme and path: the exposition chooses a port,
never a host, so a plugin cannot send the agent elsewhere. Ports that are not whole numbers
in 1..65535, the engine's own port, repeats and ports past `MAX_WORKER_PORTS` are refused
with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

from kvpilot.collectors.checks import Refused, SampleChecks
from kvpilot.collectors.kvpool.listen_address import WORKER_PORT_FAMILY
from kvpilot.collectors.promtext import MetricSample

# One node's workers of every engine behind the port: eight GPUs x tensor parallelism, with
# room to spare; a bound on how many reads one scrape may start.
MAX_WORKER_PORTS = 64


def with_port(url: str, port: int) -> str:
    """`url` with its port replaced (its user, host, path and query kept)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = parts.netloc.rpartition("@")
    user = f"{netloc[0]}@" if netloc[1] else ""
    return urlunsplit(parts._replace(netloc=f"{user}{host}:{port}"))


def worker_urls(
    samples: Iterable[MetricSample], engine_url: str
) -> tuple[tuple[str, ...], tuple[Refused, ...]]:
    """The URLs of the workers' ports the engine publishes, in port order, and the refusals."""
    checks = SampleChecks()
    own_port = urlsplit(engine_url).port
    ports: set[int] = set()
    for sample in samples:
        if sample.name != WORKER_PORT_FAMILY:
            continue
        field = f"worker_port[{dict(sample.labels).get('worker', '')}]"
        port = checks.count(field, sample.value, least=1)
        if port is None:
            continue
        if port > 65535:
            checks.refuse(field, "out_of_range", f"{port} is not a TCP port")
        elif port != own_port:  # a worker beside the engine serves there already
            ports.add(port)
    chosen = sorted(ports)
    if len(chosen) > MAX_WORKER_PORTS:
        checks.refuse(
            "worker_port",
            "out_of_range",
            f"{len(chosen)} worker ports published; the first {MAX_WORKER_PORTS} are read",
        )
        chosen = chosen[:MAX_WORKER_PORTS]
    return tuple(with_port(engine_url, port) for port in chosen), checks.done()
