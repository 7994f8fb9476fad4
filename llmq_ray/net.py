"""Whether a TCP endpoint answers: the one network probe the driver and the coordinator share.

Ray itself only gives up on a peer after its own retry and health-check time-outs (tens of seconds to minutes);
a TCP connection answers at once whether something listens there: a live cluster's GCS (before ``ray.init``, in
``llmq_ray/train/ray_target.py``) or a node's raylet (to tell a lost machine from a dead process, in
``actors/failures.py``). No dependency beyond the standard library, so the pre-flight checks stay light.
"""

from __future__ import annotations

import socket


def accepts_tcp(host: str, port: int, timeout_s: float) -> bool:
    """True when a TCP connection to ``host:port`` is accepted within ``timeout_s`` seconds (the host may be a
    name, an IPv4 or an IPv6 address); False when it is refused, times out or the name does not resolve."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
