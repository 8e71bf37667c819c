"""The published ``mooncake.allocator``: torch pluggable allocators for NVLink / Barex memory.

The published module loads ``nvlink_allocator.so`` (CUDA fabric memory) or ``libaccl_barex.so``
into ``torch.cuda.memory.CUDAPluggableAllocator``. This package ships neither library, so
``NVLinkAllocator.detect_mem_backend()`` answers ``MemoryBackend.UNSUPPORTED`` and
``get_allocator`` raises ``ImportError`` saying what is missing: callers that probe the backend
first (SGLang's custom memory pool does) fall back to the default CUDA allocator.
"""

from __future__ import annotations

import enum
import os
from typing import Any

__all__ = ["BarexAllocator", "MemoryBackend", "NVLinkAllocator"]


class MemoryBackend(enum.IntEnum):
    USE_CUDAMALLOC = 0
    USE_CUMEMCREATE = 1
    UNKNOWN = -1
    UNSUPPORTED = -2


class NVLinkAllocator:
    """NVLink fabric-memory allocator (not provided here; see the module docstring)."""

    @classmethod
    def detect_mem_backend(cls) -> MemoryBackend:
        return MemoryBackend.UNSUPPORTED

    @classmethod
    def get_allocator(cls, device: Any) -> Any:
        raise ImportError(
            "NVLinkAllocator needs nvlink_allocator.so from the published CUDA wheel; "
            "mooncake-py does not provide it"
        )


class BarexAllocator:
    """Barex allocator: uses ``libaccl_barex.so`` when the system has it."""

    _PATHS = ("/usr/lib/libaccl_barex.so", "/usr/lib64/libaccl_barex.so")

    @classmethod
    def _get_so_path(cls) -> str:
        for p in cls._PATHS:
            if os.path.exists(p):
                return p
        raise ImportError(
            "BarexAllocator requires libaccl_barex.so to be installed. "
            "Please install the barex library or ensure it's in the system path."
        )

    @classmethod
    def get_allocator(cls, device: Any) -> Any:
        so = cls._get_so_path()
        from torch.cuda.memory import CUDAPluggableAllocator

        return CUDAPluggableAllocator(
            so, "u2mm_alloc_wrapper_with_stream", "u2mm_free_wrapper_with_stream"
        )
