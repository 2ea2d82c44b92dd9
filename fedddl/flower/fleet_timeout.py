"""A longer timeout for the SuperNode's Fleet API requests (opt-in, per process).

Flower 1.42's SuperNode talks to the SuperLink over protobuf-over-HTTP
(``flwr.supernode.fleet_http_client.FleetHttpClient``) with one ``httpx`` timeout of
30 s for every request, a push of one message object (one tensor) included. When the
object takes longer than that to cross the SuperNode's share of a slow link (a
ResNet-18 layer of 9.4 MB needs 0.31 MB/s; four SuperNodes sharing one 10 Mbit/s
server link get 0.31 MB/s each), the request is abandoned, retried from its first
byte, and after a few failures the whole message is dropped ("Failed to send
message ... The push session may have expired"); the round then waits for a reply
that never comes. :func:`patch_fleet_timeout` gives every ``FleetHttpClient`` built
after it a longer timeout; heartbeats keep their own short timeout.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["FLEET_TIMEOUT_S", "patch_fleet_timeout"]

#: Default of the fedddl SuperNode launcher (Flower's own: 30 s).
FLEET_TIMEOUT_S = 300.0


def patch_fleet_timeout(seconds: float) -> None:
    """Make ``FleetHttpClient.from_server_address`` build clients with ``seconds`` timeouts.

    Raises
    ------
    ValueError
        If ``seconds`` is not positive.
    RuntimeError
        If Flower's client no longer has the structure this patch expects (a
        ``from_server_address`` class method building an ``httpx.Client`` in ``_client``).
    """
    import httpx
    from flwr.supernode.fleet_http_client import FleetHttpClient

    if not seconds > 0:
        raise ValueError(f"fleet timeout must be > 0 seconds, got {seconds}")
    build = getattr(FleetHttpClient.from_server_address, "__func__", None)
    if build is None:
        raise RuntimeError("FleetHttpClient.from_server_address is not a class method; "
                           "not patching the Fleet API timeout")
    build = getattr(build, "__wrapped__", build)  # patched before: wrap Flower's own

    @functools.wraps(build)
    def from_server_address(cls: Any, *args: Any, **kwargs: Any) -> Any:
        client = build(cls, *args, **kwargs)
        inner = getattr(client, "_client", None)
        if not isinstance(inner, httpx.Client):
            raise RuntimeError("FleetHttpClient has no httpx.Client in `_client`; "
                               "cannot set the Fleet API timeout")
        inner.timeout = httpx.Timeout(seconds)
        return client

    FleetHttpClient.from_server_address = classmethod(from_server_address)  # type: ignore[assignment, method-assign]
