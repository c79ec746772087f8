"""Choosing a port for a local server, and telling from its log that it lost a port it wanted to bind.

Owns the port range (below the kernel's ephemeral range and SGLang's auxiliary ports) and the marks of a lost
bind. It starts no process; retrying a start that lost its port is ``launcher``'s and ``moe_rl.launch.serve``'s.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

# Ports handed out by the kernel for outgoing connections and bind(0) start here (Linux default); a port chosen in
# that range can be taken by any process's next connection before SGLang binds it.
_EPHEMERAL_LOW_DEFAULT = 32768
# Our range sits below SGLang's own choice for its auxiliary (nccl/gloo store) port, 22000-29999.
_PORT_RANGE = (10000, 21999)
# How a lost bind reads in the server log: uvicorn's ``[Errno 98] ... address already in use`` (HTTP port, exit
# code 3), torch's TCPStore ``EADDRINUSE`` (the scheduler's auxiliary port), ZMQ's ``Address already in use``.
_BIND_FAILURE_MARKS = ("errno 98", "eaddrinuse", "address already in use")


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A TCP port on `host` that was free a moment ago, chosen at random below the kernel's ephemeral range.

    Not ``bind(("", 0))``: that hands out ephemeral ports, the same pool every outgoing connection on the
    machine draws from, so the port is often taken again before the server binds it (a busy host's port race).
    Falls back to ``bind(0)`` if 64 random tries in the range all fail."""
    rng = rng or random.Random()
    low, high = _PORT_RANGE
    high = min(high, _ephemeral_low() - 1)
    for port in rng.sample(range(low, high + 1), min(64, max(0, high - low + 1))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return _EPHEMERAL_LOW_DEFAULT


def lost_a_bind(log_text: str) -> bool:
    """Whether a server log says a port it wanted to bind was taken (by another process)."""
    low = log_text.lower()
    return any(mark in low for mark in _BIND_FAILURE_MARKS)
