"""The published ``mooncake.mooncake_ep_buffer`` (DeepEP-style ``Buffer`` over Mooncake EP).

Its work is done by CUDA kernels of the ``mooncake._ep`` extension (``WITH_EP=ON``), which
this package does not have: the module imports, and ``Buffer`` / ``EventOverlap`` raise
:class:`~mooncake.errors.NotSupportedError` when constructed, naming what is missing.
"""

from __future__ import annotations

from mooncake import _unsupported

MISSING = "CUDA GPUs and the Mooncake EP extension mooncake._ep (built with WITH_EP=ON)"

Buffer = _unsupported.cls(__name__, "Buffer", MISSING)
EventOverlap = _unsupported.cls(__name__, "EventOverlap", MISSING)

__all__ = ["Buffer", "EventOverlap"]
