from collections.abc import Iterable, Sequence
from typing import Any

COMPILED: bool
HARDWARE: bool
KERNELS: tuple[str, ...]
AVAILABLE: tuple[str, ...]
KERNEL: str
ENV: str

def set_kernel(name: str) -> str: ...

def crc32c_at(addr: int, n: int, crc: int = 0) -> int: ...
def crc32c(buf: Any, crc: int = 0) -> int: ...
def crc32c_parts(parts: Iterable[tuple[int, int]], crc: int = 0) -> int: ...
def copy_crc32c(dst: int, src: int, n: int, crc: int = 0, stream: bool = False) -> int: ...
def crc32c_combine(crc1: int, crc2: int, len2: int) -> int: ...
def copy_crc32c_batch(
    dsts: Sequence[int],
    srcs: Sequence[int],
    lens: Sequence[int],
    sums: Sequence[bool],
    stream: bool = False,
) -> list[int]: ...
