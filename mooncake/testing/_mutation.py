"""Mutation testing of :func:`mooncake.testing.check_policy` against the shipped policies.

An AST mutator rewrites one spot of a policy's source at a time, the harness runs on the
mutated class, and the *mutation score* is the share of mutants it rejects. Operators
(``OPERATORS``): comparison flips (``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``is``/``is not``,
``in``/``not in``), ``and``/``or``, a dropped ``not``, ``+``/``-``, off-by-one integer
constants, ``True``/``False``, ``min``/``max``, ``Pin`` swaps, a negated ``if``, a deleted
statement (a call such as a pin-table update or a heap push, an assignment, an augmented
assignment such as a byte update, a ``del``, ``continue`` or ``break``), and, in ``victims``,
victims reordered (``out.append(k)`` to ``out.insert(0, k)``, ``return out`` reversed).

Each policy is mutated in the files it runs (``TARGETS``: its own module, the modules it
inherits from and the helpers of ``base.py`` it calls); ``self_check`` and ``__repr__`` are
not mutated (they are the harness's probes, not behaviour). A mutant that changes nothing
observable through the policy interface is *equivalent*: :data:`EQUIVALENT` names each one
found with the reason, and they are left out of the score rather than counted as survivors;
:data:`OUT_OF_REACH` lists, apart, the few that do change behaviour but only where
``check_policy`` cannot look by design (constructor arguments), with what covers them.

Each mutant runs in a forked child (a mutant may loop forever or eat memory): killed (the
harness raised), survived, hung (killed after ``timeout`` seconds; a hang fails a test
suite too, so it counts as killed) or invalid (the mutated module does not load; not
counted). :func:`planted` adds the hand-written bugs of :mod:`mooncake.testing._planted`
(rare-condition shortcuts: uniform-size fast paths, exact k-object sums, cached answers that
miss a lease or pin change), run the same way. ``python benchmarks/policy_mutation.py`` prints
the score per policy.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import os
import resource
import select
import signal
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake._core.policies.base import Pin

__all__ = [
    "EQUIVALENT",
    "OPERATORS",
    "OUT_OF_REACH",
    "TARGETS",
    "Mutant",
    "Outcome",
    "mutants",
    "planted",
    "run_mutant",
    "score",
]

_PKG = "mooncake._core.policies"
_DIR = Path(__file__).resolve().parents[1] / "_core" / "policies"
_BASE_HELPERS = ("check_size", "check_pin", "record_pin")
#: what the policies inherit from ``SizedPolicy`` in base.py (its ``_check_sized`` is a probe)
_SIZED = ("__init__", "set_pin", "__len__", "__contains__", "total_bytes")

#: Policy name -> (class name, module, [(file, functions mutated or None for all)]).
TARGETS: dict[str, tuple[str, str, list[tuple[str, tuple[str, ...] | None]]]] = {
    "lru": (
        "LRUPolicy",
        "lru",
        [("base", (*_BASE_HELPERS, *_SIZED, "select_victims")), ("lru", None)],
    ),
    "lfu": (
        "LFUPolicy",
        "lfu",
        [("base", (*_BASE_HELPERS, *_SIZED, "select_victims")), ("lfu", None)],
    ),
    "fifo": (
        "FIFOPolicy",
        "fifo",
        [("base", (*_BASE_HELPERS, *_SIZED, "select_victims")), ("lru", None), ("fifo", None)],
    ),
    "sieve": ("SIEVEPolicy", "sieve", [("base", (*_BASE_HELPERS, *_SIZED)), ("sieve", None)]),
    "s3fifo": ("S3FIFOPolicy", "s3fifo", [("base", (*_BASE_HELPERS, *_SIZED)), ("s3fifo", None)]),
    "prefix-lru": (
        "PrefixLRUPolicy",
        "prefix",
        [("base", (*_BASE_HELPERS, *_SIZED)), ("prefix", None)],
    ),
}

#: Methods a policy overrides: a mutant there does not run for it (FIFO ignores hits).
_OVERRIDDEN: dict[str, set[tuple[str, str]]] = {"fifo": {("lru", "on_access")}}
_SKIP_FUNCS = {"self_check", "__repr__", "_check_sized"}
_SIZE_CHECKED = ("lru", "lfu", "sieve", "s3fifo", "prefix")

OPERATORS = (
    "compare",
    "boolop",
    "not",
    "arith",
    "augassign",
    "constant",
    "bool",
    "minmax",
    "pin",
    "negate-if",
    "delete",
    "reorder",
)

_CMP_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_PIN_SWAP = {"HARD": "SOFT", "SOFT": "HARD", "NONE": "SOFT"}


@dataclass(frozen=True)
class Mutant:
    """One single-spot change of one policy's source."""

    policy: str
    file: str
    func: str
    line: int
    operator: str
    original: str
    mutated: str
    source: str = field(repr=False, compare=False)
    occurrence: int = 1

    @property
    def ident(self) -> str:
        """Stable name (no line number): ``file:function:operator:original -> mutated``, and
        `` #n`` for the n-th identical rewrite in the same function."""
        base = f"{self.file}:{self.func}:{self.operator}:{self.original} -> {self.mutated}"
        return base if self.occurrence == 1 else f"{base} #{self.occurrence}"


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed | survived | hung | invalid | equivalent | out-of-reach
    detail: str = ""
    seconds: float = 0.0


