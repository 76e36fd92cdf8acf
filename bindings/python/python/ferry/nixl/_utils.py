"""``nixl._utils``: the test helpers NIXL's own examples use to get raw host memory, on memory this
module owns (page-aligned numpy buffers kept alive until freed)."""

import ctypes
from typing import Dict

import numpy as np

_PAGE = 4096
_buffers: Dict[int, np.ndarray] = {}


def malloc_passthru(size: int) -> int:
    """The address of ``size`` new bytes, aligned to 4096, valid until ``free_passthru``."""
    if size <= 0:
        raise ValueError("size must be positive")
    raw = np.zeros(size + _PAGE, dtype=np.uint8)
    offset = (-raw.ctypes.data) % _PAGE
    addr = int(raw.ctypes.data) + offset
    _buffers[addr] = raw
    return addr


def free_passthru(buf: int) -> None:
    if _buffers.pop(int(buf), None) is None:
        raise ValueError(f"0x{buf:x} was not allocated by malloc_passthru")


def ba_buf(addr: int, size: int) -> None:
    """Fills ``size`` bytes at ``addr`` with 0xba."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Raises AssertionError unless the ``size`` bytes at both addresses are equal."""
    if ctypes.string_at(int(addr1), int(size)) != ctypes.string_at(int(addr2), int(size)):
        raise AssertionError(f"the {size} bytes at 0x{addr1:x} and 0x{addr2:x} differ")
