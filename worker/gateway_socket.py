"""The worker's one socket to the gateway: a DEALER whose ZeroMQ identity is the worker id.

Frames are single msgpack records (protocol/serving.py). A frame that does not decode into a record
the gateway may send is dropped and counted (``num_rejected``); the worker keeps running. Sends never
block: when the gateway is gone or slow and the queue is full, the record is dropped and counted
(heartbeats re-register the worker once the gateway is back; streams are the gateway's to time out).
"""

from __future__ import annotations

import logging

import zmq

from protocol.codec import WireError, decode, encode
from protocol.serving import AbortRequest, Generate, LoRAAdapterSet
from protocol.zmq_util import make_socket

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 << 20  # a Generate carries a whole prompt: generous, still bounded
GATEWAY_RECORDS = (Generate, AbortRequest, LoRAAdapterSet)  # what a gateway sends to a worker


class WorkerSocket:
    def __init__(self, ctx: zmq.Context, gateway_address: str, worker_id: str, *,
                 accepted: tuple[type, ...] = GATEWAY_RECORDS, hwm: int = 1024):
        self.worker_id = worker_id
        self.accepted = accepted  # a prefill worker passes (AbortRequest,)
        self.sock = make_socket(ctx, zmq.DEALER, hwm=hwm, max_msg_size=MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.connect(gateway_address)
        self.num_rejected = 0  # frames that were not a valid record of an accepted type
        self.num_dropped = 0  # records not sent: the gateway's queue was full or unreachable

    def send(self, record) -> bool:
        try:
            self.sock.send(encode(record), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.num_dropped += 1
            return False

    def poll(self, timeout_ms: int = 0, max_records: int = 1024) -> list:
        """Records that arrived, waiting up to ``timeout_ms`` for the first one."""
        records: list = []
        if timeout_ms and not self.sock.poll(timeout_ms, zmq.POLLIN):
            return records
        while len(records) < max_records:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                if len(frames) != 1:
                    raise WireError(f"{len(frames)} frames, expected 1")
                record = decode(frames[0], MAX_FRAME_BYTES)
                if not isinstance(record, self.accepted):
                    raise WireError(f"{type(record).__name__} is not a gateway message")
            except WireError as exc:
                self.num_rejected += 1
                log.warning("rejected frame from gateway: %s", exc)
                continue
            records.append(record)
        return records

    def close(self) -> None:
        self.sock.close(linger=0)