def _funcs(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield item.name, item


def _spots(func: ast.FunctionDef) -> Iterator[tuple[ast.AST, str, Callable[[ast.AST], Any]]]:
    """(node, operator, rewrite) for every mutation point of ``func``; ``rewrite`` edits a
    copy of ``node`` in place, or returns a replacement statement."""
    body_stmts = {id(s) for s in ast.walk(func) if isinstance(s, ast.stmt)}
    docstring = (
        func.body[0]
        if func.body
        and isinstance(func.body[0], ast.Expr)
        and isinstance(func.body[0].value, ast.Constant)
        else None
    )
    for node in ast.walk(func):
        if node is func or node is docstring:
            continue
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                swap = _CMP_SWAP.get(type(op))
                if swap is not None:

                    def cmp(n: ast.AST, i: int = i, swap: Any = swap) -> None:
                        n.ops[i] = swap()  # type: ignore[attr-defined]

                    yield node, "compare", cmp
        elif isinstance(node, ast.BoolOp):

            def boolop(n: ast.AST) -> None:
                n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()  # type: ignore[attr-defined]

            yield node, "boolop", boolop
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node, "not", lambda n: n.operand  # type: ignore[attr-defined]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):

            def arith(n: ast.AST) -> None:
                n.op = ast.Sub() if isinstance(n.op, ast.Add) else ast.Add()  # type: ignore[attr-defined]

            yield node, "arith", arith
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            for delta in (1, -1):

                def const(n: ast.AST, delta: int = delta) -> None:
                    n.value += delta  # type: ignore[attr-defined]

                yield node, "constant", const
        elif isinstance(node, ast.Constant) and type(node.value) is bool:

            def flip(n: ast.AST) -> None:
                n.value = not n.value  # type: ignore[attr-defined]

            yield node, "bool", flip
        elif isinstance(node, ast.Name) and node.id in ("min", "max"):

            def minmax(n: ast.AST) -> None:
                n.id = "max" if n.id == "min" else "min"  # type: ignore[attr-defined]

            yield node, "minmax", minmax
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "Pin"
            and node.attr in _PIN_SWAP
        ):

            def pin(n: ast.AST) -> None:
                n.attr = _PIN_SWAP[n.attr]  # type: ignore[attr-defined]

            yield node, "pin", pin
        if isinstance(node, ast.If):

            def negate(n: ast.AST) -> None:
                n.test = ast.UnaryOp(op=ast.Not(), operand=n.test)  # type: ignore[attr-defined]

            yield node, "negate-if", negate
        if id(node) in body_stmts and isinstance(
            node, (ast.Expr, ast.Assign, ast.AugAssign, ast.Delete, ast.Continue, ast.Break)
        ):
            if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Call):
                continue
            if isinstance(node, ast.AugAssign):

                def aug(n: ast.AST) -> None:
                    n.op = ast.Sub() if isinstance(n.op, ast.Add) else ast.Add()  # type: ignore[attr-defined]

                if isinstance(node.op, (ast.Add, ast.Sub)):
                    yield node, "augassign", aug
            yield node, "delete", lambda n: ast.Pass()
        if func.name == "victims":
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "append"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "out"
            ):

                def front(n: ast.AST) -> None:
                    n.func.attr = "insert"  # type: ignore[attr-defined]
                    n.args.insert(0, ast.Constant(0))  # type: ignore[attr-defined]

                yield node, "reorder", front
            if (
                isinstance(node, ast.Return)
                and isinstance(node.value, ast.Name)
                and node.value.id == "out"
            ):

                def rev(n: ast.AST) -> None:
                    n.value = ast.Subscript(  # type: ignore[attr-defined]
                        value=n.value,  # type: ignore[attr-defined]
                        slice=ast.Slice(step=ast.Constant(-1)),
                        ctx=ast.Load(),
                    )

                yield node, "reorder", rev


