"""Regression bounds on run results (what ``workbench gate`` checks), over :class:`workbench.results.Samples`.

- ``max-drop METRIC=5%``: the value may fall at most 5% below the baseline (throughputs, goodput);
- ``max-rise METRIC=10%``: the value may rise at most 10% above the baseline (latencies, waste);
- ``max-change METRIC=0.1%``: either way (``*`` = every numeric summary metric: reproducing a
  deterministic simulator run);
- ``ratio paged/static:output_throughput>=1.5``: a ratio between two engines of the same run, which
  needs no baseline and holds across machines.

``METRIC`` is a dotted path into an engine's summary (``output_throughput``, ``e2el_ms.p99``), for
every engine that has it, or prefixed with an engine name (``paged.output_throughput``) for one.

With several runs on either side (``--repeat N``, several RESULTS, or a baseline made from several
runs) a bound compares 95% confidence intervals, mean ± t(0.975, n-1)·s/√n (Student's t, see
``workbench.stats.mean_interval``), instead of
single values: a drop is a violation only when the whole interval of the new runs lies below the bound
computed from the low end of the baseline's interval (a rise: mirrored). With one run on each side this
is the plain comparison of values. The baseline file's format is in :mod:`workbench.results`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from workbench.errors import UsageError
from workbench.results import Samples, fmt
from workbench.stats import mean_interval

ABS_TOL = 1e-9  # absolute slack so that exact zeros and float round-off never fail a bound


class GateError(UsageError):
    """Bad gate input (bound syntax, unknown metric or engine); one line."""


@dataclass
class Interval:
    """Mean and 95% half-width of ``n`` samples (half-width 0 for one sample)."""

    mean: float
    half: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Interval":
        """The 95% interval of the mean of ``values`` (:func:`workbench.stats.mean_interval`).

        Raises:
            ValueError: ``values`` is empty.
        """
        m, half = mean_interval(values, 0.95)
        return cls(m, half, len(values))

    def __str__(self) -> str:
        return fmt(self.mean) if self.n < 2 else f"{fmt(self.mean)} ± {fmt(self.half)}"


# ----------------------------------------------------------------------------------------- bounds


@dataclass
class Bound:
    """``kind`` is ``drop``, ``rise`` or ``change``; ``frac`` the allowed relative change (0.05 = 5%);
    ``engine`` None = every engine that has the metric; ``metric`` ``*`` = every metric."""

    kind: str
    metric: str
    frac: float
    engine: str | None = None

    def spec(self) -> str:
        return f"max-{self.kind} {(self.engine + '.') if self.engine else ''}{self.metric}={self.frac:.4g}"


@dataclass
class RatioBound:
    """``num``/``den`` engines' ``metric`` in the same run must be ``op`` (``>=`` or ``<=``) ``value``."""

    num: str
    den: str
    metric: str
    op: str
    value: float


def parse_fraction(text: str, where: str) -> float:
    """``5%`` -> 0.05; a bare number is a fraction (``0.05``). Raises GateError when not >= 0."""
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise GateError(f"{where}: expected a percentage such as 5% (or a fraction such as 0.05), got {text!r}") from None
    if not v >= 0 or math.isinf(v):
        raise GateError(f"{where}: the allowed change must be a finite number >= 0, got {text!r}")
    return v


def parse_bound(kind: str, item: str, engines: set[str]) -> Bound:
    """``[ENGINE.]METRIC=PCT`` -> :class:`Bound`; the first part is an engine when it names one in ``engines``."""
    key, sep, raw = item.partition("=")
    where = f"--max-{kind} {item}"
    if not sep or not key.strip():
        raise GateError(f"{where}: expected METRIC=PERCENT, e.g. output_throughput=5% or paged.e2el_ms.p99=10%")
    key = key.strip()
    head, dot, rest = key.partition(".")
    engine, metric = (head, rest) if dot and head in engines else (None, key)
    return Bound(kind, metric, parse_fraction(raw, where), engine)


_RATIO = re.compile(r"^\s*([\w-]+)\s*/\s*([\w-]+)\s*:\s*([\w.]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*$")


