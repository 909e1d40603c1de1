"""What the prefill server needs from the config, and nothing more."""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.transports import TRANSPORTS


@dataclass(slots=True)
class PrefillOptions:
    worker_id: str  # DEALER identity at the gateway; unique per worker
    host: str = "127.0.0.1"  # interface of the job ROUTER
    port: int = 0  # 0: any free port (the heartbeat tells the gateway which)
    gateway_address: str = "tcp://127.0.0.1:8001"
    heartbeat_s: float = 5.0
    step_timeout_s: float = 0.0  # gateway.worker_step_timeout_s: a step past it is logged with the stacks
    gateway_timeout_s: float = 15.0  # a gateway that acks no heartbeat this long is lost: its jobs abort
    transports: tuple[str, ...] = tuple(TRANSPORTS)  # offered at handshake, best first
    transfer_deadline_s: float = 30.0  # a receiver silent this long fails the transfer and unpins
    handshake_timeout_s: float = 5.0
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight jobs get this long, then fail
    max_frame_bytes: int = 64 << 20  # job frames (whole prompts) and KV frames above this are refused
    idle_poll_ms: int = 20  # how long an idle loop waits on its sockets

    def __post_init__(self) -> None:
        assert self.worker_id and self.heartbeat_s > 0 and self.gateway_timeout_s > 0 and self.transports, (
            self.worker_id,
            self.transports,
        )