def _replace(tree: ast.AST, target: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for name, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, name, new)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is target:
                        value[i] = new
                        return


def _file_mutants(policy: str, file: str, only: tuple[str, ...] | None) -> Iterator[Mutant]:
    text = (_DIR / f"{file}.py").read_text()
    tree = ast.parse(text)
    skip = _SKIP_FUNCS | {f for m, f in _OVERRIDDEN.get(policy, set()) if m == file}
    for fname, func in _funcs(tree):
        if fname in skip or (only is not None and fname not in only):
            continue
        spots = list(_spots(func))
        for k, (node, op, rewrite) in enumerate(spots):
            mutated_tree = copy.deepcopy(tree)
            # The same spot in the copy: the k-th spot of the same function.
            mfunc = next(f for n, f in _funcs(mutated_tree) if f.lineno == func.lineno)
            mnode, _, mrewrite = list(_spots(mfunc))[k]
            original = ast.unparse(mnode).splitlines()[0]
            new = mrewrite(mnode)
            if isinstance(new, ast.AST):
                _replace(mutated_tree, mnode, new)
                shown = ast.unparse(new).splitlines()[0]
            else:
                shown = ast.unparse(mnode).splitlines()[0]
            ast.fix_missing_locations(mutated_tree)
            yield Mutant(
                policy,
                f"{file}.py",
                fname,
                getattr(node, "lineno", func.lineno),
                op,
                original,
                shown,
                ast.unparse(mutated_tree),
            )
            del rewrite


def mutants(policy: str) -> list[Mutant]:
    """Every mutant of ``policy`` (see ``TARGETS``), in file and source order."""
    out: list[Mutant] = []
    for file, only in TARGETS[policy][2]:
        out += _file_mutants(policy, file, only)
    # A spot listed twice (an ``if`` negated and its only comparison flipped give two
    # different mutants; two identical rewrites are one) is counted once.
    seen: set[str] = set()
    unique = []
    count: dict[str, int] = {}
    for m in out:
        key = m.file + "\0" + m.source
        if key not in seen:
            seen.add(key)
            n = count[m.ident] = count.get(m.ident, 0) + 1
            unique.append(dataclasses.replace(m, occurrence=n))
    return unique


def planted() -> list[Mutant]:
    """The hand-written bugs of :mod:`mooncake.testing._planted` as mutants (operator
    ``planted``, ``func`` the bug's name): rare-condition shortcuts of an LRU policy."""
    from mooncake.testing._planted import PLANTED

    return [
        Mutant("lru", "_planted", name, 0, "planted", "LRUPolicy", name, source="")
        for name in PLANTED
    ]


def _load(mutant: Mutant) -> type:
    """Build the policy class with ``mutant`` applied (in this process: call in a child)."""
    if mutant.operator == "planted":
        from mooncake.testing._planted import PLANTED

        return PLANTED[mutant.func]
    cls_name, module, files = TARGETS[mutant.policy]
    pin = Pin  # the harness's Pin: the mutated modules must share its enum class
    for file, _ in files:
        name = f"{_PKG}.{file}"
        src = mutant.source if f"{file}.py" == mutant.file else (_DIR / f"{file}.py").read_text()
        mod = types.ModuleType(name)
        mod.__file__ = str(_DIR / f"{file}.py")
        mod.__package__ = _PKG
        sys.modules[name] = mod
        exec(compile(src, f"<mutant {file}.py>", "exec"), mod.__dict__)
        if file == "base":
            mod.Pin = pin  # type: ignore[attr-defined]
    return getattr(sys.modules[f"{_PKG}.{module}"], cls_name)  # type: ignore[no-any-return]


