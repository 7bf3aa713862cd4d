"""Listening TCP sockets for the HTTP faces: the daemon's health port, the API port the
daemon owns and every worker inherits, and a stand-alone worker's own port."""

from __future__ import annotations

import socket


def listen(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """Bind and listen now, so that a taken port is a clear start-up error and clients
    queue in the kernel's backlog until a server accepts.

    TCP_NODELAY is inherited by accepted connections: without it every keep-alive
    request after the first waits ~40 ms on Nagle's algorithm."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock
