"""A free TCP port for a rendezvous that a launcher chooses now and its processes bind later.

Standard library only, so that a shell launcher can run it as a file before anything imports torch:
``python src/attnpool/comm/ports.py`` prints one (bench/torchrun_nodes.sh does).

Why not ``bind(0)`` and close: the kernel hands that port out of its ephemeral range, and once it is released any
other process's ``bind(0)`` or outgoing connection may take it before the rendezvous server binds it, seconds later
(its processes import torch first). A CI run lost a two-node launch so: a client met another test's server at the
port ("failed to connect/validate ... Connection reset by peer"). A port below the ephemeral range is taken only by
a process that names it, so :func:`free_port` draws there, checking that nothing holds it now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_LOW = 32768  # the kernel's default lower end, where the file cannot be read
DRAW_SPAN = 10000  # ports drawn from: the ones just below the ephemeral range
LOWEST = 1024  # below: privileged ports
DRAWS = 64


def ephemeral_low() -> int:
    """The lower end of the ports the kernel hands out on its own (Linux's setting; its default elsewhere)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_EPHEMERAL_LOW


def is_free(port: int) -> bool:
    """Whether a server could bind ``port`` on every interface now."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing holds now, drawn below the ephemeral range (see the module's docstring); the kernel's own
    choice where that range starts too low to leave room, or every draw was taken."""
    high = ephemeral_low()
    low = max(LOWEST, high - DRAW_SPAN)
    # drawn from the system's randomness: two launchers whose processes seeded random alike must not draw alike
    draw = random.SystemRandom()
    if high - low >= DRAWS:
        for port in draw.sample(range(low, high), DRAWS):
            if is_free(port):
                return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    print(free_port())
