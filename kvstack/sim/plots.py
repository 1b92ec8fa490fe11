"""PNG plots of simulation results (matplotlib, Agg backend: no display needed).

- ``timeline-NN.png`` per run: KV tokens held by requests and evictable
  cache over simulated time, retract events marked; the new-token ratio;
  waiting and running queue lengths.
- ``sweep.png`` when there are several runs: throughput, p99 latency and
  retractions per configuration, side by side.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

from kvstack.sim.runner import SimResult
from kvstack.sim.settings import label

MAX_POINTS = 5000  # plotted per line; longer series are strided


def write_plots(results: list[SimResult], out_dir: str | Path) -> list[Path]:
    """Write every plot for ``results`` into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [timeline(r, out / f"timeline-{i:02d}.png") for i, r in enumerate(results)]
    if len(results) > 1:
        paths.append(sweep_chart(results, out / "sweep.png"))
    return paths


def _strided(values: list, stride: int) -> list:
    return values[::stride]


def timeline(result: SimResult, path: Path) -> Path:
    series = result.series
    stride = max(1, len(series.t) // MAX_POINTS)
    t = _strided(series.t, stride)
    fig, (mem, ratio, queues) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    fig.suptitle(f"kvstack sim: {label(result.settings)}")
    mem.plot(t, _strided(series.used, stride), label="held by requests")
    mem.plot(t, _strided(series.evictable, stride), label="evictable cache")
    mem.axhline(result.capacity, color="grey", linestyle=":", label="capacity")
    if series.retracts:
        times = [when for when, _ in series.retracts]
        mem.scatter(
            times,
            [result.capacity] * len(times),
            marker="v",
            color="red",
            label="retract",
            zorder=3,
        )
    mem.set_ylabel("KV tokens")
    mem.legend(loc="lower right", fontsize="small")
    ratio.plot(t, _strided(series.ratio, stride), color="tab:purple")
    ratio.set_ylabel("new_token_ratio")
    queues.plot(t, _strided(series.waiting, stride), label="waiting")
    queues.plot(t, _strided(series.running, stride), label="running")
    queues.set_ylabel("requests")
    queues.set_xlabel("simulated seconds")
    queues.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def sweep_chart(results: list[SimResult], path: Path) -> Path:
    names = [label(r.settings) for r in results]
    metrics = [
        ("throughput_tok_s", "output tokens/s"),
        ("p99_latency_s", "p99 latency (s)"),
        ("retractions", "retractions"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4 + 0.15 * len(names)))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        values = [r.totals.get(key) or 0 for r in results]
        ax.barh(range(len(names)), values, color="tab:blue")
        ax.set_yticks(range(len(names)), names if ax is axes[0] else [""] * len(names))
        ax.invert_yaxis()
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