def _child(mutant: Mutant) -> tuple[str, str]:
    from mooncake.testing.policy import ORACLES, _schedule, check_policy

    _schedule._SHRINK = False  # same verdict, without minimising the counter-example

    try:
        cls = _load(mutant)
    except Exception as exc:
        return "invalid", f"{type(exc).__name__}: {exc}"
    try:
        check_policy(cls, oracle=ORACLES[mutant.policy])
    except AssertionError as exc:
        phase = (
            "schedule"
            if any("schedule" in n for n in getattr(exc, "__notes__", []))
            else ("hypothesis")
        )
        return "killed", f"[{phase}] {str(exc).splitlines()[0][:160]}"
    except Exception as exc:
        return "killed", f"[hypothesis] {type(exc).__name__}: {str(exc)[:160]}"
    return "survived", ""


def run_mutant(
    mutant: Mutant, *, timeout: float = 120.0, cpu: int = 15, memory: int = 1 << 30
) -> Outcome:
    """Run the harness on ``mutant`` in a forked child; see the module docstring.

    The child may use ``cpu`` seconds of CPU (a clean run of the harness takes a few) and
    ``memory`` bytes more than the parent; past either, or ``timeout`` seconds of wall
    time, the mutant counts as hung."""
    if mutant.ident in EQUIVALENT:
        return Outcome(mutant, "equivalent", EQUIVALENT[mutant.ident])
    if mutant.ident in OUT_OF_REACH:
        return Outcome(mutant, "out-of-reach", OUT_OF_REACH[mutant.ident])
    t0 = time.monotonic()
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(rfd)
        try:
            with open("/proc/self/statm") as f:
                vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (vm + memory, vm + memory))
            used = resource.getrusage(resource.RUSAGE_SELF)
            limit = int(used.ru_utime + used.ru_stime) + cpu
            resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 5))
            status, detail = _child(mutant)
        except MemoryError:
            status, detail = "killed", "MemoryError"
        except BaseException as exc:
            status, detail = "killed", f"{type(exc).__name__}: {exc}"[:200]
        os.write(wfd, f"{status}\n{detail}".encode())
        os._exit(0)
    os.close(wfd)
    ready, _, _ = select.select([rfd], [], [], timeout)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(rfd)
        return Outcome(mutant, "hung", f"no answer in {timeout:g} s", time.monotonic() - t0)
    chunks = []
    while chunk := os.read(rfd, 65536):
        chunks.append(chunk)
    os.close(rfd)
    _, wstatus = os.waitpid(pid, 0)
    took = time.monotonic() - t0
    if not chunks:
        if os.WIFSIGNALED(wstatus) and os.WTERMSIG(wstatus) in (signal.SIGXCPU, signal.SIGKILL):
            return Outcome(mutant, "hung", f"past {cpu} s of CPU", took)
        return Outcome(mutant, "killed", f"child died ({wstatus})", took)
    status, _, detail = b"".join(chunks).decode().partition("\n")
    return Outcome(mutant, status, detail, took)


def score(outcomes: Sequence[Outcome]) -> tuple[int, int, float]:
    """(killed incl. hung, counted = killed + survived, score in [0, 1])."""
    killed = sum(o.status in ("killed", "hung") for o in outcomes)
    counted = killed + sum(o.status == "survived" for o in outcomes)
    return killed, counted, killed / counted if counted else 1.0


_FAST_SIZE = (
    "the fast path then sends size 0 through check_size, which accepts it: the same size is "
    "stored and nothing else changes"
)

