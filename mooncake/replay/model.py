"""Cost models of the replay: prefill GPU time and KV-cache bytes.

Both are models, not measurements. The prefill model is the quadratic fitted to the FAST'25
paper's Fig. 14a (LLaMA3-70B on its hardware); the KV size default is LLaMA3-70B's:
80 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes = 327,680 B per token, so a
512-token block is 160 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake.errors import InvalidArgumentError

#: LLaMA3-70B KV bytes per token (all layers, K and V, fp16).
LLAMA3_70B_KV_BYTES_PER_TOKEN = 80 * 8 * 128 * 2 * 2


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """``T(n, p) = linear * (n - p) + quadratic * (n^2 - p^2)`` seconds for a prompt of ``n``
    tokens of which the first ``p`` come from cache (attention over the cached prefix is still
    paid for the new tokens, hence the difference of squares)."""

    linear: float = 1.16e-4
    quadratic: float = 7.1e-10

    def __post_init__(self) -> None:
        if self.linear < 0 or self.quadratic < 0:
            raise InvalidArgumentError("prefill model coefficients must be >= 0")

    def seconds(self, n: int, p: int = 0) -> float:
        """Estimated prefill seconds; ``p`` is clamped to ``[0, n]``."""
        p = min(max(p, 0), n)
        return self.linear * (n - p) + self.quadratic * (n * n - p * p)


@dataclass(frozen=True, slots=True)
class KVModel:
    """KV-cache sizes and the transfer bandwidth between instances (a model: 87 GB/s is the
    paper's 4x200 Gbps RoCE figure, not something measured here)."""

    bytes_per_token: int = LLAMA3_70B_KV_BYTES_PER_TOKEN
    block_tokens: int = 512
    bandwidth_bytes_per_s: float = 87e9

    def __post_init__(self) -> None:
        if self.bytes_per_token < 0:
            raise InvalidArgumentError("KV bytes per token must be >= 0")
        if self.block_tokens <= 0:
            raise InvalidArgumentError("block_tokens must be > 0")
        if self.bandwidth_bytes_per_s <= 0:
            raise InvalidArgumentError("bandwidth must be > 0")

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    def transfer_seconds(self, blocks: int) -> float:
        return blocks * self.block_bytes / self.bandwidth_bytes_per_s
