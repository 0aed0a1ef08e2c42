"""Pictures of `jaxserve bench` reports (``--plot out.png``): a load sweep as curves, a
compare run as bars. matplotlib, headless (the Agg backend), imported only when asked:
``pip install 'jaxserve[plot]'``."""

from __future__ import annotations

from jaxserve.errors import ConfigError

MS = 1e3


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'jaxserve[plot]'") from None
    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    return plt


def _latency_axes(ax, xs, stats: list[dict], key: str, label: str) -> None:
    for pct, style in (("p50", "o-"), ("p99", "s--")):
        ax.plot(xs, [s[key][pct] * MS for s in stats], style, label=f"{label} {pct}")


def sweep(points: list[tuple[float, dict]], axis: str, title: str, path: str) -> None:
    """Throughput, TTFT and inter-token latency (p50 / p99) against load: ``points`` are
    (concurrency or request rate, the ``summarize`` dict of that run)."""
    plt = _pyplot()
    xs = [x for x, _ in points]
    stats = [s for _, s in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    left.plot(xs, [s["output_throughput"] for s in stats], "o-", label="output")
    left.plot(xs, [s["total_throughput"] for s in stats], "s--", label="total (prompt + output)")
    left.set(xlabel=axis, ylabel="tokens / s", title="throughput")
    _latency_axes(right, xs, stats, "ttft_s", "TTFT")
    _latency_axes(right, xs, stats, "itl_s", "ITL")
    right.set(xlabel=axis, ylabel="ms", title="latency", yscale="log")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def compare(rows: list[tuple[str, dict]], title: str, path: str) -> None:
    """Variants side by side: output throughput, and TTFT / ITL p50 and p99, one bar group each."""
    plt = _pyplot()
    names = [name for name, _ in rows]
    stats = [s for _, s in rows]
    positions = list(range(len(rows)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    left.bar(positions, [s["output_throughput"] for s in stats], color="tab:blue")
    left.set(ylabel="output tokens / s", title="throughput")
    width = 0.2
    for i, (key, pct) in enumerate((("ttft_s", "p50"), ("ttft_s", "p99"), ("itl_s", "p50"), ("itl_s", "p99"))):
        shifted = [p + (i - 1.5) * width for p in positions]
        right.bar(shifted, [s[key][pct] * MS for s in stats], width, label=f"{key[:-2].upper()} {pct}")
    right.set(ylabel="ms", title="latency", yscale="log")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xticks(positions, names, rotation=20, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
