"""ZeroMQ socket helpers: bounded queues, size limits, explicit interfaces.

Every socket gets a high-water mark (a slow peer blocks or drops, it never grows memory without
bound), a ``MAXMSGSIZE`` on receiving sockets (zmq disconnects a peer that sends a bigger message
before it reaches our code), ``LINGER`` so close never hangs, and ROUTER sockets get
``ROUTER_MANDATORY`` so a send to a vanished peer fails loudly instead of being dropped.

Every connection carries ZMTP heartbeats: a peer that stops answering them (host gone, cable pulled,
process frozen) is disconnected after ``HEARTBEAT_TIMEOUT_MS`` instead of holding the connection open
forever; the TTL asks the other end to do the same. ROUTERs do not hand a routing id over to a second
connection (``ROUTER_HANDOVER`` off): who a frame comes from is decided by its CURVE key
(protocol/curve.py), never by an identity the peer picks.
"""

from __future__ import annotations

import zmq

DEFAULT_HWM = 64
DEFAULT_LINGER_MS = 0
HEARTBEAT_IVL_MS = 2_000
# Generous: a worker paused for a long GC or a debugger is not dropped, a dead one is within ~20 s.
HEARTBEAT_TIMEOUT_MS = 20_000


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    hwm: int = DEFAULT_HWM,
    max_msg_size: int | None = None,
    linger_ms: int = DEFAULT_LINGER_MS,
) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if max_msg_size is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def bind(sock: zmq.Socket, interface: str, port: int = 0, *, allow_all_interfaces: bool = False) -> str:
    """Bind to ``tcp://interface:port`` (port 0: a free port); returns the endpoint actually bound.

    ``inproc://`` and ``ipc://`` addresses are bound as given. Binding every interface needs
    ``allow_all_interfaces`` so it is never the default.
    """
    if interface.startswith(("inproc://", "ipc://")):
        sock.bind(interface)
        return interface
    if interface in ("*", "0.0.0.0", "::", "") and not allow_all_interfaces:
        raise ValueError(f"refusing to bind all interfaces ({interface!r}); name one, e.g. 127.0.0.1")
    if port == 0:
        sock.bind_to_random_port(f"tcp://{interface}")
    else:
        sock.bind(f"tcp://{interface}:{port}")
    # What ZeroMQ actually bound: an interface name (eth0) or hostname comes back as its IP, which is
    # what peers must be told.
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.Socket, endpoint: str) -> None:
    sock.connect(endpoint)
