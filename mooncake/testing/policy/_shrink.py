"""Shrinking a failing sequence of the schedule, and the script that reproduces it."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mooncake._core.policies.base import EvictionPolicy, Pin
from mooncake.testing.policy._driver import _ARGS, Op, _Driver
from mooncake.testing.policy._model import _parent_of


def _run(
    factory: Callable[[], EvictionPolicy], oracle: Any, ops: Sequence[Op]
) -> BaseException | None:
    """Replay ``ops`` on a fresh policy; the first failure, or ``None``."""
    try:
        driver = _Driver(factory(), oracle)
        driver.check()
        for op in ops:
            driver.apply(op)
            driver.check()
    except Exception as exc:
        return exc
    return None


_NOISE = re.compile(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{[^}]*\}|\([^)]*\)|-?\d+")


def _kind(exc: BaseException) -> str:
    """What a failure is, without the keys and numbers of one example."""
    return f"{type(exc).__name__}:{_NOISE.sub('_', str(exc))}"


def _simpler(op: Op) -> list[Op]:
    """Candidate simplifications of one step (smaller sizes, plainer arguments)."""
    name = op[0]
    out: list[Op] = []
    if name == "insert":
        _, key, size, chained = op
        if isinstance(size, int):
            out += [("insert", key, s, chained) for s in (0, 1, size // 2) if s < size]
        elif hasattr(size, "__index__"):  # an integer-like size: its plain int is simpler
            out.append(("insert", key, operator.index(size), chained))
        if chained:
            out.append(("insert", key, size, False))
    elif name == "victims":
        _, nbytes, evict = op
        out += [("victims", n, evict) for n in (1, nbytes // 2, nbytes - 1) if 0 < n < nbytes]
        if evict != "all":
            out.append(("victims", nbytes, "all"))
    elif name == "set_pin" and op[2] is Pin.SOFT:
        out.append(("set_pin", op[1], Pin.HARD))
    return out


def _weight(ops: list[Op]) -> tuple[int, int]:
    """What shrinking minimises: steps, then the sizes and byte counts in them."""
    return len(ops), sum(
        abs(op[2])
        if op[0] == "insert" and type(op[2]) is int
        else abs(op[1])
        if op[0] == "victims"
        else 0
        for op in ops
    )


def _bulk_candidates(ops: list[Op]) -> Iterator[list[Op]]:
    """Whole-sequence simplifications single-step edits cannot reach (an early eviction round
    that only works with these exact sizes): every size 0 or 1, no eviction round but the
    last, both; then every step of one key dropped."""
    last = max((i for i, op in enumerate(ops) if op[0] == "victims"), default=-1)

    def sized(size: int, seq: list[Op]) -> list[Op]:
        return [("insert", op[1], size, op[3]) if op[0] == "insert" else op for op in seq]

    no_rounds = [op for i, op in enumerate(ops) if op[0] != "victims" or i == last]
    for size in (0, 1):
        yield sized(size, ops)
    if len(no_rounds) < len(ops):
        yield no_rounds
        for size in (0, 1):
            yield sized(size, no_rounds)
    keys = {op[1] for op in ops if op[0] not in ("victims",)}
    for key in sorted(keys, key=str):
        yield [op for op in ops if op[0] == "victims" or op[1] != key]


def _shrink(
    factory: Callable[[], EvictionPolicy], oracle: Any, ops: list[Op], exc: BaseException
) -> tuple[list[Op], BaseException]:
    """Delete steps and simplify arguments while the same kind of failure stays."""
    kind = _kind(exc)

    def fails(cand: list[Op]) -> BaseException | None:
        got = _run(factory, oracle, cand)
        return got if got is not None and _kind(got) == kind else None

    changed = True
    while changed:
        changed = False
        for cand in _bulk_candidates(ops):
            if _weight(cand) >= _weight(ops):
                continue
            got = fails(cand)
            if got is not None:
                ops, exc, changed = cand, got, True
                break
        chunk = max(1, len(ops) // 2)
        while chunk >= 1:
            i = len(ops) - chunk
            while i >= 0:
                cand = ops[:i] + ops[i + chunk :]
                got = fails(cand)
                if got is not None:
                    ops, exc, changed = cand, got, True
                i -= chunk
            chunk //= 2
        for i in range(len(ops)):
            for simpler in _simpler(ops[i]):
                cand = [*ops[:i], simpler, *ops[i + 1 :]]
                got = fails(cand)
                if got is not None:
                    ops, exc, changed = cand, got, True
                    break
    return ops, exc


def _step_note(op: Op) -> str:
    args = dict(zip(_ARGS[op[0]], op[1:], strict=True))
    return f"state.{op[0]}({', '.join(f'{k}={args[k]!r}' for k in sorted(args))})"


def _script(factory: Callable[[], EvictionPolicy], ops: Sequence[Op], message: str) -> str:
    """The shrunk sequence as a script a user can paste to reproduce the failure."""
    name = getattr(factory, "__qualname__", "")
    make = f"{name}()" if name.isidentifier() else "factory()  # the factory under test"
    lines = [
        "from mooncake.policies import Pin",
        *(
            ["from mooncake.testing.policy import IntLike"]
            if any("IntLike(" in repr(op) for op in ops)
            else []
        ),
        f"policy = {make}",
        "busy = set()  # keys can_evict refuses (leased, put not completed)",
    ]
    for n, op in enumerate(ops, 1):
        kind = op[0]
        if kind == "insert":
            _, key, size, chained = op
            parent = _parent_of(key) if chained else None
            lines.append(f"policy.on_insert({key!r}, {size!r}, parent={parent!r})")
        elif kind == "bad_parent":
            lines.append(
                f"policy.on_insert({op[1]!r}, 1, parent={op[2]!r})  # cycle: must raise "
                "InvalidArgumentError"
            )
        elif kind == "bad_pin":
            lines.append(f"policy.set_pin({op[1]!r}, {op[2]!r})  # must raise InvalidArgumentError")
        elif kind == "bad_insert":
            lines.append(
                f"policy.on_insert({op[1]!r}, {op[2]!r})  # must raise InvalidArgumentError"
            )
        elif kind in ("access", "remove"):
            lines.append(f"policy.on_{kind}({op[1]!r})  # KeyError if {op[1]!r} is not tracked")
        elif kind == "set_pin":
            lines.append(f"policy.set_pin({op[1]!r}, Pin.{op[2].name})")
        elif kind == "set_busy":
            lines.append(f"busy.{'add' if op[2] else 'discard'}({op[1]!r})")
        else:
            _, nbytes, evict = op
            lines.append(f"victims = policy.victims({nbytes!r}, lambda key: key not in busy)")
            if n == len(ops):
                lines.append("print(victims)")
            elif evict == "all":
                lines.append("for key in victims:\n    policy.on_remove(key)")
            elif evict == "first":
                lines.append("for key in victims[:1]:\n    policy.on_remove(key)")
    if ops and ops[-1][0] != "victims":
        lines.append("print(len(policy), policy.total_bytes, policy.unreachable())")
    lines.append(f"# check_policy: {message}")
    return "\n".join(lines)
