"""Regression bounds on run results (what ``workbench gate`` checks), over :class:`workbench.results.Samples`.

- ``max-drop METRIC=5%``: the value may fall at most 5% below the baseline (throughputs, goodput);
- ``max-rise METRIC=10%``: the value may rise at most 10% above the baseline (latencies, waste);
- ``max-change METRIC=0.1%``: either way (``*`` = every numeric summary metric: reproducing a
  deterministic simulator run);
- ``ratio paged/static:output_throughput>=1.5``: a ratio between two engines of the same run, which
  needs no baseline and holds across machines. A denominator that is 0 or missing in some run (every
  request of that engine failed, say) violates the ratio instead of counting as infinitely good;
- ``num_failed == 0`` (:func:`check_no_failed`): on by default in ``workbench gate``, every engine of every
  run must have no failed requests (rejections, ``num_rejected``, are a scenario metric like any other).

A bound that checks nothing (a ``*`` or a metric that no engine of both sides has) is a :class:`GateError`,
not a pass of 0 checks. A metric of the baseline that a run no longer reports violates its bound.

``METRIC`` is a dotted path into an engine's summary (``output_throughput``, ``e2el_ms.p99``), for
every engine that has it, or prefixed with an engine name (``paged.output_throughput``) for one.

With several runs on either side (``--repeat N``, several RESULTS, or a baseline made from several
runs) a bound compares 95% confidence intervals, mean ± t(0.975, n-1)·s/√n (Student's t, see
``workbench.stats.mean_interval``), instead of
single values: a drop is a violation only when the whole interval of the new runs lies below the bound
computed from the low end of the baseline's interval (a rise: mirrored). With one run on each side this
is the plain comparison of values. The slack is a fraction of the magnitude of each end of the baseline's
interval, so the allowed range keeps its order for negative metrics too. The baseline file's format is in
:mod:`workbench.results`.
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
        """The bound as written on the command line, e.g. ``--max-change *=0.1%``."""
        return f"--max-{self.kind} {(self.engine + '.') if self.engine else ''}{self.metric}={self.frac * 100:.4g}%"


@dataclass
class RatioBound:
    """``num``/``den`` engines' ``metric`` in the same run must be ``op`` (``>=`` or ``<=``) ``value``."""

    num: str
    den: str
    metric: str
    op: str
    value: float

    def spec(self) -> str:
        """The bound as written on the command line, e.g. ``--ratio paged/static:output_throughput>=1.4``."""
        return f"--ratio {self.num}/{self.den}:{self.metric}{self.op}{self.value:g}"


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
    note: str = ""  # why a violated check could not be evaluated (a missing value, a zero denominator)


def _rel(v: float, b: float) -> str:
    """The relative change from ``b`` to ``v``, signed as ``v - b`` (also for negative ``b``)."""
    return f"{(v - b) / abs(b):+.2%}" if b else ("+0.00%" if v == b else "n/a")


def allowed_range(base: Interval, frac: float) -> tuple[float, float]:
    """``(lo, hi)``: the low end of the baseline's interval less ``frac`` of its magnitude, and the high end
    plus ``frac`` of its magnitude, each with :data:`ABS_TOL` of slack; ``lo <= hi`` for any sign."""
    low, high = base.mean - base.half, base.mean + base.half
    return low - abs(low) * frac - ABS_TOL, high + abs(high) * frac + ABS_TOL


def check_bound(b: Bound, base: Samples, new: Samples) -> list[Check]:
    """Evaluate one bound on every engine it addresses.

    A metric of the baseline that the results lack is a violated check; one that only the results have
    is not checked (nothing to compare with).

    Raises:
        GateError: the engine or metric exists in neither the baseline nor the results, or the bound
            checks nothing at all.
    """
    engines = [b.engine] if b.engine else [e for e in new.metrics if e in base.metrics]
    if b.engine and (b.engine not in new.metrics or b.engine not in base.metrics):
        side = "results" if b.engine not in new.metrics else "baseline"
        raise GateError(f"{b.spec()}: no engine {b.engine!r} in the {side}")
    out: list[Check] = []
    for e in engines:
        names = sorted(base.metrics[e]) if b.metric == "*" else [b.metric]
        for m in names:
            if m not in base.metrics[e]:
                if b.metric == "*" or not b.engine:
                    continue
                raise GateError(f"{b.spec()}: the baseline's engine {e} has no metric {m!r}")
            bi = Interval.of(base.metrics[e][m])
            have = len(new.metrics[e].get(m, []))
            if have != new.num_runs:  # Samples record a metric only for the runs that report it
                out.append(Check(m, e, str(bi), "-", "present", "", False,
                                 f"{e}.{m} is in the baseline but missing in {new.num_runs - have} of "
                                 f"{new.num_runs} run(s) of the results"))
                continue
            vi = Interval.of(new.metrics[e][m])
            lo, hi = allowed_range(bi, b.frac)
            ok_drop = vi.mean + vi.half >= lo
            ok_rise = vi.mean - vi.half <= hi
            if b.kind == "drop":
                ok, bound = ok_drop, f">= {fmt(lo + ABS_TOL)} (-{b.frac:.4g} rel)"
            elif b.kind == "rise":
                ok, bound = ok_rise, f"<= {fmt(hi - ABS_TOL)} (+{b.frac:.4g} rel)"
            else:
                ok, bound = ok_drop and ok_rise, f"in [{fmt(lo + ABS_TOL)}, {fmt(hi - ABS_TOL)}] (±{b.frac:.4g} rel)"
            out.append(Check(m, e, str(bi), str(vi), bound, _rel(vi.mean, bi.mean), ok))
    if not out:
        if b.metric == "*":
            raise GateError(f"{b.spec()} checks nothing: no engine has metrics in both the baseline (engines: "
                            f"{', '.join(base.metrics) or 'none'}) and the results (engines: "
                            f"{', '.join(new.metrics) or 'none'})")
        known = sorted({k for e in new.metrics.values() for k in e})
        raise GateError(f"{b.spec()}: no engine has metric {b.metric!r} in both the baseline and the results; "
                        f"metrics: {', '.join(known) or 'none'}")
    return out


