"""What the tensor layer asks of the store object it is mixed into: :class:`TensorHost`.

A leaf (imports nothing of the package), so both sides name one interface: the tensor object
paths (:mod:`mooncake._store.tensor_io`) take a ``TensorHost`` argument, and the facade mixins
(:mod:`mooncake._store.facade_tensors`, :mod:`mooncake._store.facade_parallel`) are typed as
one while type checking, where their methods call these on ``self``.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["TensorHost"]


class TensorHost(Protocol):
    """The byte-level methods of the published store the tensor I/O is built on (a facade
    object; its ``_dummy`` / ``_store`` / ``_fast`` attributes are read when present).

    Each answers as the published method of its name: a code (0 or a byte count, negative on
    failure), or a list of them for the batch forms; ``config`` is a ``ReplicateConfig`` or
    None."""

    def put(self, key: str, value: Any, config: Any = None) -> int: ...
    def upsert(self, key: str, value: Any, config: Any = None) -> int: ...
    def put_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int: ...
    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int: ...
    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
    ) -> list[int]: ...
    def batch_upsert_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
    ) -> list[int]: ...
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
    def get_size(self, key: str) -> int: ...
    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...
    def batch_get_buffer(self, keys: list[str]) -> list[Any]: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
