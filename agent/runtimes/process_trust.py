"""Whether a process that looks like the target's server may be trusted as it: it runs as the
expected user, and it listens on this machine.

Any local user can start a process whose command line reads `vllm serve ... --port 8000`. One
running as another user could block remediation (two matches: nothing is signalled) or, as
the only match, be probed during a restart with vLLM's API key; one whose `--host` names
another machine would have the agent send the key there. So a process is trusted only when
its real and effective uid are the expected one (the agent's own by default), and, unless the
operator set `host`, the agent reaches it on loopback or on an address of this machine, never
at a name or address the process chose.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from pathlib import Path

from kvpilot.collectors.addresses import LOCALHOST_NAMES, WILDCARD_HOSTS
from kvpilot.collectors.procfs import PROC, read_uids


def expected_uid(configured: int | None) -> int:
    """The uid a server must run as: the configured one, else the agent's own."""
    return os.geteuid() if configured is None else configured


def uid_problem(pid: int, uid: int, proc_root: Path = PROC) -> str | None:
    """Why PID's process does not run as `uid` (real and effective), or None when it does."""
    uids = read_uids(pid, proc_root)
    if uids is None:
        return f"PID {pid}'s user cannot be read"
    if uids != (uid, uid):
        real, effective = uids
        shown = str(real) if real == effective else f"{real} (effective {effective})"
        return f"PID {pid} runs as uid {shown}, not {uid}"
    return None


def own_listen_host(server_host: str | None) -> str | None:
    """Where the agent may reach a server that says `--host server_host`, with nothing else
    configured: loopback for every address and for loopback names, the address itself when
    it is one of this machine's; None (not trusted) for a name or another machine's address."""
    if server_host is None:
        return "127.0.0.1"
    bare = server_host.removeprefix("[").removesuffix("]").lower()
    if bare in WILDCARD_HOSTS:
        return "127.0.0.1"
    if bare in LOCALHOST_NAMES:
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return None  # a name: where it resolves is not the process's to decide
    if address.is_loopback or _bindable(address):
        return str(address)
    return None


def _bindable(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether `address` belongs to this machine (the kernel lets a socket bind it)."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))
    except OSError as exc:
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL):
            return False
        raise
    return True
