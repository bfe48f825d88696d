"""A free TCP port on the loopback interface, for the tests' servers and rendezvous."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the OS had free a moment ago on ``127.0.0.1`` (bound to port 0, then closed).

    Another process may take it before the caller binds it; callers that start servers on
    it retry on ``EADDRINUSE`` where that matters (``tests/distributed/harness.py``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
