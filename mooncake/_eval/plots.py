"""PNG figures of a run (matplotlib, imported here only; headless ``Agg`` backend).

* ``ttft_cdf_MODEL.png``: the empirical CDF of TTFT per scenario (x log scale): a curve to the
  left is faster; the gap between curves at y = 0.5 / 0.9 is the p50 / p90 difference.
* ``hit_rate_MODEL.png``: per request, the share of its prompt tokens vLLM did not compute
  (``cached_tokens / prompt_tokens``), rolling mean over ``window`` requests, against arrival
  time; fault events as vertical lines (where the fault scenario ran). PD scenarios are left
  out (their decoder's share is 1 by design).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_plots"]


def write_plots(results: list[dict[str, Any]], out: Path, window: int = 5) -> list[str]:
    """Writes the figures into ``out``; returns their file names. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    models = sorted({r["model"] for r in results})
    for model in models:
        rs = [r for r in results if r["model"] == model]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for r in rs:
            xs = sorted(x["ttft"] for x in r["records"] if x["ttft"] is not None and not x["error"])
            if xs:
                ax.step(
                    xs,
                    [(i + 1) / len(xs) for i in range(len(xs))],
                    where="post",
                    label=r["scenario"],
                )
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF per scenario ({model})")
        names.append(_save(plt, fig, ax, out / f"ttft_cdf_{model}.png"))

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for r in rs:
            if r["scenario"].startswith("pd"):
                continue  # the decoder loads every prompt token from the prefiller: always 1
            pts = sorted(
                (x["arrival_s"], (x["cached_tokens"] or 0) / x["prompt_tokens"])
                for x in r["records"]
                if x["prompt_tokens"] and not x["error"]
            )
            if not pts:
                continue
            ys = [p[1] for p in pts]
            roll = [
                sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
                for i in range(len(ys))
            ]
            ax.plot([p[0] for p in pts], roll, marker=".", label=r["scenario"])
            for e in r["events"]:
                ax.axvline(
                    e["t"],
                    color="red" if "killed" in e["event"] else "green",
                    linestyle="--",
                    alpha=0.6,
                )
        ax.set_xlabel("arrival (s)")
        ax.set_ylabel(f"cached share of prompt (rolling {window})")
        ax.set_ylim(0, 1)
        ax.set_title(f"Prefix hit rate over time ({model}); dashed: pool killed/restarted")
        names.append(_save(plt, fig, ax, out / f"hit_rate_{model}.png"))
    return names


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> str:
    """Grid and legend on ``ax``, ``fig`` written to ``path`` and closed; answers its file name."""
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
