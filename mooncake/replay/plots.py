"""PNG plots of a replay report (matplotlib, Agg backend), in the FAST'25 paper's figure forms.

Each function takes the ``--json`` report document (:meth:`ReplayReport.to_dict`), so plots can
be redrawn from a saved report, and writes one PNG:

* :func:`plot_hit_rate` - hit rate against capacity per policy, with Belady's offline optimum
  and the theoretical maximum (Fig. 9 form);
* :func:`plot_belady_gap` - each policy's gap to Belady's optimum per capacity;
* :func:`plot_global_local` - one global pool against ``N`` local caches of the same total
  capacity (Fig. 10 form);
* :func:`plot_ttft` - mean and P90 TTFT per scheduling strategy (Fig. 5 form).

matplotlib is an optional dependency (extra ``plot``); importing this module without it raises
:class:`~mooncake.errors.NotSupportedError`.
"""

from __future__ import annotations

import os
from typing import Any

from mooncake.errors import NotSupportedError

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise NotSupportedError("plots need matplotlib: pip install 'mooncake-py[plot]'") from exc

_WEIGHTS = {"token": "token_hit_rate", "block": "block_hit_rate"}
_LABELS = {"s3fifo": "S3-FIFO", "prefix-lru": "prefix-LRU", "belady": "Belady (offline MIN)"}


def _label(policy: str) -> str:
    return _LABELS.get(policy, policy.upper())


def _tokens_label(blocks: float, block_tokens: int) -> str:
    tokens = blocks * block_tokens
    if tokens >= 1e6:
        return f"{tokens / 1e6:.3g}M"
    return f"{tokens / 1e3:.3g}k"


def _title(report: dict[str, Any], what: str) -> str:
    name = report.get("trace_name")
    return f"{what} - {name}" if name else what


