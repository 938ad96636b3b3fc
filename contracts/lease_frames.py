"""The lease socket's frames: the front's lease operations (admit, settle, renew, engine_check, stop) sent to
the gateway's process over a Unix socket of its own, past Triton's HTTP server and the Python backend's
IPC (front/lease_socket.py, gateway/lease_socket.py; docs/gateway.md).

Why: every request of the front crosses the gateway's one process twice, and through Triton each crossing
costs a request's IPC into the stub and a blocking round trip for each answer out of it, beside Triton's own
HTTP work: most of what one admit and settle cost there (docs/benchmarks.md). On the socket an operation
is one frame in and one frame out on the gateway's event loop.

A frame is a 4-byte big-endian length, then its payload:
- an operation: a JSON object, the operation's Triton generate_stream body (its inputs by name, flat, a
  single value as a scalar; its parameters beside them) with `id`, an integer the sender chooses, unique
  among its operations in flight on the connection;
- an answer: the operation's id (4 bytes, big-endian), its kind (1 byte: ANSWER, one of several; LAST, the
  operation's last; ERROR, its failure, also its last), then the answer's JSON (what Triton would carry in
  `text_output`) or the error's wire text (contracts/errors.py ServingError.wire).
"""
from __future__ import annotations

MAX_FRAME = 4 << 20  # a grouped admit of MAX_ADMITS_PER_GROUP prompts fits; a longer length is not a frame
ANSWER, LAST, ERROR = 0, 1, 2
_HEAD = 4


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_HEAD, "big") + payload


def answer_frame(op_id: int, kind: int, payload: bytes) -> bytes:
    return frame(op_id.to_bytes(4, "big") + bytes((kind,)) + payload)


def read_answer(payload: bytes) -> tuple[int, int, bytes]:
    """(operation id, kind, its JSON or error text) of an answer's payload."""
    if len(payload) < 5:
        raise ValueError("an answer frame shorter than its id and kind")
    return int.from_bytes(payload[:4], "big"), payload[4], payload[5:]


class FrameReader:
    """Whole frames out of a byte stream read in pieces of any size."""

    __slots__ = ("_buf",)

    def __init__(self):
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads `data` completes; raises ValueError on a length over MAX_FRAME (the peer is not
        speaking this protocol: the connection is done)."""
        buf = self._buf + data if self._buf else data
        out, pos, n = [], 0, len(buf)
        while n - pos >= _HEAD:
            size = int.from_bytes(buf[pos:pos + _HEAD], "big")
            if size > MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes, over the limit of {MAX_FRAME}")
            end = pos + _HEAD + size
            if end > n:
                break
            out.append(buf[pos + _HEAD:end])
            pos = end
        self._buf = buf[pos:] if pos < n else b""
        return out
