"""Which Ray a trainer that starts Ray itself will use, decided before Ray starts (in well under a second; at
most ``ANSWER_TIMEOUT_S`` for an address whose host drops connections).

``ray.init()`` without an address does not always start a fresh Ray instance: it joins the cluster whose address
the last ``ray start`` on this machine wrote into ``<temp>/ray/ray_current_cluster`` (temp: ``$RAY_TMPDIR``, else
``$TMPDIR`` on Linux, else ``/tmp``; ``ray stop`` removes the file). The trainer must know which of the two will
happen before it calls ``ray.init``:

- a fresh instance is given ``num_cpus`` (more than the workers take: Ray Data needs spare CPUs), and this
  machine's CPUs and GPUs are checked against the workers before it starts;
- joining a cluster with ``num_cpus`` is refused by Ray (a ValueError traceback), and the cluster's resources are
  not this machine's;
- a file left by a cluster that is gone (a head killed without ``ray stop``), like an address nobody answers at
  in ``--ray-address`` or ``$RAY_ADDRESS``, would make ``ray.init`` retry it for minutes; here it is one sentence
  before anything starts (a TCP connection to the address, which a live cluster's GCS accepts at once:
  ``llmq_ray/net.py``).

Ray's own lookup of that file is private API that has moved between Ray releases, so the few lines that find it
follow Ray 2.x's rule here instead of importing it.

``start_ray`` is the trainer's ``ray.init``: Ray gives a fresh local node a fixed 30 s to register with its own
GCS (``ray/_private/node.py``, not configurable), which a busy machine can exceed; that start alone is tried again
(up to ``START_ATTEMPTS`` times) before the run is refused in one sentence instead of Ray's traceback.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

from llmq_ray.errors import ConfigError, RayStartError
from llmq_ray.net import accepts_tcp

ANSWER_TIMEOUT_S = 2.0  # a TCP connect to the named cluster's GCS port: a live one answers in milliseconds
START_ATTEMPTS = 3      # starts of a fresh local Ray whose node did not register in Ray's fixed 30 s
NODE_START_TIMED_OUT = "timed out during startup"  # Ray's words for that (its Exception, ray/_private/node.py)


@dataclass(frozen=True)
class RayTarget:
    """What ``ray.init`` gets and what it means.

    ``address``: "local" (start a fresh instance), a cluster's address, or None (let Ray read ``$RAY_ADDRESS``).
    ``joins``: True when the run joins an existing cluster (whose resources are not this machine's).
    ``line``: a start-up line saying which cluster was found, when that is not what the user named."""
    address: Optional[str]
    joins: bool
    line: Optional[str] = None


def ray_address_file(environ: Mapping[str, str] = os.environ) -> str:
    """The file in which ``ray start`` records its cluster's address for later ``ray.init()`` calls."""
    if "RAY_TMPDIR" in environ:
        temp = environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and "TMPDIR" in environ:
        temp = environ["TMPDIR"]
    else:
        temp = "/tmp"
    return os.path.join(temp, "ray", "ray_current_cluster")


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """(host, port) of ``host:port``, ``[v6]:port`` or ``ray://host:port``; None when it is not of that form."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def answers(address: str, timeout_s: float = ANSWER_TIMEOUT_S) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` (the GCS of a live cluster does)."""
    where = _host_port(address)
    return where is not None and accepts_tcp(*where, timeout_s)


def _check_answers(address: str, source: str) -> None:
    """ConfigError naming ``source`` unless a cluster answers at ``address`` (host:port, or ray://host:port for
    Ray Client): ray.init would otherwise retry an address nobody answers at for minutes."""
    if _host_port(address) is None:
        raise ConfigError(f"{source} is not a Ray cluster address: give host:port (the head node's GCS port, 6379 "
                          f"unless `ray start --port` said otherwise), ray://host:port, local or auto.")
    if not answers(address):
        host_port = address.split("://", 1)[-1]
        raise ConfigError(f"{source}: no Ray cluster answers at {host_port}; check the address and that the "
                          f"cluster is up.")


def resolve_ray_target(ray_address: Optional[str], environ: Mapping[str, str] = os.environ) -> RayTarget:
    """The Ray cluster a trainer with ``ray_address`` (None, "local", "auto" or an address) will use when it calls
    ``ray.init`` itself. "auto" (here or in ``$RAY_ADDRESS``) means the cluster of the address file, which must
    then exist. Raises ConfigError, naming the file, when the file's cluster does not answer."""
    named = ray_address or environ.get("RAY_ADDRESS", "")  # `ray job submit` sets RAY_ADDRESS for its entrypoint
    if named == "local":  # a fresh instance
        return RayTarget("local" if ray_address else None, False)
    if named and named != "auto":  # an address from RAY_ADDRESS is left for Ray to read (None)
        _check_answers(named, f"--ray-address={named}" if ray_address else f"RAY_ADDRESS={named}")
        return RayTarget(named if ray_address else None, True)
    path = ray_address_file(environ)
    try:
        with open(path) as f:
            recorded = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        recorded = ""
    except OSError as exc:
        raise ConfigError(f"Ray's address file {path} cannot be read ({exc.strerror}); fix its permissions or "
                          f"pass --ray-address=local for a fresh Ray instance.") from None
    if not recorded:
        if named == "auto":
            raise ConfigError(f"Ray address 'auto' asks for the Ray cluster that `ray start` runs on this machine, "
                              f"but none does (no address in {path}): start one, or pass the cluster's address "
                              f"with --ray-address.")
        return RayTarget("local", False)
    if answers(recorded):
        return RayTarget(recorded, True, f"Ray: joining the cluster at {recorded} that `ray start` started on this "
                                         f"machine (named in {path}); --ray-address=local starts a fresh one")
    raise ConfigError(f"Ray's address file {path} names a cluster at {recorded} that does not answer (its "
                      f"`ray start` is gone): start it again, delete the file (as `ray stop` does), or pass "
                      f"--ray-address=local for a fresh Ray instance.")


def start_ray(kwargs: Mapping, fresh: bool) -> None:
    """``ray.init(**kwargs)`` (None values left out), without Ray's token-auth notice. ``fresh``: it starts a new
    local instance, whose start alone is tried again when its node timed out registering (see the module
    docstring); any other failure, and any failure to join a cluster, is raised as Ray raised it."""
    import ray

    from llmq_ray.observe.ray_console import without_token_auth_notice

    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            with without_token_auth_notice():  # auth as Ray decides; its notice on every start is dropped
                ray.init(**{k: v for k, v in kwargs.items() if v is not None})
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this one
            if not fresh or NODE_START_TIMED_OUT not in str(exc):
                raise
            ray.shutdown()  # the processes of the start that timed out
            if attempt == START_ATTEMPTS:
                raise RayStartError(f"the local Ray instance did not start: its node did not register within Ray's "
                                    f"30 s, {START_ATTEMPTS} times; this machine is too busy for Ray to start, "
                                    f"try again when it is less loaded.") from None
            print(f"llmq-ray: Ray's local node did not register within 30 s (a busy machine); starting it again "
                  f"({attempt + 1}/{START_ATTEMPTS}).", file=sys.stderr, flush=True)
