"""Addresses that mean "every interface", as a `--host` or a listen address writes them.

A server may listen there; the agent never dials them (it reaches such a server on loopback).
The bracketed IPv6 form is listed for callers that match a host as written; callers that
strip the brackets first match the bare forms.
"""

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})  # noqa: S104 - matched, never bound
# Names that mean this machine's loopback, as a `--host` may write them.
LOCALHOST_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
