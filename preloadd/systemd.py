"""systemd's readiness protocol (sd_notify), without libsystemd: under a unit of
Type=notify, systemd passes NOTIFY_SOCKET, and the daemon tells it on that datagram socket
that it is ready (weights resident, workers answering), how the load goes, and that it is
stopping. Elsewhere, nothing is sent."""

from __future__ import annotations

import os
import socket


def notify(**fields: str) -> None:
    """Send fields (READY="1", STATUS="...", STOPPING="1") to systemd, if it listens."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(message, address)
    except OSError:
        pass  # systemd gone or not listening: readiness is then its business
