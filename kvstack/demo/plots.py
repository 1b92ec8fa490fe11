"""The PNG plots of ``kvstack demo`` (matplotlib, Agg backend: no display needed).

Each function takes the demo's :class:`kvstack.demo.runs.RunResult` objects by
mode name and writes one file; :func:`write_all` writes them all and returns
their paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from kvstack.demo.runs import RunResult, Sample

FILES = ("token_usage.png", "new_token_ratio.png", "queue_lengths.png", "retract_cost.png")


def write_all(
    plots_dir: Path, runs: dict[str, RunResult], cost: dict[str, dict[str, float]]
) -> list[Path]:
    """Every plot into ``plots_dir`` (created if missing); returns the files written."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    writers = (token_usage, new_token_ratio, queue_lengths)
    paths = [write(plots_dir / name, runs) for name, write in zip(FILES, writers, strict=False)]
    paths.append(retract_cost(plots_dir / FILES[3], cost))
    return paths


def retract_times(samples: list[Sample]) -> list[float]:
    """When the sampler saw the retract-event count go up (one time per new event)."""
    times: list[float] = []
    seen = 0  # each run's scheduler starts counting from zero
    for s in samples:
        times += [s.t] * max(s.retract_events - seen, 0)
        seen = max(seen, s.retract_events)
    return times


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _mark_retracts(ax: Any, run: RunResult) -> None:
    times = retract_times(run.samples)
    for i, t in enumerate(times):
        label = f"retract ({len(times)})" if i == 0 else None
        ax.axvline(t, color="tab:red", alpha=0.5, linestyle="--", linewidth=1, label=label)


def token_usage(path: Path, runs: dict[str, RunResult]) -> Path:
    """Token usage and evictable tokens over time, retracts marked; one panel per mode."""
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items(), strict=True):
        t = [s.t for s in run.samples]
        ax.plot(t, [s.used for s in run.samples], label="used (capacity - available)")
        ax.plot(t, [s.evictable for s in run.samples], label="evictable (cached)")
        ax.axhline(run.capacity, color="gray", linewidth=1, label=f"capacity {run.capacity}")
        _mark_retracts(ax, run)
        where = "decode node" if name == "PD" else "pool"
        ax.set(title=f"{name}: {where} tokens", xlabel="seconds", ylabel="tokens")
        ax.legend(loc="best", fontsize="small")
    return _save(fig, path)


def new_token_ratio(path: Path, runs: dict[str, RunResult]) -> Path:
    """``new_token_ratio`` over time, one line per mode, retracts marked."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, run in runs.items():
        (line,) = ax.plot([s.t for s in run.samples], [s.new_token_ratio for s in run.samples])
        line.set_label(name)
        for t in retract_times(run.samples):
            ax.axvline(t, color=line.get_color(), alpha=0.3, linestyle="--", linewidth=1)
    ax.set(title="new_token_ratio (dashed: retracts)", xlabel="seconds", ylabel="ratio")
    ax.legend()
    return _save(fig, path)


def queue_lengths(path: Path, runs: dict[str, RunResult]) -> Path:
    """The scheduler's queues over time (the decode node's in PD mode); one panel per mode."""
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items(), strict=True):
        names = sorted({q for s in run.samples for q in s.queues})
        t = [s.t for s in run.samples]
        for queue in names:
            ax.step(t, [s.queues.get(queue, 0) for s in run.samples], where="post", label=queue)
        _mark_retracts(ax, run)
        ax.set(title=f"{name}: queue lengths", xlabel="seconds", ylabel="requests")
        ax.legend(loc="upper right", fontsize="small")
    return _save(fig, path)


def retract_cost(path: Path, cost: dict[str, dict[str, float]]) -> Path:
    """What retracting cost each mode: tokens re-prefilled, bytes moved, estimated seconds."""
    modes = list(cost)
    panels = (
        ("reprefilled_tokens", "tokens re-prefilled"),
        ("moved_bytes", "bytes offloaded + loaded"),
        ("seconds", "estimated seconds spent"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4))
    colors = ["tab:blue", "tab:orange", "tab:green"][: len(modes)]
    for ax, (key, title) in zip(axes, panels, strict=True):
        values = [cost[m][key] for m in modes]
        bars = ax.bar(modes, values, color=colors)
        ax.bar_label(bars, labels=[_short(v) for v in values])
        ax.set_title(title)
    fig.suptitle("retract cost: normal mode re-prefills, PD mode offloads and loads back")
    return _save(fig, path)


def _short(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) < 1:
        return f"{value:.3g}"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"
