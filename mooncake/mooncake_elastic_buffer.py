"""The published ``mooncake.mooncake_elastic_buffer`` (DeepEP's ``ElasticBuffer`` API).

Backed by the CUDA kernels of ``mooncake._ep`` (``WITH_EP=ON``), which this package does not
have: the module imports, and ``ElasticBuffer`` / ``EPHandle`` / ``EventOverlap`` raise
:class:`~mooncake.errors.NotSupportedError` when constructed, naming what is missing.
"""

from __future__ import annotations

from mooncake import _unsupported
from mooncake.mooncake_ep_buffer import EventOverlap

MISSING = "CUDA GPUs and the Mooncake EP extension mooncake._ep (built with WITH_EP=ON)"

ElasticBuffer = _unsupported.cls(__name__, "ElasticBuffer", MISSING)
EPHandle = _unsupported.cls(__name__, "EPHandle", MISSING)

__all__ = ["EPHandle", "ElasticBuffer", "EventOverlap"]
