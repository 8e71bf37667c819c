"""Mutation score of ``mooncake.testing.check_policy`` on the shipped eviction policies.

Generates every mutant of each policy (``mooncake/testing/_mutation.py``: an AST mutator over
the policy sources), runs ``check_policy(mutant, oracle=ORACLES[name])`` at its default
settings on each, one forked child per mutant, and prints per policy: mutants, equivalent
(excluded, with reasons in ``_mutation.EQUIVALENT`` and
``_mutation.OUT_OF_REACH``), killed, survived, the score, the CPU
seconds of the run, and every survivor.

    python benchmarks/policy_mutation.py                 # every policy and the planted bugs
    python benchmarks/policy_mutation.py planted -v      # the hand-written rare-condition bugs
    python benchmarks/policy_mutation.py sieve lfu -v    # some, with each kill's message
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from mooncake.testing import _mutation, policy  # noqa: F401  (import before forking)


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "policies",
        nargs="*",
        default=[*_mutation.TARGETS, "planted"],
        help="policies to mutate, and 'planted' for the hand-written bugs (default: all)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="print every mutant's outcome")
    ap.add_argument(
        "--cpu", type=int, default=15, help="CPU seconds before a mutant counts as hung"
    )
    args = ap.parse_args(argv)
    rows = []
    survivors = []
    for name in args.policies:
        cpu0, t0 = _cpu_children(), time.monotonic()
        ms = _mutation.planted() if name == "planted" else _mutation.mutants(name)
        outcomes = [_mutation.run_mutant(m, cpu=args.cpu) for m in ms]
        cpu, wall = _cpu_children() - cpu0, time.monotonic() - t0
        killed, counted, sc = _mutation.score(outcomes)
        eq = sum(o.status in ("equivalent", "out-of-reach") for o in outcomes)
        inv = sum(o.status == "invalid" for o in outcomes)
        hung = sum(o.status == "hung" for o in outcomes)
        rows.append((name, len(outcomes), eq, inv, killed, hung, counted - killed, sc, cpu, wall))
        for o in outcomes:
            if o.status == "survived":
                survivors.append(o)
            if args.verbose:
                print(
                    f"{o.status:10} {name:10} {o.mutant.ident}  line {o.mutant.line}  {o.detail}",
                    flush=True,
                )
        print(f"{name}: {sc:.1%} ({killed}/{counted})", file=sys.stderr, flush=True)
    print(
        f"{'policy':<11}{'mutants':>8}{'excluded':>9}{'invalid':>8}{'killed':>7}{'(hung)':>7}"
        f"{'survived':>9}{'score':>8}{'CPU s':>7}{'wall s':>7}"
    )
    for name, n, eq, inv, killed, hung, surv, sc, cpu, wall in rows:
        print(
            f"{name:<11}{n:>8}{eq:>9}{inv:>8}{killed:>7}{hung:>7}{surv:>9}{sc:>8.1%}{cpu:>7.1f}{wall:>7.1f}"
        )
    for o in survivors:
        m = o.mutant
        print(
            f"survivor {m.policy}: {m.file}:{m.line} {m.func} [{m.operator}] {m.original!r} -> {m.mutated!r}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