def parse_ratio(item: str) -> RatioBound:
    """``paged/static:output_throughput>=1.5`` -> :class:`RatioBound`."""
    m = _RATIO.match(item)
    if not m:
        raise GateError(f"--ratio {item}: expected NUM/DEN:METRIC>=VALUE (or <=), e.g. paged/static:output_throughput>=1.5")
    try:
        value = float(m.group(5))
    except ValueError:
        raise GateError(f"--ratio {item}: {m.group(5)!r} is not a number") from None
    return RatioBound(m.group(1), m.group(2), m.group(3), m.group(4), value)


# ----------------------------------------------------------------------------------------- checks


@dataclass
class Check:
    """One evaluated bound: the row of the gate's table."""

    metric: str
    engine: str
    baseline: str
    value: str
    bound: str
    change: str
    ok: bool


def _rel(v: float, b: float) -> str:
    return f"{(v - b) / b:+.2%}" if b else ("+0.00%" if v == b else "n/a")


def check_bound(b: Bound, base: Samples, new: Samples) -> list[Check]:
    """Evaluate one bound on every engine it addresses.

    Raises:
        GateError: the engine or metric exists in neither the baseline nor the results.
    """
    engines = [b.engine] if b.engine else [e for e in new.metrics if e in base.metrics]
    if b.engine and (b.engine not in new.metrics or b.engine not in base.metrics):
        side = "results" if b.engine not in new.metrics else "baseline"
        raise GateError(f"{b.spec()}: no engine {b.engine!r} in the {side}")
    out: list[Check] = []
    for e in engines:
        names = sorted(base.metrics[e]) if b.metric == "*" else [b.metric]
        for m in names:
            if m not in base.metrics[e] or m not in new.metrics[e]:
                if b.metric == "*" or not b.engine:
                    continue
                raise GateError(f"{b.spec()}: engine {e} has no metric {m!r}")
            bi, vi = Interval.of(base.metrics[e][m]), Interval.of(new.metrics[e][m])
            lo = (bi.mean - bi.half) * (1 - b.frac) - ABS_TOL
            hi = (bi.mean + bi.half) * (1 + b.frac) + ABS_TOL
            ok_drop = vi.mean + vi.half >= lo
            ok_rise = vi.mean - vi.half <= hi
            if b.kind == "drop":
                ok, bound = ok_drop, f">= {fmt(lo + ABS_TOL)} (-{b.frac:.4g} rel)"
            elif b.kind == "rise":
                ok, bound = ok_rise, f"<= {fmt(hi - ABS_TOL)} (+{b.frac:.4g} rel)"
            else:
                ok, bound = ok_drop and ok_rise, f"in [{fmt(lo + ABS_TOL)}, {fmt(hi - ABS_TOL)}] (±{b.frac:.4g} rel)"
            out.append(Check(m, e, str(bi), str(vi), bound, _rel(vi.mean, bi.mean), ok))
    if not out and b.metric != "*":
        known = sorted({k for e in new.metrics.values() for k in e})
        raise GateError(f"{b.spec()}: no engine has metric {b.metric!r}; metrics: {', '.join(known)}")
    return out


def check_ratio(r: RatioBound, new: Samples, base: Samples | None = None) -> Check:
    """Evaluate a ratio bound on the per-run ratios of the results (their 95% interval with several runs).

    Raises:
        GateError: an engine or the metric is missing from the results.
    """
    for e in (r.num, r.den):
        if e not in new.metrics:
            raise GateError(f"--ratio {r.num}/{r.den}: no engine {e!r} in the results; engines: {', '.join(new.metrics)}")
        if r.metric not in new.metrics[e]:
            raise GateError(f"--ratio {r.num}/{r.den}:{r.metric}: engine {e} has no metric {r.metric!r}")

    def ratios(s: Samples) -> list[float]:
        return [n / d if d else math.inf for n, d in zip(s.metrics[r.num][r.metric], s.metrics[r.den][r.metric])]

    vi = Interval.of(ratios(new))
    ok = vi.mean + vi.half >= r.value if r.op == ">=" else vi.mean - vi.half <= r.value
    have_base = base is not None and all(e in base.metrics and r.metric in base.metrics[e] for e in (r.num, r.den))
    bstr = str(Interval.of(ratios(base))) if have_base else "-"
    return Check(f"{r.metric} ratio", f"{r.num}/{r.den}", bstr, str(vi), f"{r.op} {r.value:g}", "", ok)


__all__ = ["Bound", "Check", "GateError", "Interval", "RatioBound", "check_bound", "check_ratio", "parse_bound",
           "parse_fraction", "parse_ratio"]
