"""``BundleTransferPolicy`` checks: the values a policy may take, and what ``zero_copy`` asks of
the members of a put.

On a store with the multi-buffer calls every put is one batched call that reads the caller's
memory in place where it can, so ``max_inflight_put`` and ``put_mode`` change nothing there;
they (and ``copy_mode="copy"``) steer only the pooled writes of a store without those calls
(:meth:`mooncake._structured.io.BatchIO.put_many`). ``copy_mode=
"zero_copy"`` is the published module's promise that no member is copied into staging memory:
only members that already are tensor-object buffers (caller memory, typically a ``BufferPool``
lease) qualify, so a put of anything else is refused before a byte is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mooncake._structured.model import (
    BundleTransferPolicy,
    StructuredObjectError,
    TensorObjectBuffer,
    optional_module,
)
from mooncake.errors import InvalidArgumentError

__all__ = ["check_policy", "check_zero_copy"]

_torch: Any = optional_module("torch")


def check_policy(
    policy: BundleTransferPolicy | None, max_inflight_put: int | None = None
) -> BundleTransferPolicy:
    """The policy to use (defaults filled in), validated as the published module does."""
    result = policy or BundleTransferPolicy()
    if max_inflight_put is not None:
        result = BundleTransferPolicy(max_inflight_put, result.put_mode, result.copy_mode)
    if result.max_inflight_put < 1:
        raise InvalidArgumentError("max_inflight_put must be positive")
    if result.put_mode not in ("auto", "batch", "parallel"):
        raise InvalidArgumentError(f"unsupported put_mode: {result.put_mode}")
    if result.copy_mode not in ("auto", "zero_copy", "copy"):
        raise InvalidArgumentError(f"unsupported copy_mode: {result.copy_mode}")
    return result


def _nbytes(value: Any) -> int:
    parts = getattr(value, "parts", None)  # a codec's multi-part payload member
    if isinstance(parts, tuple):
        return sum(_nbytes(p) for p in parts)
    try:
        return memoryview(value).nbytes
    except TypeError:
        return -1  # not bytes-like: never empty


def check_zero_copy(policy: BundleTransferPolicy, buffers: Mapping[str, Any]) -> None:
    """Under ``copy_mode="zero_copy"``, refuse a put whose members are not all tensor-object
    buffers (empty members aside), as the published module does: a torch tensor raises
    ``InvalidArgumentError`` (a ``ValueError``), anything else ``StructuredObjectError`` (a
    ``RuntimeError``), each naming the member. Other copy modes accept everything."""
    if policy.copy_mode != "zero_copy":
        return
    for name, value in buffers.items():
        if isinstance(value, TensorObjectBuffer):
            continue
        if _torch is not None and isinstance(value, _torch.Tensor):
            raise InvalidArgumentError(
                "zero-copy structured tensor fields require a BufferPool tensor-object buffer "
                f"(member {name!r} is a plain tensor)"
            )
        if _nbytes(value) == 0:
            continue
        raise StructuredObjectError(
            f"zero-copy put requires tensor-object buffers (member {name!r} is "
            f"{type(value).__name__})"
        )
