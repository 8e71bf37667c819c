"""``EngramStore``: Engram embedding tables on the store, one float32 table per head.

The published ``mooncake.store.EngramStore`` / ``EngramStoreConfig`` (upstream
``docs/source/design/store/engram.md``): the caller fixes the layout (``table_vocab_sizes``
``[N_0..N_{H-1}]`` and ``embedding_dim`` ``D``), uploads one ``[N_h, D]`` table per head with
:meth:`EngramStore.populate` and reads rows back by precomputed ids ``[B, L, H]`` with
:meth:`EngramStore.lookup`, which returns ``[B, L, H, D]``. Head ``h`` of layer ``layer_id`` is
the object ``engram:l{layer_id}:h{h}`` (raw float32 rows, C order), so a published client
reads what this one wrote and the other way round.

Built only on the sync client's public calls: ``batch_is_exist``, ``register_buffer`` /
``unregister_buffer``, ``batch_put_from``, ``get_into_ranges`` (one range per looked-up row,
straight into the output array) and ``remove``. Errors are raised as in the published binding
(``RuntimeError`` for a failed or refused call, ``ValueError`` for a bad config), as classes of
this package's tree: :class:`EngramArgumentError` (bad input, also an
:class:`~mooncake.errors.InvalidArgumentError`) and :class:`EngramStoreError` (the store
refused, a :class:`~mooncake.errors.StoreError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mooncake.errors import ErrorCode, InvalidArgumentError, StoreError

__all__ = ["EngramArgumentError", "EngramStore", "EngramStoreConfig", "EngramStoreError"]

_STORE_CALLS = (
    "batch_is_exist",
    "register_buffer",
    "unregister_buffer",
    "batch_put_from",
    "get_into_ranges",
    "remove",
)
_ROW_ITEM = np.dtype(np.float32).itemsize


class EngramArgumentError(InvalidArgumentError, RuntimeError):
    """Bad input to an EngramStore call (also a ``RuntimeError``, as the published binding
    raises it)."""


class EngramStoreError(StoreError, RuntimeError):
    """The store refused or failed an EngramStore step; ``rc`` is the first code seen."""

    def __init__(self, message: str, rc: int = int(ErrorCode.INTERNAL_ERROR)) -> None:
        super().__init__(message)
        self.rc = rc


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


class EngramStoreConfig:
    """The physical layout of one EngramStore layer: ``table_vocab_sizes`` (rows per head,
    default ``[1024]``) and ``embedding_dim`` (row width, default 64). Setting a field checks
    its type (``TypeError``); the values are checked by :class:`EngramStore`."""

    __slots__ = ("_embedding_dim", "_table_vocab_sizes")

    def __init__(self) -> None:
        self._table_vocab_sizes: tuple[int, ...] = (1024,)
        self._embedding_dim = 64

    @property
    def table_vocab_sizes(self) -> list[int]:
        """A copy: changing the returned list changes nothing (assign the field instead)."""
        return list(self._table_vocab_sizes)

    @table_vocab_sizes.setter
    def table_vocab_sizes(self, value: Sequence[int]) -> None:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(
                f"table_vocab_sizes must be a sequence of ints, got {type(value).__name__}"
            )
        self._table_vocab_sizes = tuple(_int(v, "table_vocab_sizes item") for v in value)

    @property
    def embedding_dim(self) -> int:
        return self._embedding_dim

    @embedding_dim.setter
    def embedding_dim(self, value: int) -> None:
        self._embedding_dim = _int(value, "embedding_dim")

    def __repr__(self) -> str:
        return (
            f"EngramStoreConfig(table_vocab_sizes={list(self._table_vocab_sizes)}, "
            f"embedding_dim={self._embedding_dim})"
        )


class EngramStore:
    """One Engram layer's head tables on a store.

    ``EngramStore(layer_id, config, store=None)`` copies the layout from ``config`` (later
    changes to ``config`` do not apply) and refuses an empty ``table_vocab_sizes``, a size or
    ``embedding_dim`` that is not positive (``ValueError``). ``store`` is a set-up
    ``MooncakeDistributedStore`` (or anything with its ``batch_is_exist``, ``register_buffer``,
    ``unregister_buffer``, ``batch_put_from``, ``get_into_ranges`` and ``remove``); without one
    only the metadata getters work and the store calls raise.
    """

    def __init__(self, layer_id: int, config: EngramStoreConfig, store: Any = None) -> None:
        layer_id = _int(layer_id, "layer_id")
        if not isinstance(config, EngramStoreConfig):
            raise TypeError(f"config must be an EngramStoreConfig, got {type(config).__name__}")
        if store is not None:
            missing = [name for name in _STORE_CALLS if not callable(getattr(store, name, None))]
            if missing:
                raise EngramArgumentError(
                    "EngramStore store parameter must be a MooncakeDistributedStore "
                    f"(a {type(store).__name__} lacks {', '.join(missing)})"
                )
        sizes = config.table_vocab_sizes
        if not sizes:
            raise InvalidArgumentError("EngramStoreConfig.table_vocab_sizes must not be empty")
        if config.embedding_dim <= 0:
            raise InvalidArgumentError("EngramStoreConfig.embedding_dim must be positive")
        if any(n <= 0 for n in sizes):
            raise InvalidArgumentError(
                "EngramStoreConfig.table_vocab_sizes must contain only positive values"
            )
        self._store = store
        self._sizes = np.asarray(sizes, dtype=np.int64)
        self._dim = config.embedding_dim
        self._keys = [f"engram:l{layer_id}:h{h}" for h in range(len(sizes))]

    # -- metadata ---------------------------------------------------------------------------

    def get_table_vocab_sizes(self) -> list[int]:
        return [int(n) for n in self._sizes]

    def get_store_keys(self) -> list[str]:
        return list(self._keys)

    def get_num_heads(self) -> int:
        return len(self._keys)

    def get_embedding_dim(self) -> int:
        return self._dim

    def _require_store(self, op: str) -> Any:
        if self._store is None:
            raise EngramStoreError(
                f"EngramStore.{op}: constructed without a store", int(ErrorCode.INVALID_PARAMS)
            )
        return self._store

    # -- populate -----------------------------------------------------------------------------

    def populate(self, embedding_buffers: Sequence[Any]) -> None:
        """Create the head tables from one ``[N_h, D]`` NumPy array per head (converted to
        C-contiguous float32 when it is not). Create-only: refused when any head key exists
        (remove the layer first). If an upload fails, the keys written by this call are removed
        before the error is raised."""
        store = self._require_store("populate")
        if not isinstance(embedding_buffers, Sequence) or isinstance(embedding_buffers, str):
            raise EngramArgumentError("embedding_buffers must be a list of NumPy arrays")
        if len(embedding_buffers) != len(self._keys):
            raise EngramArgumentError(
                f"embedding_buffers size must match num_heads ({len(embedding_buffers)} "
                f"tables for {len(self._keys)} heads)"
            )
        tables: list[np.ndarray] = []
        for h, buf in enumerate(embedding_buffers):
            if not isinstance(buf, np.ndarray):
                raise EngramArgumentError(
                    f"embedding_buffers[{h}] must be a NumPy array, got {type(buf).__name__}"
                )
            want = (int(self._sizes[h]), self._dim)
            if buf.ndim != 2 or tuple(buf.shape) != want:
                raise EngramArgumentError(
                    f"embedding_buffers[{h}] has shape {tuple(buf.shape)}, expected {want} "
                    "(get_table_vocab_sizes()/get_embedding_dim())"
                )
            try:
                tables.append(np.ascontiguousarray(buf, dtype=np.float32))
            except (TypeError, ValueError) as e:
                raise EngramArgumentError(
                    f"embedding_buffers[{h}] must be float32-convertible: {e}"
                ) from e
        exists = store.batch_is_exist(self._keys)
        if len(exists) != len(self._keys):
            raise EngramStoreError("populate: key existence check failed")
        for key, rc in zip(self._keys, exists, strict=True):
            if rc < 0:
                raise EngramStoreError(f"populate: existence check of {key!r} failed", rc)
            if rc:
                raise EngramStoreError(
                    f"populate requires an empty destination: {key!r} exists "
                    "(remove_from_store() first)",
                    int(ErrorCode.OBJECT_ALREADY_EXISTS),
                )
        ptrs = [t.ctypes.data for t in tables]
        sizes = [t.nbytes for t in tables]
        registered: list[int] = []
        try:
            for ptr, size in zip(ptrs, sizes, strict=True):
                rc = store.register_buffer(ptr, size)
                if rc != 0:
                    raise EngramStoreError(f"populate: register_buffer failed, rc={rc}", rc)
                registered.append(ptr)
            results = list(store.batch_put_from(self._keys, ptrs, sizes))
        finally:
            unregister_rcs = [store.unregister_buffer(ptr) for ptr in registered]
        bad = [rc for rc in unregister_rcs if rc != 0]
        failed = len(results) != len(self._keys) or any(rc != 0 for rc in results)
        if failed or bad:
            complete = len(results) == len(self._keys)
            for i, key in enumerate(self._keys):
                if complete and results[i] != 0:
                    continue  # not written by this call
                store.remove(key, True)
            codes = [rc for rc in results if rc != 0] + bad
            first = codes[0] if codes else int(ErrorCode.INTERNAL_ERROR)
            raise EngramStoreError(f"populate failed, rc={first} (written heads removed)", first)

    # -- lookup -------------------------------------------------------------------------------

    def _row_ids(self, row_ids: Any) -> np.ndarray:
        heads = len(self._keys)
        if isinstance(row_ids, np.ndarray):
            ids = row_ids
            if ids.ndim != 3:
                raise EngramArgumentError(
                    f"row_ids array must have shape [B, L, H], got {tuple(ids.shape)}"
                )
        else:
            if not isinstance(row_ids, Sequence) or isinstance(row_ids, (str, bytes)):
                raise EngramArgumentError(
                    f"row_ids must be a [B, L, H] nested list or array, got {type(row_ids).__name__}"
                )
            try:
                ids = np.asarray(row_ids)
            except ValueError as e:  # ragged
                raise EngramArgumentError(f"row_ids must be a [B, L, H] nested list: {e}") from e
            if ids.ndim != 3 and ids.size == 0:
                raise EngramArgumentError("row_ids must not be empty")
            if ids.ndim != 3 or ids.dtype == object:
                raise EngramArgumentError(
                    f"row_ids must be a [B, L, H] nested list, got shape {ids.shape}"
                )
        if ids.shape[0] == 0 or ids.shape[1] == 0:
            raise EngramArgumentError(f"row_ids must not be empty, got shape {ids.shape}")
        if ids.shape[2] != heads:
            raise EngramArgumentError(
                f"row_ids last dimension must match num_heads ({ids.shape[2]} != {heads})"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise EngramArgumentError(f"row_ids must be integers, got dtype {ids.dtype}")
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        bad = (ids < 0) | (ids >= self._sizes)
        if bad.any():
            b, pos, h = (int(i) for i in np.argwhere(bad)[0])
            raise EngramArgumentError(
                f"row_ids[{b}][{pos}][{h}] = {int(ids[b, pos, h])} is outside head {h}'s "
                f"table [0, {int(self._sizes[h])})"
            )
        return ids

    def lookup(self, row_ids: Any) -> np.ndarray:
        """The rows ``row_ids[b, l, h]`` of head ``h``'s table, as a new float32 array
        ``[B, L, H, D]``. ``row_ids`` is a nested list or an integer array ``[B, L, H]``,
        non-empty, every id in ``[0, N_h)``. Raises :class:`EngramStoreError` when a table is
        missing or a read fails (nothing partial is returned)."""
        store = self._require_store("lookup")
        ids = self._row_ids(row_ids)
        batch, length, heads = ids.shape
        row_bytes = self._dim * _ROW_ITEM
        out = np.empty((batch, length, heads, self._dim), dtype=np.float32)
        # row (b, l, h) lands at flat position (b*L + l)*H + h; per head, in that order
        flat = ids.reshape(-1, heads)
        dst = (np.arange(flat.shape[0], dtype=np.int64)[:, None] * heads + np.arange(heads)) * (
            row_bytes
        )
        dst_offsets = [dst[:, h].tolist() for h in range(heads)]
        src_offsets = [(flat[:, h] * row_bytes).tolist() for h in range(heads)]
        sizes = [[row_bytes] * flat.shape[0] for _ in range(heads)]
        ptr = out.ctypes.data
        rc = store.register_buffer(ptr, out.nbytes)
        if rc != 0:
            raise EngramStoreError(f"EngramStore lookup failed: register_buffer rc={rc}", rc)
        try:
            results = store.get_into_ranges(
                [ptr], [self._keys], [dst_offsets], [src_offsets], [sizes]
            )
        finally:
            unregister_rc = store.unregister_buffer(ptr)
        for h, key in enumerate(self._keys):
            got = results[0][h] if len(results) == 1 and len(results[0]) == heads else None
            if got is None or len(got) != flat.shape[0]:
                raise EngramStoreError(f"EngramStore lookup failed: malformed reply for {key!r}")
            short = [r for r in got if r != row_bytes]
            if short:
                raise EngramStoreError(
                    f"EngramStore lookup failed: reading {key!r} gave {short[0]}",
                    short[0] if short[0] < 0 else int(ErrorCode.INTERNAL_ERROR),
                )
        if unregister_rc != 0:
            raise EngramStoreError(
                f"EngramStore lookup failed: unregister_buffer rc={unregister_rc}", unregister_rc
            )
        return out

    # -- remove -------------------------------------------------------------------------------

    def remove_from_store(self, force: bool = False) -> int:
        """Remove this layer's head tables; the number removed (keys already gone are skipped).
        Raises :class:`EngramStoreError` with the first other code (the rest are still tried)."""
        if self._store is None:
            rc = int(ErrorCode.INVALID_PARAMS)
            raise EngramStoreError(f"remove_from_store failed, rc={rc}", rc)
        removed, first_error = 0, 0
        for key in self._keys:
            rc = self._store.remove(key, bool(force))
            if rc == 0:
                removed += 1
            elif rc != int(ErrorCode.OBJECT_NOT_FOUND) and first_error == 0:
                first_error = rc
        if first_error:
            raise EngramStoreError(f"remove_from_store failed, rc={first_error}", first_error)
        return removed
