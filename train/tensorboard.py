"""TensorBoard scalars written directly: a TFRecord file of `Event` protocol buffers (what TensorBoard reads),
encoded here because the writers on PyPI import PyTorch or TensorFlow (tensorboardX's costs every `train.main`
start 1-1.5 s importing torch, which nothing else in training needs).

Record framing: little-endian uint64 length, its masked CRC-32C, the bytes, their masked CRC-32C. An Event holds
wall_time (field 1, double), step (2, varint), file_version (3, string) or a Summary (5) of Values, each a tag
(1, string) and a simple_value (2, float)."""

from __future__ import annotations

import os
import socket
import struct
import time


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of TFRecord files."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): strings and nested messages."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, *, file_version: str | None = None, scalars: dict | None = None) -> bytes:
    """One serialized Event: the file's version record, or a step's scalars as one Summary."""
    body = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        body += _field(3, file_version.encode())
    if scalars:
        values = (_field(1, tag.encode()) + b"\x15" + struct.pack("<f", value) for tag, value in scalars.items())
        body += _field(5, b"".join(_field(1, value) for value in values))
    return body


def record(data: bytes) -> bytes:
    """TFRecord framing of one serialized message."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


class EventWriter:
    """Appends `{tag: value}` scalars at a step to a new `events.out.tfevents.*` file in `logdir`."""

    def __init__(self, logdir: str):
        name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
        self.file = open(os.path.join(logdir, name), "ab")  # noqa: SIM115 (open for the life of the run)
        self.file.write(record(event(time.time(), 0, file_version="brain.Event:2")))
        self.file.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.file.write(record(event(time.time(), step, scalars={k: float(v) for k, v in values.items()})))
        self.file.flush()

    def close(self) -> None:
        self.file.close()