def plot_hit_rate(
    report: dict[str, Any], path: str | os.PathLike[str], *, weight: str = "token"
) -> None:
    """Hit rate (``weight``: ``token`` or ``block``) against global capacity, one line per
    policy, with the infinite-cache maximum as a dashed line."""
    key = _WEIGHTS[weight]
    bt = report["config"]["kv"]["block_tokens"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    by_policy: dict[str, list[tuple[int, float]]] = {}
    for c in report["caches"]:
        if c["scope"] == "global":
            by_policy.setdefault(c["policy"], []).append((c["capacity_blocks"], 100 * c[key]))
    markers = "osD^vP*X"
    styles = ("-", "--", "-.", ":")
    for n, (policy, pts) in enumerate(by_policy.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker=markers[n % len(markers)],
            linestyle=styles[n % len(styles)],
            markerfacecolor="none" if n % 2 else None,
            label=_label(policy),
            linewidth=1.6,
            markersize=5,
        )
    opt = sorted((b["capacity_blocks"], 100 * b[key]) for b in report.get("belady", []))
    if opt:
        ax.plot(
            [p[0] for p in opt],
            [p[1] for p in opt],
            color="black",
            linewidth=2.2,
            marker="*",
            markersize=7,
            label=_label("belady"),
        )
    ax.axhline(
        100 * report["max"][key],
        color="black",
        linestyle="--",
        linewidth=1.2,
        label=f"theoretical max ({100 * report['max'][key]:.1f}%)",
    )
    ax.set_xscale("log")
    ax.set_xlabel(f"cache capacity (blocks of {bt} tokens, log scale)")
    ax.set_ylabel(f"{weight}-weighted hit rate (%)")
    ax.set_ylim(0, 100 * report["max"][key] * 1.15 + 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(_title(report, "Hit rate vs capacity"))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_belady_gap(
    report: dict[str, Any], path: str | os.PathLike[str], *, weight: str = "token"
) -> None:
    """Percentage points of hit rate (``weight``) each policy leaves below Belady's offline
    optimum, against global capacity."""
    key = _WEIGHTS[weight]
    bt = report["config"]["kv"]["block_tokens"]
    opt = {b["capacity_blocks"]: 100 * b[key] for b in report.get("belady", [])}
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    by_policy: dict[str, list[tuple[int, float]]] = {}
    for c in report["caches"]:
        if c["scope"] == "global" and c["capacity_blocks"] in opt:
            cap = c["capacity_blocks"]
            by_policy.setdefault(c["policy"], []).append((cap, opt[cap] - 100 * c[key]))
    markers = "osD^vP*X"
    styles = ("-", "--", "-.", ":")
    for n, (policy, pts) in enumerate(by_policy.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker=markers[n % len(markers)],
            linestyle=styles[n % len(styles)],
            markerfacecolor="none" if n % 2 else None,
            label=_label(policy),
            linewidth=1.6,
            markersize=5,
        )
    ax.axhline(0, color="black", linewidth=1.0)
    ax.set_xscale("log")
    ax.set_xlabel(f"cache capacity (blocks of {bt} tokens, log scale)")
    ax.set_ylabel(f"Belady minus policy, {weight}-weighted hit (points)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(_title(report, "Gap to Belady's optimum"))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_global_local(
    report: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    policy: str = "lru",
    weight: str = "token",
) -> None:
    """Grouped bars per total capacity: one global pool vs ``N`` local caches (``policy``)."""
    key = _WEIGHTS[weight]
    glob = {
        c["capacity_blocks"]: 100 * c[key]
        for c in report["caches"]
        if c["scope"] == "global" and c["policy"] == policy
    }
    loc = {
        c["capacity_blocks"]: 100 * c[key]
        for c in report["caches"]
        if c["scope"] == "local" and c["policy"] == policy
    }
    caps = sorted(set(glob) & set(loc))
    n_inst = report["config"]["instances"]
    bt = report["config"]["kv"]["block_tokens"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    xs = range(len(caps))
    w = 0.38
    b1 = ax.bar([x - w / 2 for x in xs], [glob[c] for c in caps], w, label="global pool")
    b2 = ax.bar(
        [x + w / 2 for x in xs],
        [loc[c] for c in caps],
        w,
        label=f"{n_inst} local caches of C/{n_inst} ({report['config']['local_router']})",
    )
    for bars in (b1, b2):
        ax.bar_label(
            bars,
            fmt="%.1f",
            fontsize=7,
            padding=1,
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3, "alpha": 0.8},
        )
    ax.axhline(
        100 * report["max"][key],
        color="black",
        linestyle="--",
        linewidth=1.2,
        label="theoretical max",
    )
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{c}\n({_tokens_label(c, bt)} tok)" for c in caps], fontsize=7)
    ax.set_xlabel("total cache capacity (blocks)")
    ax.set_ylabel(f"{weight}-weighted hit rate (%)")
    ax.set_ylim(0, 100 * report["max"][key] * 1.3 + 1)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", ncols=3)
    ax.set_title(_title(report, f"Global pool vs local caches ({_label(policy)})"))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_ttft(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Mean and P90 TTFT per scheduling strategy, worst to best."""
    sched = sorted(report["schedules"], key=lambda s: -s["ttft_mean_s"])
    names = [s["strategy"].replace("_", "\n") for s in sched]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    xs = range(len(sched))
    w = 0.38
    b1 = ax.bar([x - w / 2 for x in xs], [s["ttft_mean_s"] for s in sched], w, label="mean")
    b2 = ax.bar([x + w / 2 for x in xs], [s["ttft_p90_s"] for s in sched], w, label="P90")
    for bars in (b1, b2):
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, fontsize=8)
    cfg = report["config"]
    ax.set_ylabel("TTFT (s, modelled)")
    ax.set_xlabel(
        f"{cfg['instances']} prefill instances x {cfg['instance_capacity']} blocks "
        f"({_label(cfg['schedule_policy'])})",
        fontsize=8,
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_title(report, "TTFT by scheduling strategy"))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_plots(
    report: dict[str, Any], directory: str | os.PathLike[str], *, prefix: str = ""
) -> list[str]:
    """Write every plot the report has data for into ``directory``; return the paths."""
    os.makedirs(directory, exist_ok=True)
    out: list[str] = []
    if any(c["scope"] == "global" for c in report["caches"]):
        p = os.path.join(directory, f"{prefix}hit_rate.png")
        plot_hit_rate(report, p)
        out.append(p)
    if report.get("belady") and any(c["scope"] == "global" for c in report["caches"]):
        p = os.path.join(directory, f"{prefix}belady_gap.png")
        plot_belady_gap(report, p)
        out.append(p)
    policies = [c["policy"] for c in report["caches"] if c["scope"] == "local"]
    if policies:
        policy = "lru" if "lru" in policies else policies[0]
        p = os.path.join(directory, f"{prefix}global_vs_local.png")
        plot_global_local(report, p, policy=policy)
        out.append(p)
    if report["schedules"]:
        p = os.path.join(directory, f"{prefix}ttft.png")
        plot_ttft(report, p)
        out.append(p)
    return out
