"""The server's listening sockets, bound here rather than by uvicorn.

``acarerank serve`` binds its address once before the model loads (a refusal there costs no
load) and lets go; after the load ``run_server`` binds it again, listens, and hands the sockets
to uvicorn. A port another process took in between is refused in the same words and with the
same exit status as before the load (one line, exit 2): uvicorn binding it itself logged its
error over several lines and exited 3 (docs/serving.md, first section).
"""
from __future__ import annotations

import socket
from typing import Optional


def listen_sockets(host: str, port: int, backlog: Optional[int] = None) -> list:
    """Sockets bound to ``host``:``port`` as asyncio's ``create_server`` binds them (every address
    ``getaddrinfo`` gives, SO_REUSEADDR, IPv6-only sockets), listening with ``backlog`` if given.

    Raises ValueError for an empty host (asyncio reads it as every interface, so
    ``--host "$UNSET"`` served the network) or one that does not resolve, OSError naming the
    flags and the address for an address that cannot be bound or listened on (in use, not this
    machine's, a port this user may not bind). On an error no socket stays open; on success the
    caller owns them (uvicorn closes them at its shutdown)."""
    if not host.strip():
        raise ValueError("--host is empty, which would listen on every interface: give 0.0.0.0 (or ::) for that, "
                         "127.0.0.1 for this machine only")
    try:
        infos = set(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
    except (socket.gaierror, UnicodeError) as e:  # UnicodeError: a label IDNA cannot encode
        raise ValueError(f"--host {host!r} is not an address or a name this machine resolves "
                         f"({getattr(e, 'strerror', None) or e})") from None
    held = []
    try:
        for family, kind, proto, _, address in infos:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this machine lacks: asyncio skips it too
                continue
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
                if backlog is not None:
                    # two SO_REUSEADDR sockets may both be bound where neither listens: the
                    # second to listen is the one refused, so listening is part of the check
                    sock.listen(backlog)
            except OSError as e:
                raise OSError(f"--host {host} --port {port}: cannot listen on {address[0]} port {address[1]}: "
                              f"{(e.strerror or str(e)).lower()}") from None
    except BaseException:
        for sock in held:
            sock.close()
        raise
    return held
