"""The upsert family: insert, or replace an existing key's value (same size: in place;
another size: reallocated), on the same paths as the put family (:mod:`._bytes`)."""

from __future__ import annotations

from typing import Any

from mooncake._store.config import ReplicateConfig
from mooncake.store._bytes import BytesMethods


class UpsertMethods(BytesMethods):
    """``upsert``, ``upsert_parts``, ``upsert_batch``, ``upsert_from``, ``batch_upsert_from``."""

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Insert or replace ``key`` with ``value``; 0 or a negative code."""
        return self._put_value(key, value, config, True)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Insert or replace ``key`` with the concatenation of ``parts``."""
        return self._put_parts(key, parts, config, True)

    def upsert_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        return self._put_batch(keys, values, config, True)

    def upsert_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self._put_from(key, buffer_ptr, size, config, True)

    def batch_upsert_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        return self._batch_from(keys, buffer_ptrs, sizes, config, True)
