"""A free TCP port for a rendezvous store that another process will listen on.

A port from binding to 0 comes from the kernel's ephemeral range, the same range it draws the
local port of every outgoing connection from: between choosing the port and the store
listening on it (a launcher's start, seconds) any connection on the host may take it, and the
store fails with EADDRINUSE. A port below that range is never handed out that way. Imports
nothing of t2train: the launcher and the trainer share it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: well-known and registered services


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default when
    it cannot be read)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def bindable(port: int, host: str = "") -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "") -> int:
    """A port free now on ``host``, drawn at random below the ephemeral range (or any free
    one, when that range starts too low to leave room below it)."""
    low, _ = ephemeral_range()
    if low > LOWEST:
        draw = random.Random()  # seeded from the OS: concurrent launchers draw apart
        for _ in range(64):
            port = draw.randrange(LOWEST, low)
            if bindable(port, host):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
