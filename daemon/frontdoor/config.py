"""What the daemon hands the front door at spawn (``FrontDoorConfig``), and the sizes derived
from it."""

from __future__ import annotations

from dataclasses import dataclass

from outrider.daemon.sampling_defaults import OUTRIDER_DEFAULTS, SamplingDefaults
from outrider.protocol.messages import DEFAULT_MAX_MESSAGE_BYTES

# A client is cut off once this many of the largest frames it may send are queued for it.
BACKLOG_MESSAGES = 8


@dataclass(frozen=True)
class FrontDoorConfig:
    """What the daemon hands the front door at spawn. It binds the outputs and control
    pipes at once and connects to the daemon's pipe; the client endpoint is bound only after
    ``ModelFacts`` and ``StateChange("ready")`` (reported as ``ChildStatus("serving")``)."""

    client_endpoint: str  # bound (ROUTER) once the daemon is ready
    daemon_endpoint: str  # PUSH connect: ToDaemon (InternalEndpoints.to_daemon)
    outputs_endpoint: str  # PULL bind: Outputs from the detokenizer (.to_front_door)
    control_endpoint: str  # PULL bind: Control from the daemon (.control)
    boot_id: str
    version: str
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # ZMQ_MAXMSGSIZE: larger drops the client
    curve_server_keys: tuple[bytes, bytes] | None = None  # (public, secret), Z85
    curve_client_keys: tuple[bytes, ...] = ()  # Z85 public keys allowed in (with CURVE)
    socket_mode: int = 0o600  # an ipc:// client socket's file mode, whatever the umask
    max_inflight_per_client: int = 1024
    max_inflight: int = 4096
    slow_consumer_timeout: float = 2.0
    client_hwm: int = 1000  # frames queued per client pipe, each direction
    heartbeat_ivl_ms: int = 5000  # ZMTP heartbeats: a silent peer is dropped, then aborted
    log_level: str = "info"
    # What requests that leave temperature, top_p or top_k out get (--generation-config).
    sampling_defaults: SamplingDefaults = OUTRIDER_DEFAULTS

    @property
    def max_backlog_bytes(self) -> int:
        """Bytes queued for one client past which it is cut off (frontdoor/clients.py)."""
        return BACKLOG_MESSAGES * self.max_message_bytes