def _ratios(r: RatioBound, s: Samples) -> tuple[list[float], str]:
    """The per-run ratios of ``s`` and ``""``; or ``[]`` and why they cannot be computed: the numerator or
    the denominator is missing in some run, or the denominator is 0 in some run (a ratio over it would be
    infinite, or undefined, and prove nothing)."""
    runs = f"{s.num_runs} run(s)"
    cols = {}
    for role, name in (("numerator", r.num), ("denominator", r.den)):
        vals = s.metrics.get(name, {}).get(r.metric, [])
        if len(vals) != s.num_runs:  # Samples record a metric only for the runs that report it
            return [], f"the {role} {name}.{r.metric} is missing in {s.num_runs - len(vals)} of {runs}"
        cols[role] = vals
    zeros = sum(1 for d in cols["denominator"] if d == 0)
    if zeros:
        return [], (f"the denominator {r.den}.{r.metric} is 0 in {zeros} of {runs} (did every request of "
                    f"{r.den} fail or get rejected?)")
    return [n / d for n, d in zip(cols["numerator"], cols["denominator"])], ""


def check_ratio(r: RatioBound, new: Samples, base: Samples | None = None) -> Check:
    """Evaluate a ratio bound on the per-run ratios of the results (their 95% interval with several runs).

    A denominator that is 0 or missing in some run, or a numerator missing in some run, is a violated
    check whose ``note`` says which.

    Raises:
        GateError: an engine is missing from the results, or neither engine has the metric.
    """
    for e in (r.num, r.den):
        if e not in new.metrics:
            raise GateError(f"{r.spec()}: no engine {e!r} in the results; engines: {', '.join(new.metrics)}")
    if all(r.metric not in new.metrics[e] for e in (r.num, r.den)):
        raise GateError(f"{r.spec()}: neither engine has metric {r.metric!r}")
    name, engines, bound = f"{r.metric} ratio", f"{r.num}/{r.den}", f"{r.op} {r.value:g}"
    bstr = "-"
    if base is not None:
        bvals, _ = _ratios(r, base)
        bstr = str(Interval.of(bvals)) if bvals else "-"
    vals, why = _ratios(r, new)
    if not vals:
        return Check(name, engines, bstr, "n/a", bound, "", False, why)
    vi = Interval.of(vals)
    ok = vi.mean + vi.half >= r.value if r.op == ">=" else vi.mean - vi.half <= r.value
    return Check(name, engines, bstr, str(vi), bound, "", ok)


def check_no_failed(new: Samples, base: Samples | None = None) -> list[Check]:
    """One check per engine of the results: ``num_failed`` is 0 in every run (an engine that does not
    record it violates the check: the gate cannot tell)."""
    out = []
    for e, ms in new.metrics.items():
        bvals = base.metrics.get(e, {}).get("num_failed") if base is not None else None
        bstr = str(Interval.of(bvals)) if bvals else "-"
        vals = ms.get("num_failed")
        if not vals or len(vals) != new.num_runs:
            out.append(Check("num_failed", e, bstr, "-", "== 0", "", False,
                             f"{e} does not record num_failed in every run; pass --allow-failed to skip this check"))
            continue
        bad = sum(1 for v in vals if v != 0)
        out.append(Check("num_failed", e, bstr, fmt(max(vals)) if bad else "0", "== 0", "", not bad,
                         f"{e} has failed requests in {bad} of {new.num_runs} run(s) (up to {fmt(max(vals))}); "
                         f"pass --allow-failed to gate anyway" if bad else ""))
    return out


__all__ = ["ABS_TOL", "Bound", "Check", "GateError", "Interval", "RatioBound", "allowed_range", "check_bound",
           "check_no_failed", "check_ratio", "parse_bound", "parse_fraction", "parse_ratio"]
