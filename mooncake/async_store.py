"""The published ``mooncake.async_store``: ``MooncakeDistributedStoreAsync``.

Same surface as the published class: the sync ``MooncakeDistributedStore`` plus an
``async_<name>`` coroutine for every method ``<name>``. Here the byte-level calls are natively
async: ``await store.async_put(...)`` starts the async client's coroutine on the store's own
event loop and awaits its outcome from the caller's loop (an ``asyncio`` future completed by
the store loop; no worker thread is involved and the caller's loop keeps running). Return values
and codes are those of the sync method. Methods with no single async-client counterpart (the
tensor family, segment management, ...) run their sync form in the default executor, as the
published class runs every method.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from mooncake.errors import MooncakeError, to_code
from mooncake.store import MooncakeDistributedStore

__all__ = ["MooncakeDistributedStoreAsync"]


def _zero(_: Any) -> int:
    return 0


def _codes(res: Any) -> list[int]:
    return [
        to_code(r) if isinstance(r, BaseException) else (r if isinstance(r, int) else 0)
        for r in res
    ]


def _first(res: Any) -> int:
    return next((c for c in _codes(res) if c != 0), 0)


def _exists(b: Any) -> int:
    return 1 if b else 0


def _bytes_list(res: Any) -> list[bytes]:
    return [r if isinstance(r, bytes) else b"" for r in res]


# published method -> (async client method, keyword names, result conversion, failure value)
_NATIVE: dict[
    str, tuple[str, tuple[str, ...], Callable[[Any], Any], Callable[[int, tuple[Any, ...]], Any]]
] = {
    "put": ("put", (), _zero, lambda c, a: c),
    "upsert": ("upsert", (), _zero, lambda c, a: c),
    "put_batch": ("put_batch", (), _first, lambda c, a: c),
    "upsert_batch": ("upsert_batch", (), _first, lambda c, a: c),
    "put_from": ("put_from", (), _zero, lambda c, a: c),
    "upsert_from": ("upsert_from", (), _zero, lambda c, a: c),
    "batch_put_from": ("batch_put_from", (), _codes, lambda c, a: [c] * len(a[0])),
    "batch_upsert_from": ("batch_upsert_from", (), _codes, lambda c, a: [c] * len(a[0])),
    "get": ("get", (), lambda b: b, lambda c, a: b""),
    "get_batch": ("get_batch", (), _bytes_list, lambda c, a: [b""] * len(a[0])),
    "get_into": ("get_into", (), int, lambda c, a: c),
    "batch_get_into": ("batch_get_into", (), _codes, lambda c, a: [c] * len(a[0])),
    "is_exist": ("exists", (), _exists, lambda c, a: c),
    "batch_is_exist": ("batch_exists", (), list, lambda c, a: [c] * len(a[0])),
    "get_size": ("get_size", (), int, lambda c, a: c),
    "remove": ("remove", ("force",), _zero, lambda c, a: c),
    "batch_remove": ("batch_remove", ("force",), _codes, lambda c, a: [c] * len(a[0])),
    "remove_by_regex": ("remove_by_regex", ("force",), int, lambda c, a: c),
    "remove_all": ("remove_all", ("force",), int, lambda c, a: c),
}


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """``MooncakeDistributedStore`` with ``async_<name>`` coroutine twins of its methods."""

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("async_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        sync_name = name[6:]
        sync = getattr(self, sync_name, None)
        if sync is None:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}' (nor '{sync_name}')"
            )
        if not callable(sync):
            raise AttributeError(f"'{sync_name}' is not callable")
        native = _NATIVE.get(sync_name)
        fn = self._native(sync, native) if native is not None else self._in_executor(sync)
        setattr(self, name, fn)
        return fn

    def _native(
        self,
        sync: Callable[..., Any],
        spec: tuple[
            str, tuple[str, ...], Callable[[Any], Any], Callable[[int, tuple[Any, ...]], Any]
        ],
    ) -> Callable[..., Awaitable[Any]]:
        method, kw_names, convert, failed = spec

        @functools.wraps(sync)
        async def call(*args: Any, **kwargs: Any) -> Any:
            loop, store = getattr(self, "_loop", None), getattr(self, "_store", None)
            if loop is None or store is None:
                return sync(*args, **kwargs)  # not set up: the sync answer, at once
            kw = {k: kwargs.pop(k) for k in kw_names if k in kwargs}
            if kw_names and len(args) > 1:  # published positional force
                args, kw = args[:1], {kw_names[0]: args[1], **kw}
            if "config" in kwargs:
                args = (*args, kwargs.pop("config"))
            if kwargs:
                raise TypeError(f"{method}() got unexpected arguments {sorted(kwargs)}")
            bound = getattr(store, method)

            async def run() -> Any:
                return await bound(*args, **kw)

            try:
                res = await asyncio.wrap_future(loop.submit(run))
            except MooncakeError as e:
                return failed(to_code(e), args)
            except (TypeError, ValueError) as e:
                return failed(to_code(e), args)
            return convert(res)

        return call

    @staticmethod
    def _in_executor(sync: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(sync)
        async def call(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(sync, *args, **kwargs)
            )

        return call
