"""The records every part of :class:`~mooncake._core.master.MasterState` shares.

Each part (``objects``, ``leases``, ``segments``, ``tiers``, ``tasks``, ``drain``) is a mixin over
:class:`_StateBase`: the state's fields are declared here once (and set by ``MasterState``'s
constructor), and so are, for the type checker, the methods one part calls in another.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from mooncake._core.master.config import MasterConfig, MasterStats
from mooncake._core.master.objmap import ObjectMap
from mooncake._core.master.records import (
    KeySet,
    _Client,
    _Deferred,
    _Demote,
    _InUse,
    _Object,
    _Pending,
    _Promote,
    _Replica,
    _Seg,
    _Task,
    _Version,
)
from mooncake._core.master.tenants import TenantLedger
from mooncake._core.misses import MissLedger
from mooncake._core.policies import EvictionPolicy
from mooncake._core.quarantine import Quarantine
from mooncake._core.store_types import ReplicateConfig, Segment, SegmentInfo, TaskType
from mooncake._core.tiers import TierCounters


class _StateBase:
    """The shared fields of the master's state (see ``MasterState.__init__``)."""

    config: MasterConfig
    policy: EvictionPolicy
    rng: random.Random
    stats: MasterStats
    view_version_id: int
    misses: MissLedger
    tenants: TenantLedger
    tiers: dict[str, TierCounters]
    quarantine: Quarantine
    _objects: ObjectMap
    _next_seg_num: int
    _segments: dict[str, _Seg]
    _seg_list: list[_Seg]
    _clients: dict[str, _Client]
    _deferred: list[_Deferred]
    #: set by a PutStart refused for lack of space: when held space would be back (0: none)
    space_held_until: float
    held_waits: bool
    _held_cache: tuple[tuple[int, int], int]
    _defer_seq: int
    _in_use: dict[str, tuple[Segment, _InUse]]
    _soft_pinned: KeySet
    _writing: OrderedDict[str, _Pending]
    _demotions: OrderedDict[str, _Demote]
    _promotions: OrderedDict[str, _Promote]
    _pin_heap: list[tuple[float, str]]
    _tasks: dict[str, _Task]
    _groups: dict[str, KeySet]
    _active_tasks: dict[str, _Task]
    _finished_tasks: deque[str]
    _used: int
    _capacity: int
    _next_vid: int
    _next_task: int
    _demoting_bytes: int
    _evict_goal: int
    _put_round: int

    if TYPE_CHECKING:
        # Implemented by the parts; declared here so that each part type-checks on its own.
        def _allocate(self, size: int, config: ReplicateConfig) -> list[_Replica]: ...
        def _clear_demoting(self, obj: _Object) -> None: ...
        def crc_of(self, h: int, vid: int) -> int: ...
        def _demotion_owner(self, ver: _Version) -> _Replica | None: ...
        def _defer(self, until: float, reps: list[_Replica]) -> None: ...
        def discard_writes_of(self, client_id: str, now: float) -> int: ...
        def _pin_soft(self, key: str, deadline: float) -> None: ...
        def _drop_object(self, obj: _Object, now: float) -> None: ...
        def _end_tier_moves(self, obj: _Object) -> None: ...
        def _fail_task(self, task: _Task, message: str) -> None: ...
        def _forget_disk(self, key: str, ver: _Version) -> None: ...
        def _free_replicas(self, reps: list[_Replica]) -> None: ...
        def _held_bytes(self) -> int: ...
        def _free_version(self, ver: _Version) -> None: ...
        def _hold_written(self, reps: list[_Replica], now: float) -> None: ...
        def _new_task(
            self, obj: _Object, ttype: TaskType, source: _Replica, targets: list[str], now: float
        ) -> str: ...
        def _release_after_lease(self, obj: _Object, ver: _Version, now: float) -> None: ...
        def _renew_known(self, client_id: str, now: float) -> _Client | None: ...
        def _set_group(self, obj: _Object, group: str) -> None: ...
        def _start_demotion(self, obj: _Object, source: _Replica, now: float) -> None: ...
        def _to_disk_only(self, obj: _Object, now: float) -> None: ...
        def _touch_client(self, client_id: str, now: float) -> _Client: ...
        def _untrack(self, obj: _Object) -> None: ...
        def evict(self, now: float, need: int = 0, *, limit: int | None = None) -> int: ...
        def readable_keys(self) -> list[str]: ...
        def settle(self) -> None: ...
        def all_segments(self) -> list[SegmentInfo]: ...
