"""A free TCP port for a rendezvous that a launcher chooses now and its processes bind later.

Standard library only, so that a shell launcher can run it as a file before anything imports torch:
``python src/attnpool/comm/ports.py`` prints one (bench/torchrun_nodes.sh does).

Why not ``bind(0)`` and close: the kernel hands that port out of its ephemeral range, and once it is released any
other process's ``bind(0)`` or outgoing connection may take it before the rendezvous server binds it, seconds later
(its processes import torch first). A CI run lost a two-node launch so: a client met another test's server at the
port ("failed to connect/validate ... Connection reset by peer"). A port below the ephemeral range is taken only by
a process that names it, so :func:`free_port` draws there (below 30000 too: Kubernetes' NodePorts, 30000-32767,
may be taken on a host's network by rules a bind does not see), checking that nothing holds it now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_LOW = 32768  # the kernel's default lower end, where the file cannot be read
NODE_PORTS_LOW = 30000  # Kubernetes' NodePort range starts here
DRAW_SPAN = 10000  # ports drawn from: the ones just below the lower of the two
LOWEST = 1024  # below: privileged ports
DRAWS = 64


def ephemeral_low() -> int:
    """The lower end of the ports the kernel hands out on its own (Linux's setting; its default elsewhere)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_EPHEMERAL_LOW


def is_free(port: int) -> bool:
    """Whether a server could bind ``port`` on every interface now, IPv4's and, where the host has it, IPv6's."""
    families = [(socket.AF_INET, "")] + ([(socket.AF_INET6, "::")] if socket.has_ipv6 else [])
    for family, address in families:
        try:
            s = socket.socket(family)
        except OSError:  # (IPv6 compiled in but off on this host)
            continue
        with s:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # this family's listeners alone
            try:
                s.bind((address, port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A port nothing holds now, drawn below the ephemeral range (see the module's docstring); the kernel's own
    choice where that range starts too low to leave room, or every draw was taken."""
    high = min(ephemeral_low(), NODE_PORTS_LOW)
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
