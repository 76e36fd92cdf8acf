"""What ``ferry.nixl`` sends to other processes, in formats of its own, checked field by field on
the way in, because they come from another process and possibly another host: agent metadata,
serialized descriptor lists, and NIXL notifications (arbitrary bytes) carried by ferry
notifications (two strings of at most 1024 characters each).

NIXL itself pickles descriptor lists; unpickling runs code chosen by the sender, so nothing here
is pickled. Each blob starts with an 8-byte magic and a 16-bit version; a version this code does
not know, a length that does not add up, a field of the wrong type or out of its range is refused
with ``nixlInvalidParamError`` before anything is used.
"""

import json
import re
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ._bindings import nixlInvalidParamError, nixl_mem_t

METADATA_MAGIC = b"FRYNXLMD"
DESCS_MAGIC = b"FRYNXLDL"
VERSION = 2

MAX_METADATA_BYTES = 16 << 20
MAX_REGIONS = 1 << 20
MAX_AGENT_NAME_CHARS = 256
MAX_LABEL_CHARS = 256
MAX_ADDR_CHARS = 256
MAX_DESCS = 1 << 24
MAX_DESC_META_BYTES = 1 << 16
MAX_SERIALIZED_DESCS_BYTES = 1 << 30

MAX_NOTIF_BYTES = 64 << 10
"""The largest NIXL notification ``ferry.nixl`` sends or reassembles: 64 ferry notifications."""

NOTIF_CHUNK = 1024
"""Bytes of a NIXL notification per ferry notification: one character each (latin-1)."""

_HEADER = struct.Struct("<8sHI")
_DESCS_HEADER = struct.Struct("<8sHBBQ")
_KIND_XFER = 1
_KIND_REG = 2
_U64 = (1 << 64) - 1
_ADDR = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):([0-9]{1,5})$")


def _bad(what: str) -> nixlInvalidParamError:
    return nixlInvalidParamError(f"NIXL_ERR_INVALID_PARAM: {what}")


