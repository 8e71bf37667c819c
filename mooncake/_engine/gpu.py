"""The engine's GPU family: the CUDA runtime, its completion bridge, the pinned-host stager and
the device-range checks of registration.

Everything here is loaded lazily: an engine that never sees device memory never loads CUDA
(``auto_location`` asks the runtime only when one is already loaded). The stager's pinned
chunks are registered with the engine as local-only memory, through the one call of
:class:`GpuHost`, so every transport (an RDMA one registers an MR for each) sees them and no
peer ever does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from mooncake._core.gpu import parse_location
from mooncake._core.memory import MemoryRegistry, Region
from mooncake.errors import InvalidArgumentError

if TYPE_CHECKING:
    from mooncake._engine.cudaio import Completions, Stager
    from mooncake._fast.cuda import CudaRuntime


class GpuHost(Protocol):
    """What :class:`Gpu` asks of its engine: registering the stager's new pinned chunks."""

    async def register(
        self, obj: Any, *, location: str = "*", remote_accessible: bool = True
    ) -> Region:
        """Register ``obj`` (here an ``(addr, length)`` pair) as local memory."""


class Gpu:
    """The CUDA runtime of one engine and what is built on it (completions, stager)."""

    def __init__(self, host: GpuHost, runtime: CudaRuntime | None) -> None:
        self._host = host
        self._rt = runtime
        self._completions: Completions | None = None
        self._stager: Stager | None = None

    @property
    def runtime(self) -> CudaRuntime:
        """The CUDA runtime (loaded on first use; :class:`~mooncake.errors.NoGpuError` if none)."""
        if self._rt is None:
            from mooncake._fast import cuda

            self._rt = cuda.runtime()
        return self._rt

    @property
    def completions(self) -> Completions:
        """The bridge from CUDA stream completion to the event loop."""
        if self._completions is None:
            from mooncake._engine.cudaio import Completions

            self._completions = Completions(self.runtime)
        return self._completions

    @property
    def staging(self) -> Stager:
        """Pinned host chunks for moving device memory over host-only transports."""
        if self._stager is None:
            from mooncake._engine.cudaio import Stager

            self._stager = Stager(
                self.runtime, self.completions, on_new_chunk=self._register_staging_chunk
            )
        return self._stager

    async def _register_staging_chunk(self, addr: int, length: int) -> None:
        # Local-only registered memory like any other: every transport sees it (an RDMA
        # transport registers a memory region for it), peers never do.
        await self._host.register((addr, length), location="cpu:0", remote_accessible=False)

    def check_device_range(self, addr: int, length: int, location: str) -> None:
        """Raise :class:`InvalidArgumentError` unless ``[addr, +length)`` is device (or
        managed) memory of the device ``location`` names."""
        from mooncake._fast.cuda import MEMORY_DEVICE, MEMORY_MANAGED

        _, dev = parse_location(location)
        rt = self.runtime
        n = rt.get_device_count()
        if dev >= n:
            raise InvalidArgumentError(f"location {location!r}: this process sees {n} GPU(s)")
        for p in (addr, addr + length - 1):
            kind, pdev = rt.pointer_get_attributes(p)
            if kind not in (MEMORY_DEVICE, MEMORY_MANAGED):
                raise InvalidArgumentError(
                    f"[{addr:#x}, +{length}) is not device memory, but location is {location!r}"
                )
            if pdev != dev:
                raise InvalidArgumentError(
                    f"[{addr:#x}, +{length}) is on cuda:{pdev}, but location is {location!r}"
                )

    def auto_location(self, addr: int) -> str:
        """``*``: ask the runtime when one is loaded (never load CUDA just for this)."""
        from mooncake._fast import cuda

        rt = self._rt or cuda.loaded_runtime()
        if rt is not None:
            kind, dev = rt.pointer_get_attributes(addr)
            if kind in (cuda.MEMORY_DEVICE, cuda.MEMORY_MANAGED) and dev >= 0:
                return f"cuda:{dev}"
        return "cpu:0"

    def close(self, registry: MemoryRegistry) -> None:
        """Drop the stager's chunks from ``registry`` and close the stager and completions
        (at engine close, once no task can use them)."""
        if self._stager is not None:
            for pool in (self._stager.pool, self._stager.server_pool):
                for chunk in pool.chunks:
                    if registry.find(chunk, 1) is not None:
                        registry.remove(chunk)
            self._stager.close()
        if self._completions is not None:
            self._completions.close()
