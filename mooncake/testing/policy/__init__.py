"""Property tests for eviction policies: :func:`check_policy` drives a policy and checks it.

The harness drives a policy through sequences of inserts (with and without prefix parents),
accesses, removals, pin changes, lease/incomplete flips, refused bad sizes and eviction rounds,
keeps its own model of what the policy should track, and after every step checks:

- bookkeeping: ``len(policy)``, ``key in policy``, ``total_bytes`` match the model, and
  ``policy.self_check()`` passes; events on untracked keys raise ``KeyError``; a negative,
  float or bool size raises :class:`~mooncake.errors.InvalidArgumentError` and changes nothing;
- every ``victims(nbytes, can_evict)`` answer: tracked keys only, no duplicates; never a
  hard-pinned key or one with ``can_evict(key)`` false (leased or incomplete); ``can_evict``
  asked only about tracked keys; soft-pinned keys only after every evictable unpinned key;
  at least ``nbytes`` freed when the evictable keys allow it and nothing past the first
  prefix that does, else every evictable key; nothing for ``nbytes <= 0``;
- for policies with ``prefix_closed = True``: children before parents (evicting the victims
  in order never removes a key that still has a tracked child), keys whose prefix is gone
  before keys still reachable, and a key whose descendant is pinned or busy counts as
  pinned or busy itself;
- an optional policy-specific oracle: ``oracle(model, nbytes)`` returns the exact victim list
  the policy must propose (or ``None`` to skip). :func:`lru_oracle`, :func:`fifo_oracle`,
  :func:`lfu_oracle`, :func:`sieve_oracle`, :func:`s3fifo_oracle` and
  :func:`prefix_lru_oracle` are the shipped policies' oracles (:data:`ORACLES` by name).

Two searches run, in order:

1. a fixed *schedule* of generated sequences (``schedule`` of them, from seeds 0, 1, 2, ...:
   the same sequences on every run, whatever the policy's name or the process state). Each
   sequence is a *swarm* configuration: it draws which kinds of step it uses and how often,
   a subset of the key pool, a size regime (unit, small, wide, zeros), how often inserts are
   chained to their prefix parent, and how often state is built in bulk (a burst of inserts,
   a whole chain at once); eviction rounds are biased to states with pins and busy keys and
   ask for boundary byte counts (1, one key's size, every evictable byte, one more). Then
   ``schedule // 4`` *shape* sequences reach the rarer states shortcuts break in: 10 to 64
   keys tracked (:data:`WIDE_KEYS`), often all of one size (uniform pages of 2, 4, 16 or 64
   bytes) or all above 8 bytes; rounds asking for exactly the sizes of the first ``k >= 2``
   unpinned evictable keys in an LRU, FIFO, LFU or random order, or one byte more or less;
   and re-evictions (a round, a lease or pin change, the same round at once). Then
   ``schedule // 6`` sequences that add refused inputs. A violation is shrunk (steps
   removed, arguments simplified, same failure kept) and reported as hypothesis-style
   ``state.insert(...)`` steps plus a script to paste;
2. hypothesis' stateful search (``max_examples`` random sequences of up to
   ``stateful_step_count`` steps; ``derandomize`` and ``settings_`` as in hypothesis), which
   shrinks its own counter-examples.

A failure raises ``AssertionError`` naming the broken rule, with the shrunk sequence of steps
in its ``__notes__`` (pytest prints them). Needs the ``test`` extra (``hypothesis``); refuses
to run under ``python -O``, where its assertions would vanish.
"""

from __future__ import annotations

from mooncake.testing.policy._check_policy import check_policy
from mooncake.testing.policy._contract import check_victims
from mooncake.testing.policy._driver import IntLike, Op
from mooncake.testing.policy._machine import PolicyMachine
from mooncake.testing.policy._model import KEYS, WIDE_KEYS, ModelEntry, Oracle, PolicyModel
from mooncake.testing.policy._oracles import (
    ORACLES,
    fifo_oracle,
    lfu_oracle,
    lru_oracle,
    prefix_lru_oracle,
    s3fifo_oracle,
    sieve_oracle,
)
from mooncake.testing.policy._swarm import DEFAULT_SCHEDULE

__all__ = [
    "DEFAULT_SCHEDULE",
    "KEYS",
    "ORACLES",
    "WIDE_KEYS",
    "IntLike",
    "ModelEntry",
    "Op",
    "Oracle",
    "PolicyMachine",
    "PolicyModel",
    "check_policy",
    "check_victims",
    "fifo_oracle",
    "lfu_oracle",
    "lru_oracle",
    "prefix_lru_oracle",
    "s3fifo_oracle",
    "sieve_oracle",
]
