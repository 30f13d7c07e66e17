"""The report's workload figures for a service guest, from what its client saw:
the same figures as for the synthetic workloads (normal rate, seconds below 10 % and
50 %, work lost) judged on whole seconds, plus the client's errors and disconnects,
the longest stall and a per-second timeline."""

from __future__ import annotations

from typing import Any

from livemig import metrics
from livemig.services.client import ClientSeries

STALL_FRACTION = 0.1  # a second with under 10 % of the normal rate is a stalled second


def _held(t: float, exclude: tuple[float, float] | None) -> bool:
    """Did the one-second interval ending at ``t`` overlap the verification hold?"""
    return exclude is not None and t > exclude[0] and t - 1.0 < exclude[1]


def longest_stall(series: ClientSeries, baseline: float | None, start: float,
                  end: float, exclude: tuple[float, float] | None = None) -> float:
    """Longest run of consecutive seconds below STALL_FRACTION of normal in [start, end];
    seconds overlapping ``exclude`` (livemig's own verification hold) are skipped."""
    if not baseline:
        return 0.0
    best = run = 0.0
    for tk in series.ticks:
        if not start <= tk.t <= end + 1.0 or _held(tk.t, exclude):
            continue
        if tk.ops < STALL_FRACTION * baseline:
            run += 1.0
            best = max(best, run)
        else:
            run = 0.0
    return best


def client_workload(series: ClientSeries, unit: str, baseline_start: float,
                    start: float, end: float,
                    exclude: tuple[float, float] | None = None) -> dict[str, Any]:
    """``unit``: what an operation is (``transactions``, ``operations``)."""
    samples = series.samples()
    st = metrics.workload_stats(samples, baseline_start, start, end, exclude)
    wl: dict[str, Any] = {**st.as_dict(), "unit": f"{unit}/s", "source": "client"}
    wl["client_errors"] = series.errors
    wl["client_disconnects"] = series.disconnects
    wl["client_messages"] = list(series.messages)
    wl["longest_stall_s"] = longest_stall(series, st.baseline_rate, start, end, exclude)
    wl["per_second"] = [{"t": round(tk.t - start, 3), "rate": tk.ops,
                         "latency_ms": tk.latency_ms, "failed": tk.failed,
                         **({"held_for_verification": True} if _held(tk.t, exclude) else {})}
                        for tk in series.ticks if tk.t >= baseline_start]
    if series.check is not None:
        wl["data_check"] = dict(series.check)
    return wl
