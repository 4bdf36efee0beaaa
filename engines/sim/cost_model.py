"""Step-time cost model for the simulator: predicts a whole engine step's seconds from its shape (no torch).

A step's shape is ``engines.core.step_shape.StepShape``. A measured (table) cost model predicts::

    t_exec = B(g_b(tokens)) + L(g_l(sampled)) + c_row * (decode_rows + padding_rows) + c_ctx * live_ctx
             + c_scat * scattered_ctx + c_pad * padding_ctx + c_seq * prefill_seqs + c_attn * prefill_attn + c_pctx * prefill_ctx + c_samp * sampled
    t_step = t_exec + o_const + o_seq * num_seqs

* ``B(tokens)``: the model body's GEMMs (every row: prefill tokens, decode and padding rows), embedding,
  norms, RoPE, K/V writes and building the step's input tensors, as a piecewise-linear function of the token
  count (knots at the profiled token counts, linear past the last one): CPU GEMM time is far from linear
  at small batches, where reading the weights dominates. ``g_b`` and ``g_l`` are the row counts the GEMMs
  really run at (``row_buckets``; ``engines.core.row_buckets``): oneDNN layers pad a step's rows up to a
  bucket (a 518-token step runs its GEMMs at 576 rows), so ``B`` is a step function of the tokens, which
  interpolating between measured token counts alone under-predicted by up to 11% (the rest of ``B``, norms and
  RoPE, is charged at the padded rows too: a few percent of it).
* ``L(sampled)``: the LM head (``[rows, hidden] x [hidden, vocab]``), measured on its own per row count.
* decode attention reads each live row's KV (``live_ctx``: the live rows' share of ``decode_ctx``), more
  slowly where its blocks are scattered over the pool (``scattered_ctx``), and costs a little per row; a static padding row reads the one scratch block over and over (``padding_ctx``), which
  stays in cache; prefill attention is run
  per chunk (``prefill_seqs``), over query x key pairs (``prefill_attn``), and a chunk after cached tokens
  reads them from the paged cache (``prefill_ctx``); ``sampled`` charges the sampler.
* ``o_const + o_seq * num_seqs``: the engine's own CPU work around the executor (scheduling, updating
  requests, detokenizing), measured by running the real scheduler with a null executor.

The knot values of ``B`` and the ``c`` coefficients are fitted together by non-negative least squares on
relative errors over a grid of real steps (single and multi-prompt prefills, decode batches over rows x
context, chunks after cached context, mixed steps, static batches with padding rows); see
``engines.sim.profiler``. This follows Vidur's operator-level predictors (GEMM time by token count,
attention by KV read and prefill pairs), folded into one model of the whole step.

A linear cost model (``coef`` only, no tables) predicts ``sum(coef[k] * f[k] for k in FEATURES)``; tests and
hand-written profiles use it.

Step-to-step noise: the profile records the relative spread of repeated timings of each grid step, and keeps
it by step size (``noise_table``: the median spread per power-of-2 bucket of tokens, :func:`noise_table_of`) as
well as overall (``noise_cv``, the median over every step); a simulator given a seed multiplies each step by a
mean-one lognormal draw of the spread at the step's tokens (:class:`StepNoise`). The spread falls with the
step's size: on a 2-core AVX-512 AMD EPYC the grid steps of at most 8 tokens spread 10.5% (median), those of
9-31 tokens 8.2%, of 32-256 5.6% and of more 2.1%, against 5.9% over all of them, so one spread for every step
made a static engine's decode steps (1-8 rows) too even: its simulated ITL p99 came out 22.7% short.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engines.core.row_buckets import gemm_rows
from engines.core.step_shape import StepShape

FEATURES = ("const", "tokens", "decode_ctx", "prefill_attn", "sampled")
# the measured features, grid, repeats and the order steps are timed in; a profile cached under another format is
# measured anew
PROFILE_FORMAT = 11
# linear terms added to the tables' B(tokens) + L(sampled) in a measured cost model
TABLE_FEATURES = ("rows", "live_ctx", "scattered_ctx", "padding_ctx", "prefill_seqs", "prefill_attn", "prefill_ctx",
                  "sampled")


def step_features(seqs) -> dict[str, float]:
    """Features of one step from its scheduled sequences (``ScheduledSeq``): the ``StepShape`` fields, plus
    ``const`` (1), ``rows`` (decode + padding rows) and ``live_ctx`` (the live decode rows' part of ``decode_ctx``)."""
    return shape_features(StepShape.of(seqs))


def shape_features(shape: StepShape) -> dict[str, float]:
    """A ``StepShape`` as cost-model features (see :func:`step_features`)."""
    f = {k: float(v) for k, v in shape.as_dict().items()}
    f["const"] = 1.0
    f["rows"] = float(shape.decode_rows + shape.padding_rows)
    f["live_ctx"] = float(shape.decode_ctx - shape.padding_ctx)
    return f


def linear_terms(coef: dict[str, float], f: dict[str, float], names: tuple[str, ...]) -> float:
    """``sum(coef[k] * f[k] for k in names)``, a missing name counting 0, added in the order of ``names`` (a loop, not
    a generator: this runs every simulated step)."""
    t = 0.0
    for k in names:
        t += coef.get(k, 0.0) * f.get(k, 0.0)
    return t


# Drift classes by the step's GEMM rows. A step of a few rows is bound by reading every weight from memory, a
# step of many by the GEMMs' arithmetic (the ridge: about 16 float32 rows at 150 GFLOP/s and 20 GB/s), and on a
# shared VM the two drift apart: in one quickstart run on a 2-core AVX-512 AMD EPYC the static engine's decode
# steps of 5-8 rows ran 1.09x the profile while its prefills ran 1.00x, and the 1- and 4-row probes read
# 1.07-1.12x while the 48-row probe read 0.90-1.05x.
SCALE_SMALL_TOKENS = 8  # drift: steps up to this many tokens take ``speed_scale`` (memory-bound)
SCALE_LARGE_TOKENS = 32  # ... and steps from this many on ``speed_scale_large`` (compute-bound)


# How far a large step's time follows the large pilot probe (a 128-token prefill) when the machine's speed moves:
# as the exponent of the pilot's factor, 1 up to the pilot's own size, log-linear down to PILOT_ELASTICITY_FLOOR
# at PILOT_ELASTICITY_FLOOR_TOKENS and that beyond. Measured with ``benchmarks/pilot_elasticity.py --seconds 360``
# (slopes of log step time on log pilot time over windows of 4-8 rounds) on a 2-core AMD EPYC (AVX-512): a
# 128-token prefill 1.01-1.02 (the pilot's own shape), prefills of 512, 2 x 512 and 8 x 333 tokens 0.49-0.57 (an
# earlier script of the same design, not kept: 0.41-0.66); and in real runs (an analysis script not kept: three
# repeats of each of 16 engines, each engine's repeats against their own mean, so the profile's error at a shape
# drops out) steps of 32-127 tokens 0.99, 128-511 0.60, 512-2,047 0.56, 2,048 and
# more 0.43. Dividing a 512- to 2,664-token step's single runs by the pilot's speed took their spread from
# 0.042-0.051 to 0.041-0.055 at exponent 1 and to 0.019-0.022 at 0.5.
PILOT_LARGE_TOKENS = 128  # the large pilot probe: a prefill of this many tokens (engines.sim.profiler.PILOT_PROBES)
PILOT_ELASTICITY_FLOOR_TOKENS = 512
PILOT_ELASTICITY_FLOOR = 0.5


def pilot_elasticity(tokens: float) -> float:
    """The exponent of the large drift class's factor that a step of ``tokens`` tokens takes: 1 up to
    :data:`PILOT_LARGE_TOKENS`, :data:`PILOT_ELASTICITY_FLOOR` from :data:`PILOT_ELASTICITY_FLOOR_TOKENS`,
    linear in log(tokens) between (measured; see the constants)."""
    if tokens <= PILOT_LARGE_TOKENS:
        return 1.0
    if tokens >= PILOT_ELASTICITY_FLOOR_TOKENS:
        return PILOT_ELASTICITY_FLOOR
    w = math.log(tokens / PILOT_LARGE_TOKENS) / math.log(PILOT_ELASTICITY_FLOOR_TOKENS / PILOT_LARGE_TOKENS)
    return 1.0 - w * (1.0 - PILOT_ELASTICITY_FLOOR)


def class_mix(tokens: float, small: float, large: float, elastic: bool = False) -> float:
    """A drift factor for a step of ``tokens`` tokens from the factors of the two drift classes: ``small`` up to
    ``SCALE_SMALL_TOKENS``, ``large`` from ``SCALE_LARGE_TOKENS``, linear in log(tokens) between. ``elastic``:
    ``large`` is a probe's reading of the machine (the pilots'), which a step of more tokens follows only in part:
    it takes ``large ** pilot_elasticity(tokens)``."""
    if tokens <= SCALE_SMALL_TOKENS:
        return small
    if tokens >= SCALE_LARGE_TOKENS:
        return large ** pilot_elasticity(tokens) if elastic else large
    w = math.log(tokens / SCALE_SMALL_TOKENS) / math.log(SCALE_LARGE_TOKENS / SCALE_SMALL_TOKENS)
    return small + w * (large - small)


@dataclass
class CostModel:
    """A step-time model; seconds per unit of each feature.

    Attributes:
        coef: feature name -> seconds per unit (``const`` in seconds per step).
        source: where the coefficients came from (command, machine).
        fit_error: error figures of the fit (relative errors on fitted and held-out steps).
        body_table: ``[[tokens, seconds], ...]``: the fitted knots of ``B``.
        lm_table: ``[[rows, seconds], ...]``: the LM head's measured time.
        overhead: ``{"const": s, "per_seq": s}``: the engine's CPU work per step outside the executor.
        noise_cv: relative step-to-step spread of identical steps (0: none): the median over the profile's steps.
        noise_table: ``[[tokens, spread], ...]`` (sorted by tokens): the spread by step size
            (:func:`noise_table_of`); empty (an older or hand-written profile): ``noise_cv`` for every step.
        fingerprint: what the profile measured (machine, threads, torch, model, dtype, kernels); see
            ``engines.sim.calibration``.
        created: ISO time the profile was measured.
        speed_scale: multiplies every prediction (a drift correction; 1.0 as measured); with
            ``speed_scale_large`` set, only those of steps of at most :data:`SCALE_SMALL_TOKENS` tokens
            and the engine overhead.
        row_buckets: ``{"body": scheme, "lm_head": scheme}``: how the real engine's GEMMs pad their rows
            (``engines.core.row_buckets.gemm_rows``; missing or ``""``: not at all); ``B`` and ``L`` are
            looked up at the padded rows.
        speed_scale_large: the drift correction of steps of at least :data:`SCALE_LARGE_TOKENS` tokens
            (None: ``speed_scale`` for every step); between the two sizes the factor is interpolated
            linearly in log(tokens). See :meth:`scale`.
        speed_elastic: the two factors are the probes' reading of the machine's drift (``workbench.runner.drift``),
            which steps of more than :data:`PILOT_LARGE_TOKENS` tokens follow only in part
            (:func:`pilot_elasticity`); False: every step of at least :data:`SCALE_LARGE_TOKENS` tokens takes
            ``speed_scale_large`` as it is (a factor measured on the steps themselves, or none).
        probe_baseline: ``[{"probe": i, "seconds": s}, ...]``: the drift probe steps
            (``engines.sim.profiler.PROBE_GRID[i]``) timed when the profile was measured, the same way a run times
            them. A run's drift is the probes' time now over this baseline, so that the fit's own error at a
            probe step (the 384-token probe read 0.93x the prediction before and after a replay on a 2-core
            AVX2 CPU, whose own big steps ran at 0.99-1.01x it) is not read as the machine's drift; empty (a
            hand-written or older profile): drift is measured against the predictions.
    """

    coef: dict[str, float]
    source: str = ""
    fit_error: dict = field(default_factory=dict)
    body_table: list[list[float]] = field(default_factory=list)
    lm_table: list[list[float]] = field(default_factory=list)
    overhead: dict[str, float] = field(default_factory=dict)
    noise_cv: float = 0.0
    fingerprint: dict = field(default_factory=dict)
    created: str = ""
    speed_scale: float = 1.0
    speed_scale_large: float | None = None
    speed_elastic: bool = False
    row_buckets: dict[str, str] = field(default_factory=dict)
    probe_baseline: list[dict] = field(default_factory=list)
    noise_table: list[list[float]] = field(default_factory=list)

    def scale(self, tokens: float) -> float:
        """The drift factor of a step of ``tokens`` tokens (see ``speed_scale_large``)."""
        big = self.speed_scale_large
        return self.speed_scale if big is None else class_mix(tokens, self.speed_scale, big, self.speed_elastic)

    def predict_exec(self, f: dict[str, float]) -> float:
        """Seconds the executor takes for a step with features ``f`` (``shape_features``)."""
        coef = self.coef
        if self.body_table:
            t = interp(self.body_table, self.body_rows(f["tokens"])) + self.predict_lm_head(f.get("sampled", 0.0))
            t += linear_terms(coef, f, TABLE_FEATURES)
        else:
            t = linear_terms(coef, f, FEATURES)
        return max(0.0, t) * self.scale(f.get("tokens", 0.0))

    def body_rows(self, tokens: float) -> float:
        """The rows the model body's GEMMs run at for a step of ``tokens`` tokens (see ``row_buckets``)."""
        return gemm_rows(tokens, self.row_buckets.get("body", ""))

    def predict_lm_head(self, sampled: float) -> float:
        """Seconds of the LM head over ``sampled`` rows: ``lm_table`` at the rows its GEMM runs at."""
        return interp(self.lm_table, gemm_rows(sampled, self.row_buckets.get("lm_head", "")))

    def predict_overhead(self, num_seqs: int) -> float:
        """Seconds of the engine's own work around a step of ``num_seqs`` sequences (0 with no overhead model)."""
        if not self.overhead:
            return 0.0
        return (self.overhead.get("const", 0.0) + self.overhead.get("per_seq", 0.0) * num_seqs) * self.speed_scale

    def predict_features(self, f: dict[str, float]) -> float:
        """Seconds of a whole step with features ``f``: executor plus the engine's overhead."""
        return self.predict_exec(f) + self.predict_overhead(int(f.get("rows", 0) + f.get("prefill_seqs", 0)))

    def predict_step(self, out) -> float:
        """Predicted duration (s) of the executor for the step ``out`` (``SchedulerOutput``; 0 when empty)."""
        return self.predict_exec(shape_features(out.shape)) if out.seqs else 0.0

    def noise(self, seed: int | None) -> "StepNoise | None":
        """A seeded step-noise source of this model's spread (``noise_table`` by the step's tokens, else
        ``noise_cv``; None without a seed or a spread)."""
        return StepNoise(self.noise_cv, seed, self.noise_table) if seed is not None and self.noise_cv > 0 else None

    @classmethod
    def fit(cls, rows: list[tuple[dict[str, float], float]], source: str = "") -> "CostModel":
        """Non-negative least-squares fit of a linear model on measured ``(features, seconds)`` rows: the
        coefficients c >= 0 that minimise sum(((features . c - seconds) / seconds) ** 2) (relative errors, so
        that small steps matter as much as big ones), solved by ``scipy.optimize.nnls`` (Lawson-Hanson active
        set) on columns scaled to a maximum of 1.

        Raises:
            ValueError: fewer rows than features.
        """
        import numpy as np

        if len(rows) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} measured steps to fit, got {len(rows)}")
        x = np.array([[f[k] for k in FEATURES] for f, _ in rows], dtype=float)
        y = np.array([t for _, t in rows], dtype=float)
        sol = relative_nnls(x, y)
        return cls({k: float(c) for k, c in zip(FEATURES, sol)}, source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Read a profile JSON written by ``save``.

        Raises:
            ValueError: the file is missing or not a cost model.
        """
        p = Path(path)
        try:
            d = json.loads(p.read_text())
            coef = {k: float(v) for k, v in d["coef"].items()}
            if d.get("body_table") and "decode_ctx" in coef and "live_ctx" not in coef:
                # a table profile from before live and padding rows were told apart: one KV-read rate for both
                coef["live_ctx"] = coef["padding_ctx"] = coef.pop("decode_ctx")
            return cls(coef=coef, source=d.get("source", str(p)),
                       fit_error=d.get("fit_error", {}), body_table=d.get("body_table", []),
                       lm_table=d.get("lm_table", []), overhead=d.get("overhead", {}),
                       noise_cv=float(d.get("noise_cv", 0.0)), fingerprint=d.get("fingerprint", {}),
                       created=d.get("created", ""), row_buckets=_row_buckets(d.get("row_buckets", {})),
                       probe_baseline=[{"probe": int(b["probe"]), "seconds": float(b["seconds"])}
                                       for b in d.get("probe_baseline", [])],
                       noise_table=[[float(t), float(c)] for t, c in d.get("noise_table", [])])
        except (OSError, KeyError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{p}: not a cost-model profile ({e})") from None


def _row_buckets(value) -> dict[str, str]:
    """A profile's ``row_buckets``, checked (ValueError: not a mapping of known schemes)."""
    if not isinstance(value, dict):
        raise ValueError(f"row_buckets must be a mapping, got {value!r}")
    for scheme in value.values():
        gemm_rows(1.0, scheme)
    return {str(k): str(v) for k, v in value.items()}


def noise_table_of(points: list[tuple[float, float]], min_points: int = 3) -> list[list[float]]:
    """The step-to-step spread by step size: ``points`` are ``(tokens, relative spread)`` of timed steps (a
    profile's grid); they are grouped by power-of-2 bucket of tokens (a bucket of fewer than ``min_points``
    joins the next larger one, the last such the one before it), and each group gives a knot ``[geometric mean
    of its tokens, median of its spreads]``. Returns the knots sorted by tokens (empty without points)."""
    pts = sorted((max(float(t), 1.0), float(c)) for t, c in points)
    groups = [list(g) for _, g in itertools.groupby(pts, key=lambda p: int(math.log2(p[0])))]
    merged: list[list[tuple[float, float]]] = []
    carry: list[tuple[float, float]] = []
    for g in groups:
        carry += g
        if len(carry) >= min_points:
            merged.append(carry)
            carry = []
    if carry:
        if merged:
            merged[-1] += carry
        else:
            merged.append(carry)
    return [[math.exp(sum(math.log(t) for t, _ in g) / len(g)), statistics.median(c for _, c in g)] for g in merged]


class StepNoise:
    """Mean-one lognormal multipliers of relative spread ``cv`` (sigma = sqrt(log(1 + cv^2))), seeded; with a
    ``table`` (``[[tokens, cv], ...]``, sorted, as :func:`noise_table_of`) the spread of a step of ``tokens``
    tokens is the table's, linear in log(tokens) between knots and the end knot's beyond them. One draw per
    call, so a seed gives the same sequence of draws with or without a table."""

    def __init__(self, cv: float, seed: int, table: list[list[float]] | None = None) -> None:
        self.sigma = math.sqrt(math.log1p(cv * cv))
        self.rng = random.Random(seed)
        self.log_tokens = [math.log(max(t, 1.0)) for t, _ in table or []]
        self.cvs = [c for _, c in table or []]
        self._sigmas: dict[int, float] = {}

    def sigma_at(self, tokens: float) -> float:
        """The lognormal sigma of a step of ``tokens`` tokens."""
        if not self.cvs:
            return self.sigma
        key = int(tokens)  # a step's token count; the cache holds one sigma per count
        s = self._sigmas.get(key)
        if s is None:
            x, xs, cs = math.log(max(key, 1)), self.log_tokens, self.cvs
            if x <= xs[0]:
                cv = cs[0]
            elif x >= xs[-1]:
                cv = cs[-1]
            else:
                i = bisect.bisect_right(xs, x)
                a = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
                cv = cs[i - 1] + a * (cs[i] - cs[i - 1])
            s = math.sqrt(math.log1p(cv * cv))
            self._sigmas[key] = s
        return s

    def __call__(self, tokens: float = 0.0) -> float:
        s = self.sigma_at(tokens)
        return math.exp(self.rng.gauss(-0.5 * s * s, s))


def relative_nnls(x, y):
    """``argmin_{c >= 0} sum(((x @ c - y) / y) ** 2)`` (``scipy.optimize.nnls`` on columns scaled to a maximum
    of 1); ``x`` is ``[rows, features]``, ``y`` ``[rows]`` seconds. Returns the coefficients."""
    import numpy as np
    from scipy.optimize import nnls

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    w = 1.0 / np.maximum(y, 1e-6)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    sol, _ = nnls((x / scale) * w[:, None], y * w)
    return sol / scale


def hat_weights(knots: list[float], x: float) -> list[float]:
    """Weights of piecewise-linear interpolation at ``x`` over ``knots`` (sorted): ``B(x) = sum w_k B(k)``;
    ``x`` below the first knot scales the first knot's value (``B(0) = 0``), past the last one extrapolates the
    last segment."""
    w = [0.0] * len(knots)
    if x <= 0 or not knots:
        return w
    if x <= knots[0] or len(knots) == 1:
        w[0] = x / knots[0]
        return w
    import bisect

    i = min(bisect.bisect_left(knots, x), len(knots) - 1)
    lo, hi = knots[i - 1], knots[i]
    a = (x - lo) / (hi - lo)
    w[i - 1], w[i] = 1.0 - a, a
    return w


def interp(table: list[list[float]], x: float) -> float:
    """Piecewise-linear interpolation over ``[[x, y], ...]`` (sorted by x), as :func:`hat_weights`."""
    if not table:
        return 0.0
    w = hat_weights([p[0] for p in table], x)
    return sum(wi * p[1] for wi, p in zip(w, table))
