"""Exact victim oracles of the shipped policies (:data:`ORACLES` by registry name)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mooncake._core.policies.base import Key, Pin
from mooncake.testing import _policy_ref
from mooncake.testing.policy._model import Oracle, PolicyModel


def lru_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """Least recently used (insert or access) first."""
    order = sorted(model.entries, key=lambda k: model.entries[k].last_use)
    return model.select(order, nbytes)


def fifo_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """Oldest insert first."""
    order = sorted(model.entries, key=lambda k: model.entries[k].inserted)
    return model.select(order, nbytes)


def lfu_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """Fewest uses first, then least recently used. A policy with a ``frequency(key)`` method
    (:class:`~mooncake.policies.LFUPolicy`) must also report each key's use count."""
    frequency = getattr(model.policy, "frequency", None)
    if frequency is not None:
        for k, e in model.entries.items():
            got = frequency(k)
            assert got == e.uses, f"frequency({k!r}) = {got!r}, but it was used {e.uses} times"
    order = sorted(model.entries, key=lambda k: (model.entries[k].uses, model.entries[k].last_use))
    return model.select(order, nbytes)


def prefix_lru_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """Leaves only, unreachable before reachable, least recently used first; soft pins last.

    Evicting a leaf may turn its parent into a leaf, which then competes by its own last use.
    Once no unpinned leaf is left, soft-pinned leaves (and the parents they free) follow.
    """
    if nbytes <= 0:
        return []
    remaining = set(model.entries)
    reach = {k: model.reachable(k) for k in remaining}
    out: list[Key] = []
    freed = 0
    soft_phase = False
    while freed < nbytes:
        candidates = [
            k
            for k in remaining
            if model.base_evictable(k)
            and not any(c in remaining for c in model.children(k))
            and (soft_phase or model.entries[k].pin is not Pin.SOFT)
        ]
        if not candidates:
            if soft_phase:
                break
            soft_phase = True
            continue
        key = min(candidates, key=lambda k: (reach[k], model.entries[k].last_use))
        out.append(key)
        remaining.discard(key)
        freed += model.entries[key].size
    return out


def _reference(model: PolicyModel, name: str, make: Callable[[], Any], nbytes: int) -> list[Key]:
    """Bring the reference model ``name`` up to date with ``model.log`` and ask it for the
    victims of the ``victims`` call being checked (the log's next event, which it then skips:
    the reference has already answered it, with the same busy set). The policy has answered
    that call already, so counters both keep (``COUNTERS``) must agree."""
    ref, fed = model.refs.get(name) or (make(), 0)
    _policy_ref.replay(ref, model.log[fed:])
    out: list[Key] = ref.victims(nbytes, model.can_evict)
    # Called after the policy answered the same call: its counters must agree now.
    for counter in getattr(ref, "COUNTERS", ()):
        if hasattr(model.policy, counter):
            got, want = getattr(model.policy, counter), getattr(ref, counter)
            assert got == want, f"{counter} = {got!r}, reference model says {want!r}"
    model.refs[name] = (ref, len(model.log) + 1)
    return out


def sieve_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """SIEVE (NSDI'24) as :class:`~mooncake.policies.SIEVEPolicy` documents it, hand and all:
    the model's log replayed on a plain reference model."""
    return _reference(model, "sieve", _policy_ref.RefSieve, nbytes)


def s3fifo_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """S3-FIFO (SOSP'23) with ``small_ratio=0.1`` as :class:`~mooncake.policies.S3FIFOPolicy`
    documents it: the model's log replayed on a plain reference model."""
    return _reference(model, "s3fifo", _policy_ref.RefS3FIFO, nbytes)


ORACLES: dict[str, Oracle] = {
    "lru": lru_oracle,
    "lfu": lfu_oracle,
    "fifo": fifo_oracle,
    "sieve": sieve_oracle,
    "s3fifo": s3fifo_oracle,
    "prefix-lru": prefix_lru_oracle,
}
"""The exact oracle of each shipped policy (default parameters), by registry name."""
