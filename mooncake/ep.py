"""The published ``mooncake.ep`` (Mooncake EP: expert-parallel all-to-all over RDMA GPUs).

The published module loads the CUDA extension ``mooncake._ep`` built with ``WITH_EP=ON``.
This package has no such extension: the module imports, and each of its names (``Buffer``,
``ElasticBuffer``, ``EventHandle``, ``get_ep_buffer_size_hint``,
``calculate_elastic_buffer_size``, and the process-group functions of :mod:`mooncake.pg`)
raises :class:`~mooncake.errors.NotSupportedError` at use. ``MAX_QP_COUNT`` keeps the
published value so sizing code that only reads it runs.
"""

from __future__ import annotations

from mooncake import _unsupported
from mooncake.pg import *  # noqa: F403 (the published module re-exports the PG names too)
from mooncake.pg import __all__ as _pg_all

MISSING = "the CUDA extension mooncake._ep (Mooncake EP, built with WITH_EP=ON) and CUDA GPUs"
MAX_QP_COUNT = 256

Buffer = _unsupported.cls(__name__, "Buffer", MISSING)
ElasticBuffer = _unsupported.cls(__name__, "ElasticBuffer", MISSING)
EventHandle = _unsupported.cls(__name__, "EventHandle", MISSING)
get_ep_buffer_size_hint = _unsupported.function(__name__, "get_ep_buffer_size_hint", MISSING)
calculate_elastic_buffer_size = _unsupported.function(
    __name__, "calculate_elastic_buffer_size", MISSING
)

__all__ = [
    "MAX_QP_COUNT",
    "Buffer",
    "ElasticBuffer",
    "EventHandle",
    "calculate_elastic_buffer_size",
    "get_ep_buffer_size_hint",
    *_pg_all,
]