#: Mutants that change nothing the policy interface can observe, with the reason.
EQUIVALENT: dict[str, str] = {
    **{f"{f}.py:on_insert:compare:size < 0 -> size <= 0": _FAST_SIZE for f in _SIZE_CHECKED},
    **{f"{f}.py:on_insert:constant:0 -> 1": _FAST_SIZE for f in ("lru", "lfu", "sieve", "prefix")},
    "s3fifo.py:on_insert:constant:0 -> 1 #2": _FAST_SIZE,
    "sieve.py:on_remove:delete:node.newer = node.older = None -> pass": (
        "only clears the links of a node nothing refers to any more (the map, the list and "
        "the hand have all let go of it): memory hygiene, no behaviour"
    ),
    "sieve.py:victims:constant:0 -> -1 #4": (
        "idle = -1 instead of 0 after clearing a bit: the cleared object is evictable and now "
        "unvisited, so the walk evicts it when it comes round, at most n steps later, and "
        "resets idle; the idle count never gets to n in between either way"
    ),
    "s3fifo.py:victims:compare:size[first] >= nbytes -> size[first] > nbytes": (
        "fast path skipped when the first object frees exactly nbytes: the general loop "
        "examines the same queue head first and returns the same single victim"
    ),
    "s3fifo.py:victims:constant:0 -> -1 #3": (
        "freq == -1 never holds, so the fast path is never taken: the general loop returns "
        "the same answer"
    ),
    "s3fifo.py:victims:bool:False -> True": (
        "marks a victim taken from M as taken from S; on_remove reads _evicting_small only "
        "for keys in S (a key in M is discarded from it), and victims() resets it"
    ),
    **{
        f"prefix.py:__init__:constant:0 -> {v}": (
            "the use clock starts at another value: only the order of ticks matters"
        )
        for v in ("1", "-1")
    },
    **{
        f"prefix.py:{f}:constant:1 -> 2": (
            "the use clock steps by 2: ticks stay unique and increasing, their order is all "
            "that is compared"
        )
        for f in ("on_insert", "on_access")
    },
    **{
        f"prefix.py:_push:{m}": (
            "when the lazy heap is compacted: _rebuild keeps exactly the current entries, so "
            "compacting earlier, later or never changes no answer (only memory)"
        )
        for m in (
            "negate-if:if len(heap) > 2 * len(self._size) + 64: -> "
            "if not len(heap) > 2 * len(self._size) + 64:",
            "compare:len(heap) > 2 * len(self._size) + 64 -> len(heap) >= 2 * len(self._size) + 64",
            "delete:self._rebuild() -> pass",
            "arith:2 * len(self._size) + 64 -> 2 * len(self._size) - 64",
            "constant:64 -> 65",
            "constant:64 -> 63",
            "constant:2 -> 3",
            "constant:2 -> 1",
        )
    },
    "prefix.py:_rebuild:delete:self._heap = [(0 if k in dead else 1, tick[k], k) for k in "
    "self._size if k not in kids] -> pass": (
        "compaction then only heapifies the old heap, already a heap holding every current "
        "entry: the same as not compacting (stale entries are skipped either way)"
    ),
    "prefix.py:on_insert:boolop:parent is not None and key in kids -> "
    "parent is not None or key in kids": (
        "the cycle walk also runs when it cannot find one (no parent, or a key without "
        "children, which no ancestor chain leads back to); it raises only on a real cycle"
    ),
    "prefix.py:victims:negate-if:if heap: -> if not heap:": (
        "the fast path is skipped: a non-empty forest always has a leaf, so the heap always "
        "holds a current entry here and the general loop returns the same answer"
    ),
    "prefix.py:victims:compare:self._size[key] >= nbytes -> self._size[key] > nbytes": (
        "fast path skipped when the best leaf frees exactly nbytes: the general loop takes the "
        "same leaf first and stops there"
    ),
    "prefix.py:victims:constant:1 -> 2": (
        "phases (0, 2) instead of (0, 1): the code only asks whether the phase is 0"
    ),
    "prefix.py:victims:compare:heap[0] < fresh[0] -> heap[0] <= fresh[0]": (
        "heap entries never tie: the use tick in each is unique"
    ),
    "prefix.py:victims:delete:fresh = [] -> pass": (
        "fresh is only read in phase 0; left over it is pushed to soft again after phase 1, "
        "when nothing reads soft any more"
    ),
    "prefix.py:victims:delete:heapq.heappush(soft, entry) -> pass": (
        "a freed parent is left in fresh at the end of phase 0 only if phase 0 stopped because "
        "enough was freed, and then phase 1 takes nothing"
    ),
}

#: Mutants check_policy cannot reach by design, with the reason (and what covers them).
#: Left out of the score like equivalent ones, but listed apart: they do change behaviour.
OUT_OF_REACH: dict[str, str] = {
    f"s3fifo.py:__init__:compare:0.0 < small_ratio < 1.0 -> {m}": (
        "constructor argument check: check_policy builds the policy through the caller's "
        "zero-argument factory and never passes small_ratio (test_make_policy_passes_"
        "arguments checks that 0.0 and 1.0 are refused)"
    )
    for m in ("0.0 <= small_ratio < 1.0", "0.0 < small_ratio <= 1.0")
}
