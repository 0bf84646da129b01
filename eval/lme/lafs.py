"""The latency-aware frontier score (LAFS) of LME-V2 (lme-v2.md, "Latency-aware score (LAFS)").

A point is (accuracy in percent, mean memory query latency in seconds). A(T) is the best accuracy
among points with latency <= T (0 if none), a step function that only changes at the latencies of
Pareto-frontier points. LAFS = (integral of A(T) d ln T over T in [1, 200] s) / ln 200, computed
exactly: sum over consecutive breakpoints [l, r] of A(l) * ln(r / l). Gain = LAFS(reference +
yours) - LAFS(reference).

Convention (that of leaderboard/compute_lafs.py, which reproduces the reference values 55.76 for
small and 51.07 for medium to two decimals): a point faster than t_min = 1 s counts from T = 1 s on
(A(1) already includes it, so the RAG points at 0.2 s / 0.3 s fill [1, first slower point]); a
point slower than t_max = 200 s never counts; the accuracy floor is 0; a latency of exactly 0 is
accepted (lme-v2.md: "latency <= T"), a negative one is an error.
"""

from __future__ import annotations

import math

from common.errors import MemexError

from .metrics import point_from_result, read_aggregated

T_MIN, T_MAX = 1.0, 200.0
# lme-v2.md: the reference frontier (accuracy %, latency s), and the LAFS values it must give.
REFERENCE_POINTS = {
    "small": [(51.0, 0.2), (58.6, 26.9), (74.9, 108.3), (69.9, 177.2)],
    "medium": [(45.9, 0.3), (57.0, 25.8), (70.1, 139.9), (68.7, 185.8)],
}
REFERENCE_NAMES = ("RAG slice+notes", "AgentRunbook-R", "AgentRunbook-C", "Codex")
REFERENCE_LAFS = {"small": 55.76, "medium": 51.07}


def _check(points) -> list[tuple[float, float]]:
    out = [(float(a), float(t)) for a, t in points]
    for acc, lat in out:
        if lat < 0 or math.isnan(lat) or math.isnan(acc):
            raise MemexError(f"LAFS point ({acc}, {lat}): the latency must be a number >= 0 seconds")
    return out


def pareto_frontier(points) -> list[tuple[float, float]]:
    """The non-dominated (accuracy, latency) points, by increasing latency: each beats every faster one."""
    frontier: list[tuple[float, float]] = []
    for acc, lat in sorted(_check(points), key=lambda p: (p[1], -p[0])):
        if not frontier or acc > frontier[-1][0]:
            frontier.append((acc, lat))
    return frontier


def accuracy_at(points, t: float) -> float:
    """A(t): the best accuracy among points with latency <= t, 0 if none."""
    return max((acc for acc, lat in _check(points) if lat <= t), default=0.0)


def lafs(points, t_min: float = T_MIN, t_max: float = T_MAX) -> float:
    """(integral of A(T) d ln T over [t_min, t_max]) / ln(t_max / t_min), exactly from the breakpoints."""
    if not 0 < t_min < t_max:
        raise MemexError(f"LAFS needs 0 < t_min < t_max, got t_min={t_min}, t_max={t_max}")
    frontier = pareto_frontier(points)
    cuts = sorted({t_min, t_max, *(lat for _, lat in frontier if t_min < lat < t_max)})
    area = sum(accuracy_at(frontier, left) * math.log(right / left) for left, right in zip(cuts, cuts[1:]))
    return area / math.log(t_max / t_min)


def tier_name(tier: str) -> str:
    """"small"/"medium" from a tier or haystack name ("lme_v2_small", "haystacks/lme_v2_medium.json")."""
    name = str(tier).rsplit("/", 1)[-1].removesuffix(".json").removeprefix("lme_v2_")
    if name not in REFERENCE_POINTS:
        raise MemexError(f"unknown LME-V2 tier {tier!r}; expected small or medium")
    return name


def lafs_report(tier: str, extra_points) -> dict:
    """Reference LAFS, LAFS with `extra_points` added, the gain, and both frontiers."""
    tier = tier_name(tier)
    reference, extra = REFERENCE_POINTS[tier], _check(extra_points)
    ref, combined = lafs(reference), lafs(reference + extra)
    return {"tier": tier, "t_min_seconds": T_MIN, "t_max_seconds": T_MAX, "reference_lafs": ref,
            "lafs": combined, "gain": combined - ref, "points": extra,
            "reference_frontier": pareto_frontier(reference), "frontier": pareto_frontier(reference + extra)}


def format_lafs_report(report: dict) -> str:
    """The report as text, values to two decimals."""
    frontier = set(report["frontier"])
    lines = [f"LME-V2 {report['tier']}: T in [{report['t_min_seconds']:g}, {report['t_max_seconds']:g}] s",
             f"reference LAFS   {report['reference_lafs']:.2f}",
             f"LAFS with yours  {report['lafs']:.2f}",
             f"gain             {report['gain']:+.2f}"]
    if report["points"]:
        lines += ["", f"{'point':<8}{'accuracy %':>12}{'latency s':>12}  on frontier"]
        for i, (acc, lat) in enumerate(report["points"], 1):
            lines.append(f"{i:<8}{acc:>12.2f}{lat:>12.2f}  {'yes' if (acc, lat) in frontier else 'no'}")
    return "\n".join(lines)


def parse_point(text: str) -> tuple[float, float]:
    """"ACC_PERCENT,LATENCY_S" -> (acc, latency); MemexError naming the string when malformed."""
    try:
        acc, lat = (float(x) for x in text.split(","))
    except ValueError:
        raise MemexError(f"bad point {text!r}: write ACC_PERCENT,LATENCY_S, e.g. 62.5,14.2") from None
    if not 0 <= acc <= 100 or not lat >= 0 or math.isinf(lat):
        raise MemexError(f"bad point {text!r}: accuracy must be a percentage in [0, 100] and latency >= 0 seconds")
    return acc, lat


def lafs_command(tier: str | None, points: list[str], result_dirs: list[str]) -> str:
    """`memexrl lme lafs [--tier T] [--point ACC,LAT ...] [RESULT_DIR ...]`: reference LAFS, LAFS with the
    points (given, and read from each result's aggregated_metrics.json), the gain, and a table of points.

    Without --tier the tier is the `haystack` stored in the results' aggregated_metrics.json."""
    extra = [parse_point(p) for p in points]
    stored = set()
    for result in result_dirs:
        extra.append(point_from_result(result))
        haystack = read_aggregated(result).get("haystack")
        if haystack:
            stored.add(tier_name(haystack))
    if tier is None:
        if len(stored) != 1:
            found = f"they name {sorted(stored)}" if stored else "no result names its haystack"
            raise MemexError(f"cannot tell the LME-V2 tier ({found}); pass --tier small or --tier medium")
        tier = stored.pop()
    elif stored - {tier_name(tier)}:
        raise MemexError(f"--tier {tier} but the results were run on {sorted(stored)}; compare a result with "
                         "the reference frontier of its own tier")
    return format_lafs_report(lafs_report(tier, extra))
