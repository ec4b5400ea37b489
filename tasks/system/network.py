"""Network addresses: the one loopback rule the components share (a server without a token
may listen only on loopback; a scheduler shares files only with servers on its own host)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback IP literal (127.0.0.0/8, ::1). Any other
    host name is taken as reachable from outside: it cannot be told from here."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
