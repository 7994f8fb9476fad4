"""Ray's own console lines that a run does not repeat on every start.

``ray.init()`` of a fresh local instance, with ``RAY_AUTH_MODE`` unset, turns token authentication on (Ray
2.60's default for a new local cluster) and warns every time that it did: "Token authentication is enabled for
this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out ...". Authentication stays exactly as Ray decides it
(on by default; ``RAY_AUTH_MODE=disabled`` or ``=token`` as the user sets it); only that one notice is dropped
while our ``ray.init`` runs, and docs/observability.md says what it would have said. Ray's warning that a
cluster runs *without* authentication, and everything else Ray logs, still reach the console.
"""

from __future__ import annotations

import contextlib
import logging

# the logger of ray/_private/authentication/authentication_token_setup.py (Ray 2.60), which logs the notice
TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_ON_NOTE = "Token authentication is enabled for this Ray cluster"


class _DropTokenOnNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TOKEN_ON_NOTE)


@contextlib.contextmanager
def without_token_auth_notice():
    """While active, Ray's "Token authentication is enabled ..." notice is not logged (nothing else changes)."""
    logger = logging.getLogger(TOKEN_SETUP_LOGGER)
    note = _DropTokenOnNote()
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)
