"""gRPC transport between gossip peers: service, client and link shaper.

No protobuf code generation: the service is a grpc *generic* handler whose
methods take and return raw bytes (frames of :mod:`fedddl.gossip.wire`).

* :class:`PeerServer` serves ``/fedddl.gossip.Peer/Exchange``, with mutual TLS
  when given a :class:`~fedddl.gossip.tls.PeerTls` (then plaintext callers,
  callers without a certificate and certificates of another CA fail the
  handshake). Every request goes to a handler ``(bytes, caller) -> bytes``,
  where ``caller`` is the node id in the caller's verified certificate (``None``
  without TLS); a :class:`RejectedFrame` (or a
  :class:`~fedddl.gossip.wire.WireError`) it raises is counted and logged once
  per peer and reason (:class:`~fedddl.gossip.admission.RejectionLog`) and
  returned to the sender as an error status, so a bad frame never reaches the
  receiver's model.  Requests over ``max_frame_bytes`` are refused before the
  handler runs.
* :class:`PeerClient` sends a frame to one peer with a deadline, after the
  :class:`LinkShaper` delay for that peer, and reports the measured time. With
  TLS it presents its node's certificate and accepts only a server whose
  certificate names the node it dials.
* :class:`LinkShaper` makes links slow on purpose (tests, emulated WANs):
  ``latency_s + num_bytes / bandwidth_Bps`` of sleep per send, per peer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass

import grpc

from fedddl.gossip.admission import RejectedFrame, RejectionLog
from fedddl.gossip.tls import PeerTls, caller_identity, peer_name
from fedddl.gossip.wire import DEFAULT_MAX_FRAME_BYTES, WireError

__all__ = [
    "EXCHANGE_METHOD",
    "SERVICE_NAME",
    "LinkDelay",
    "LinkShaper",
    "PeerClient",
    "PeerServer",
    "RejectedFrame",
    "SendResult",
    "TransportError",
    "parse_shaper_spec",
]

SERVICE_NAME = "fedddl.gossip.Peer"
EXCHANGE_METHOD = f"/{SERVICE_NAME}/Exchange"
# gRPC itself refuses requests a bit above our limit, so over-limit frames still
# reach our check (and get a logged reason) unless they are far too large.
_GRPC_SLACK_BYTES = 1024 * 1024

_log = logging.getLogger(__name__)

Handler = Callable[[bytes, "int | None"], bytes]


class TransportError(Exception):
    """A send failed: peer unreachable, timed out, or it rejected the frame."""

    def __init__(self, peer: int, code: grpc.StatusCode | None, reason: str) -> None:
        super().__init__(f"send to peer {peer} failed ({code.name if code else 'n/a'}): {reason}")
        self.peer = peer
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class LinkDelay:
    """Artificial delay of one link: ``latency_s + num_bytes / bandwidth_Bps``."""

    latency_s: float = 0.0
    bandwidth_Bps: float = float("inf")

    def __post_init__(self) -> None:
        if not self.latency_s >= 0.0:
            raise ValueError(f"shaper latency must be >= 0 s, got {self.latency_s}")
        if not self.bandwidth_Bps > 0.0:
            raise ValueError(f"shaper bandwidth must be > 0 bytes/s, got {self.bandwidth_Bps}")

    def seconds(self, num_bytes: int) -> float:
        """Delay for a message of ``num_bytes`` bytes."""
        return self.latency_s + num_bytes / self.bandwidth_Bps


class LinkShaper:
    """Per-peer artificial link delays, applied by the sender before each send.

    Parameters
    ----------
    default : LinkDelay, optional
        Delay of links not listed in ``per_peer`` (none by default).
    per_peer : Mapping[int, LinkDelay], optional
        Delay of the link to each listed peer.
    sleep : Callable[[float], None]
        Injected for tests; ``time.sleep`` by default.
    """

    def __init__(
        self,
        default: LinkDelay | None = None,
        per_peer: Mapping[int, LinkDelay] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.default = default or LinkDelay()
        self.per_peer = dict(per_peer or {})
        self._sleep = sleep

    def delay_for(self, peer: int, num_bytes: int) -> float:
        """Seconds a send of ``num_bytes`` bytes to ``peer`` is held back."""
        return self.per_peer.get(peer, self.default).seconds(num_bytes)

    def apply(self, peer: int, num_bytes: int) -> float:
        """Sleep for :meth:`delay_for` and return the seconds slept."""
        delay = self.delay_for(peer, num_bytes)
        if delay > 0.0:
            self._sleep(delay)
        return delay


def parse_shaper_spec(spec: str) -> LinkShaper:
    """Parse ``"[*|PEER]=LATENCY_S/BANDWIDTH_BPS,..."`` into a :class:`LinkShaper`.

    ``*`` sets the default link; bandwidth may be omitted (unlimited). Example:
    ``"*=0.01,2=0.2/1e6"`` gives every link 10 ms and the link to peer 2 200 ms
    plus 1 MB/s.

    Raises
    ------
    ValueError
        Naming the bad entry.
    """
    default: LinkDelay | None = None
    per_peer: dict[int, LinkDelay] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = entry.partition("=")
        latency_text, _, bandwidth_text = value.partition("/")
        try:
            if not sep:
                raise ValueError("missing '='")
            delay = LinkDelay(
                float(latency_text), float(bandwidth_text) if bandwidth_text else float("inf")
            )
            if key.strip() == "*":
                default = delay
            else:
                per_peer[int(key)] = delay
        except ValueError as exc:
            raise ValueError(f"bad shaper entry {entry!r}: {exc}") from None
    return LinkShaper(default, per_peer)


class PeerServer:
    """gRPC server exposing one frame handler as ``Exchange``.

    Parameters
    ----------
    handler : Callable[[bytes, int | None], bytes]
        Called with each request and the caller's node id (from its certificate;
        ``None`` without TLS); returns the reply frame. Raise
        :class:`RejectedFrame` or :class:`WireError` to refuse.
    bind : str
        ``host:port``; port ``0`` picks a free port (see :attr:`port`).
    max_frame_bytes : int
        Largest request accepted.
    max_workers : int
        Threads serving requests concurrently.
    tls : PeerTls, optional
        Serve with mutual TLS; without it the port is plaintext and unauthenticated.
    rejections : RejectionLog, optional
        Where refused frames are counted and logged (a new one by default).
    """

    def __init__(
        self,
        handler: Handler,
        bind: str = "127.0.0.1:0",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_workers: int = 4,
        tls: PeerTls | None = None,
        rejections: RejectionLog | None = None,
    ) -> None:
        if max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes must be > 0, got {max_frame_bytes}")
        self.max_frame_bytes = int(max_frame_bytes)
        self.tls = tls
        self.rejection_log = rejections or RejectionLog("peer service")
        self._handler = handler
        grpc_limit = min(self.max_frame_bytes + _GRPC_SLACK_BYTES, 2**31 - 1)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="peer-rpc"),
            options=[("grpc.max_receive_message_length", grpc_limit)],
        )
        method = grpc.unary_unary_rpc_method_handler(
            self._serve, request_deserializer=None, response_serializer=None
        )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Exchange": method}),)
        )
        if tls is None:
            self.port = self._server.add_insecure_port(bind)
        else:
            self.port = self._server.add_secure_port(bind, tls.server_credentials())
        if self.port == 0:
            raise OSError(f"could not bind the peer service to {bind!r}")
        host = bind.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"

    def start(self) -> None:
        """Start serving (returns at once)."""
        self._server.start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving; in-flight requests get ``grace_s`` seconds to finish."""
        self._server.stop(grace_s).wait()

    @property
    def rejections(self) -> dict[str, int]:
        """Refused frames by gRPC status name."""
        return self.rejection_log.by_status()

    def _serve(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        caller = caller_identity(context) if self.tls is not None else None
        if len(request) > self.max_frame_bytes:
            self._reject(
                context,
                RejectedFrame(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"frame of {len(request)} bytes exceeds the limit of {self.max_frame_bytes}",
                    "oversized",
                ),
                caller,
            )
        try:
            return self._handler(request, caller)
        except RejectedFrame as exc:
            self._reject(context, exc, caller)
        except WireError as exc:
            rejected = RejectedFrame(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "malformed")
            self._reject(context, rejected, caller)
        raise AssertionError("unreachable: _reject aborts the call")

    def _reject(
        self, context: grpc.ServicerContext, exc: RejectedFrame, caller: int | None
    ) -> None:
        node = exc.peer if exc.peer is not None else caller
        # Unauthenticated callers are told apart by host (a new port per connection).
        peer = f"node {node}" if node is not None else context.peer().rsplit(":", 1)[0]
        self.rejection_log.record(peer, exc.key, exc.code.name, exc.reason)
        context.abort(exc.code, exc.reason)


@dataclass(frozen=True)
class SendResult:
    """Outcome of one successful send."""

    reply: bytes
    seconds: float  # wall time including the shaper delay
    shaper_delay_s: float


class PeerClient:
    """Sends frames to one peer over a reused gRPC channel.

    Parameters
    ----------
    peer : int
        Node id of the peer (for the shaper and error messages).
    address : str
        ``host:port`` of its :class:`PeerServer`.
    shaper : LinkShaper, optional
        Artificial delay applied before each send.
    tls : PeerTls, optional
        Dial with mutual TLS (this node's certificate; the server must be node ``peer``).
    """

    def __init__(
        self,
        peer: int,
        address: str,
        shaper: LinkShaper | None = None,
        tls: PeerTls | None = None,
    ) -> None:
        self.peer = peer
        self.address = address
        self.shaper = shaper or LinkShaper()
        options: list[tuple[str, int | str]] = [("grpc.max_receive_message_length", -1)]
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            options.append(("grpc.ssl_target_name_override", peer_name(peer)))
            self._channel = grpc.secure_channel(address, tls.channel_credentials(), options)
        self._call = self._channel.unary_unary(
            EXCHANGE_METHOD, request_serializer=None, response_deserializer=None
        )

    def send(self, frame: bytes, timeout_s: float) -> SendResult:
        """Send ``frame`` and wait for the reply.

        Raises
        ------
        TransportError
            If the peer is unreachable, the deadline passes or it rejects the frame.
        """
        start = time.perf_counter()
        delay = self.shaper.apply(self.peer, len(frame))
        try:
            reply = self._call(frame, timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise TransportError(self.peer, code, details or "no details") from None
        return SendResult(bytes(reply), time.perf_counter() - start, delay)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()