def check_agent_name(name: Any) -> str:
    """An agent name as this package accepts it: a non-empty string, at most 256 characters,
    without control characters (it travels in every notification's header)."""
    if isinstance(name, bytes):
        try:
            name = name.decode()
        except UnicodeDecodeError:
            raise ValueError("agent name is not UTF-8") from None
    if not isinstance(name, str) or not name:
        raise ValueError("agent name must be a non-empty string")
    if len(name) > MAX_AGENT_NAME_CHARS:
        raise ValueError(f"agent name has {len(name)} characters; the limit is {MAX_AGENT_NAME_CHARS}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise ValueError("agent name must not contain control characters")
    return name


def check_label(label: Any) -> str:
    """A metadata label (NIXL's ``metadataLabel``): a string of at most 256 characters without
    control characters; empty means the agent's whole metadata."""
    if not isinstance(label, str) or len(label) > MAX_LABEL_CHARS or any(ord(c) < 0x20 or ord(c) == 0x7F for c in label):
        raise _bad(f"a metadata label is a string of at most {MAX_LABEL_CHARS} printable characters")
    return label


@dataclass(frozen=True)
class AgentMetadata:
    """An agent as another process sees it: its name, the ferry engine it runs (address and id),
    and the memory it registered, as ``(addr, len)`` pairs.

    ``partial`` metadata (NIXL's ``get_partial_agent_metadata``) adds its regions to what the
    receiver knows of the agent instead of replacing it, and may come without the engine's
    address (``addr`` None): then the receiver must know the agent already."""

    name: str
    addr: Optional[str]
    engine_id: int
    regions: Tuple[Tuple[int, int], ...]
    partial: bool = False


def encode_metadata(md: AgentMetadata) -> bytes:
    body = json.dumps(
        {
            "name": md.name,
            "addr": md.addr,
            "engine_id": md.engine_id,
            "regions": [[a, n] for a, n in md.regions],
            "partial": md.partial,
        },
        separators=(",", ":"),
    ).encode()
    return _HEADER.pack(METADATA_MAGIC, VERSION, len(body)) + body


def _u64(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _U64:
        raise _bad(f"{what} must be an integer in [0, 2^64)")
    return value


def _open(
    blob: Any, header: struct.Struct, magic: bytes, limit: int, what: str, not_ours: str
) -> Tuple[bytes, Tuple[Any, ...]]:
    """What every blob of ferry.nixl's starts with, checked: bytes, at most ``limit`` of them, the
    ``header`` whole, ``magic`` and this version first. The blob's bytes and the header's further
    fields."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise _bad(f"{what} must be bytes, not {type(blob).__name__}")
    data = bytes(blob)
    if len(data) > limit:
        raise _bad(f"{what} of {len(data)} bytes exceeds the limit of {limit}")
    if len(data) < header.size:
        raise _bad(f"{what} is truncated")
    found, version, *fields = header.unpack_from(data)
    if found != magic:
        raise _bad(not_ours)
    if version != VERSION:
        raise _bad(f"{what}: version {version}; this ferry.nixl reads version {VERSION}")
    return data, tuple(fields)


def decode_metadata(blob: Any) -> AgentMetadata:
    data, (length,) = _open(
        blob, _HEADER, METADATA_MAGIC, MAX_METADATA_BYTES, "agent metadata",
        "not ferry.nixl agent metadata (metadata from NIXL itself is not understood)",
    )
    if length != len(data) - _HEADER.size:
        raise _bad(f"agent metadata says {length} bytes of body but carries {len(data) - _HEADER.size}")
    try:
        doc = json.loads(data[_HEADER.size :].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(f"agent metadata body is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"name", "addr", "engine_id", "regions", "partial"}:
        raise _bad("agent metadata must hold exactly name, addr, engine_id, regions and partial")
    try:
        name = check_agent_name(doc["name"])
    except ValueError as e:
        raise _bad(f"agent metadata: {e}") from None
    partial = doc["partial"]
    if type(partial) is not bool:
        raise _bad("agent metadata: partial must be true or false")
    addr = doc["addr"]
    if addr is None and not partial:
        raise _bad("agent metadata: only partial metadata may come without the engine's address")
    if addr is not None:
        if not isinstance(addr, str) or len(addr) > MAX_ADDR_CHARS or not _ADDR.match(addr):
            raise _bad("agent metadata: addr must be host:port")
        if not 0 < int(_ADDR.match(addr).group(2)) < 65536:  # type: ignore[union-attr]
            raise _bad("agent metadata: port out of range")
    engine_id = _u64(doc["engine_id"], "engine_id")
    raw = doc["regions"]
    if not isinstance(raw, list) or len(raw) > MAX_REGIONS:
        raise _bad(f"agent metadata: regions must be a list of at most {MAX_REGIONS}")
    regions = []
    for r in raw:
        if not isinstance(r, list) or len(r) != 2:
            raise _bad("agent metadata: each region must be [addr, len]")
        a, n = _u64(r[0], "region addr"), _u64(r[1], "region len")
        if n == 0 or a + n > _U64 + 1:
            raise _bad("agent metadata: a region is empty or wraps around the address space")
        regions.append((a, n))
    return AgentMetadata(name, addr, engine_id, tuple(regions), partial)


def encode_descs(kind_reg: bool, mem: nixl_mem_t, rows: np.ndarray, metas: Optional[List[bytes]]) -> bytes:
    n = int(rows.shape[0])
    parts = [
        _DESCS_HEADER.pack(DESCS_MAGIC, VERSION, _KIND_REG if kind_reg else _KIND_XFER, int(mem), n),
        np.ascontiguousarray(rows, dtype="<u8").tobytes(),
    ]
    if kind_reg:
        assert metas is not None
        for m in metas:
            parts.append(struct.pack("<I", len(m)))
            parts.append(m)
    return b"".join(parts)


def decode_descs(blob: Any) -> Tuple[bool, nixl_mem_t, np.ndarray, Optional[List[bytes]]]:
    """``(is_registration_list, mem_type, N×3 rows, metas or None)``."""
    data, (kind, mem, n) = _open(
        blob, _DESCS_HEADER, DESCS_MAGIC, MAX_SERIALIZED_DESCS_BYTES, "a serialized descriptor list",
        "not a ferry.nixl descriptor list (NIXL's pickles are not read)",
    )
    if kind not in (_KIND_XFER, _KIND_REG):
        raise _bad(f"unknown descriptor list kind {kind}")
    try:
        mem_type = nixl_mem_t(mem)
    except ValueError:
        raise _bad(f"unknown memory type {mem}") from None
    if n > MAX_DESCS:
        raise _bad(f"{n} descriptors exceed the limit of {MAX_DESCS}")
    end = _DESCS_HEADER.size + 24 * n
    if len(data) < end:
        raise _bad("serialized descriptors are truncated")
    rows = np.frombuffer(data, dtype="<u8", count=3 * n, offset=_DESCS_HEADER.size).reshape(n, 3)
    rows = rows.astype(np.uint64, copy=True)
    metas: Optional[List[bytes]] = None
    if kind == _KIND_REG:
        metas = []
        pos = end
        for _ in range(n):
            if len(data) < pos + 4:
                raise _bad("serialized descriptors are truncated")
            (m,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if m > MAX_DESC_META_BYTES or len(data) < pos + m:
                raise _bad("descriptor metadata is oversized or truncated")
            metas.append(data[pos : pos + m])
            pos += m
        end = pos
    if end != len(data):
        raise _bad(f"{len(data) - end} bytes follow the serialized descriptors")
    if n and bool(((rows[:, 0] + rows[:, 1]) < rows[:, 0]).any()):
        raise _bad("a descriptor wraps around the address space")
    return kind == _KIND_REG, mem_type, rows, metas


NOTIF_PREFIX = "nixl1"
EXCHANGE_PREFIX = "nixlx1"
"""Frames of the metadata exchange (``send_local_metadata``, ``fetch_remote_metadata``...), kept
apart from NIXL notifications: the agent's listener answers them, ``get_new_notifs`` never sees
them."""

MAX_EXCHANGE_BYTES = 1 << 20
"""The largest metadata-exchange message: 1024 ferry notifications (agent metadata of about
20,000 registered regions)."""

_FRAME_NAME = re.compile(r"^(nixl1|nixlx1) ([0-9a-f]{1,16}) ([0-9a-f]{1,4}) ([0-9a-f]{1,4}) (.+)$", re.DOTALL)


def _limit(prefix: str) -> int:
    return MAX_EXCHANGE_BYTES if prefix == EXCHANGE_PREFIX else MAX_NOTIF_BYTES


def notif_frames(sender: str, msg_id: int, msg: bytes, prefix: str = NOTIF_PREFIX) -> List[Tuple[str, str]]:
    """The ferry notifications ``(name, msg)`` that carry ``msg`` from agent ``sender``: the name
    says which message, which part and how many parts, and who sent it; each body holds up to
    1024 bytes, one character per byte. ``prefix`` is ``NOTIF_PREFIX`` for a NIXL notification
    (64 KiB at most), ``EXCHANGE_PREFIX`` for a metadata-exchange message (1 MiB at most)."""
    limit = _limit(prefix)
    if len(msg) > limit:
        what = "a notification" if prefix == NOTIF_PREFIX else "a metadata-exchange message"
        raise _bad(f"{what} of {len(msg)} bytes exceeds the limit of {limit}")
    parts = max(1, -(-len(msg) // NOTIF_CHUNK))
    return [
        (
            f"{prefix} {msg_id:x} {i:x} {parts:x} {sender}",
            msg[i * NOTIF_CHUNK : (i + 1) * NOTIF_CHUNK].decode("latin-1"),
        )
        for i in range(parts)
    ]


def frame_prefix(name: str) -> Optional[str]:
    """``NOTIF_PREFIX`` or ``EXCHANGE_PREFIX`` for a frame of ``ferry.nixl``, else None."""
    m = _FRAME_NAME.match(name)
    return None if m is None else m.group(1)


def parse_notif(name: str, body: str, prefix: str = NOTIF_PREFIX) -> Optional[Tuple[str, int, int, int, bytes]]:
    """``(sender, msg_id, part, parts, bytes)`` of one frame with ``prefix``, or None for a
    notification that is not one (sent by something other than ``ferry.nixl``, or malformed)."""
    m = _FRAME_NAME.match(name)
    if m is None or m.group(1) != prefix:
        return None
    msg_id, part, parts = int(m.group(2), 16), int(m.group(3), 16), int(m.group(4), 16)
    sender = m.group(5)
    if not 0 <= part < parts or parts * NOTIF_CHUNK > _limit(prefix) + NOTIF_CHUNK - 1:
        return None
    if len(body) > NOTIF_CHUNK or (part + 1 < parts and len(body) != NOTIF_CHUNK):
        return None
    try:
        payload = body.encode("latin-1")
    except UnicodeEncodeError:
        return None
    try:
        check_agent_name(sender)
    except ValueError:
        return None
    return sender, msg_id, part, parts, payload


class NotifAssembler:
    """Puts multi-part NIXL notifications back together, per sending engine and message id, and
    bounds what waits: at most ``max_partial`` incomplete messages per sender (the oldest is
    dropped beyond that, as a sender that died mid-message leaves one behind), and ``max_total``
    in all, whatever names the senders claim."""

    def __init__(self, max_partial: int = 64, max_total: int = 1024, prefix: str = NOTIF_PREFIX) -> None:
        self._partial: Dict[Tuple[int, str, str, int], List[bytes]] = {}
        self._max_partial = max_partial
        self._max_total = max_total
        self._prefix = prefix

    def feed(self, from_engine: int, from_addr: str, name: str, body: str) -> Optional[Tuple[str, bytes]]:
        frame = parse_notif(name, body, self._prefix)
        if frame is None:
            return None
        sender, msg_id, part, parts, payload = frame
        if parts == 1:
            return sender, payload
        key = (from_engine, from_addr, sender, msg_id)
        got = self._partial.get(key)
        if got is None:
            if part != 0:
                return None
            same_sender = [k for k in self._partial if k[:3] == key[:3]]
            if len(same_sender) >= self._max_partial:
                del self._partial[same_sender[0]]
            if len(self._partial) >= self._max_total:
                del self._partial[next(iter(self._partial))]
            got = self._partial[key] = []
        if part != len(got):
            del self._partial[key]
            return None
        got.append(payload)
        if len(got) < parts:
            return None
        del self._partial[key]
        return sender, b"".join(got)


EXCHANGE_MAGIC = b"FRYNXLEX"
_EXCHANGE_HEADER = struct.Struct("<8sHB")

EX_SEND = 1
"""Body: the sender's agent metadata; the receiver loads it (as ``add_remote_agent``)."""
EX_FETCH = 2
"""Body: u16 length and the name asked for (UTF-8), u16 length and the label asked for (UTF-8;
empty: the whole metadata, as between peers), then the asker's metadata (no regions): where to
send the answer."""
EX_ANSWER = 3
"""Body: the answering agent's metadata, for the asker to load."""
EX_NOT_FOUND = 4
"""Body: the name asked for, which the answering agent does not have."""
EX_INVALIDATE = 5
"""Body: empty; the receiver forgets the sending agent."""
_EX_KINDS = (EX_SEND, EX_FETCH, EX_ANSWER, EX_NOT_FOUND, EX_INVALIDATE)


def encode_exchange(kind: int, body: bytes = b"") -> bytes:
    assert kind in _EX_KINDS
    return _EXCHANGE_HEADER.pack(EXCHANGE_MAGIC, VERSION, kind) + body


def encode_fetch(wanted: str, asker: AgentMetadata, label: str = "") -> bytes:
    name, tag = wanted.encode(), check_label(label).encode()
    return encode_exchange(
        EX_FETCH, struct.pack("<H", len(name)) + name + struct.pack("<H", len(tag)) + tag + encode_metadata(asker)
    )


def _split_u16(body: bytes, what: str) -> Tuple[bytes, bytes]:
    """A u16-length-prefixed field off the front of ``body``: ``(field, rest)``."""
    if len(body) < 2:
        raise _bad(f"{what} is truncated")
    (n,) = struct.unpack_from("<H", body)
    if len(body) < 2 + n:
        raise _bad(f"{what} is truncated")
    return body[2 : 2 + n], body[2 + n :]


def decode_exchange(data: bytes) -> Tuple[int, Any]:
    """``(kind, value)``: the metadata for ``EX_SEND``/``EX_ANSWER``, ``(name, label, asker
    metadata)`` for ``EX_FETCH``, the name for ``EX_NOT_FOUND``, None for ``EX_INVALIDATE``;
    ``nixlInvalidParamError`` for anything malformed."""
    data, (kind,) = _open(
        data, _EXCHANGE_HEADER, EXCHANGE_MAGIC, MAX_EXCHANGE_BYTES, "a metadata-exchange message",
        "not a ferry.nixl metadata-exchange message",
    )
    body = data[_EXCHANGE_HEADER.size :]
    if kind in (EX_SEND, EX_ANSWER):
        return kind, decode_metadata(body)
    if kind in (EX_FETCH, EX_NOT_FOUND):
        if kind == EX_NOT_FOUND:
            raw, raw_label, rest = body, b"", b""
        else:
            raw, rest = _split_u16(body, "metadata-exchange fetch")
            raw_label, rest = _split_u16(rest, "metadata-exchange fetch")
        try:
            name = check_agent_name(raw)
            label = check_label(raw_label.decode())
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"metadata-exchange message: {e}") from None
        return kind, (name if kind == EX_NOT_FOUND else (name, label, decode_metadata(rest)))
    if kind == EX_INVALIDATE:
        if body:
            raise _bad("metadata-exchange invalidation carries no body")
        return kind, None
    raise _bad(f"unknown metadata-exchange message kind {kind}")
