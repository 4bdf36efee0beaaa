"""Step-time cost model for the simulator: predicts a step's duration from its batch (no torch).

A step's time is modelled as a linear function of what it computes (non-negative least squares on
measured steps)::

    t = c0 + c_tok * tokens + c_ctx * decode_context_tokens + c_pf_attn * prefill_attention_pairs
          + c_lm * sampled_rows

``tokens`` = prefill + decode tokens (every GEMM row; static padding rows included), ``decode_context_
tokens`` = sum of the context lengths the decode rows attend to (KV bytes read; a static padding row is a
decode row at its batch's current length, as in a padded batch), ``prefill_attention_pairs`` = sum over
prefill chunks of n * (start + n) (query-key pairs, causal work up to a factor 2), ``sampled_rows`` = rows
that go through the LM head (never a padding row). ``c0`` is the per-step fixed cost (weights read
once, Python overhead). The same features are what Vidur's execution-time predictor uses for attention
and MLP operators, folded into one model here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FEATURES = ("const", "tokens", "decode_ctx", "prefill_attn", "sampled")


def step_features(seqs) -> dict[str, float]:
    """Features of one step from its scheduled sequences (``ScheduledSeq``).

    A static padding row counts as a decode row (``is_decode``): one token, its context length (the batch's
    current length) in ``decode_ctx``, not sampled. ``prefill_ctx`` = sum over prefill chunks of n * start
    (query x cached-key pairs: what a chunk after the first, or a chunk after a prefix-cache hit, attends
    to beyond its own tokens)."""
    tokens = decode_ctx = prefill_attn = prefill_ctx = sampled = 0
    for s in seqs:
        n = s.num_tokens
        tokens += n
        if s.is_decode:
            decode_ctx += s.start_pos + 1
        else:
            prefill_attn += n * (s.start_pos + n)
            prefill_ctx += n * s.start_pos
        if s.sample and not s.is_padding:
            sampled += 1
    return {"const": 1.0, "tokens": tokens, "decode_ctx": decode_ctx, "prefill_attn": prefill_attn,
            "prefill_ctx": prefill_ctx, "sampled": sampled}


@dataclass
class CostModel:
    """Coefficients in seconds per unit of each feature.

    Attributes:
        coef: feature name -> seconds per unit (``const`` in seconds per step).
        source: where the coefficients came from (profile file, machine).
        fit_error: held-out error figures from ``workbench profile`` (mean/max relative error).
    """

    coef: dict[str, float]
    source: str = ""
    fit_error: dict[str, float] = field(default_factory=dict)
    body_table: list[list[float]] = field(default_factory=list)
    lm_table: list[list[float]] = field(default_factory=list)

    def predict_features(self, f: dict[str, float]) -> float:
        """Seconds for a step with features ``f``. With measured tables, the model body's time is
        interpolated over the step's token count (CPU GEMM time is far from linear at small batch
        sizes; the table's prefill chunks include their own causal attention) and the LM head's over
        sampled rows; the linear terms then add attention over cached context: decode rows'
        (``decode_ctx``) and prefill chunks' that start after cached tokens (``prefill_ctx``)."""
        if self.body_table:
            t = _interp(self.body_table, f["tokens"]) + _interp(self.lm_table, f["sampled"])
            return max(0.0, t + sum(self.coef.get(k, 0.0) * f.get(k, 0.0) for k in ("decode_ctx", "prefill_ctx")))
        return max(0.0, sum(self.coef.get(k, 0.0) * f[k] for k in FEATURES))

    def predict(self, seqs) -> float:
        """Predicted duration (s) of a step that runs ``seqs``."""
        return self.predict_features(step_features(seqs)) if seqs else 0.0

    @classmethod
    def fit(cls, rows: list[tuple[dict[str, float], float]], source: str = "") -> "CostModel":
        """Non-negative least-squares fit of measured ``(features, seconds)`` rows: the coefficients c >= 0
        that minimise sum(((features . c - seconds) / seconds) ** 2) (relative errors, so that small steps
        matter as much as big ones), solved by ``scipy.optimize.nnls`` (Lawson-Hanson active set) on
        columns scaled to a maximum of 1.

        Raises:
            ValueError: fewer rows than features.
        """
        import numpy as np
        from scipy.optimize import nnls

        if len(rows) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} measured steps to fit, got {len(rows)}")
        x = np.array([[f[k] for k in FEATURES] for f, _ in rows], dtype=float)
        y = np.array([t for _, t in rows], dtype=float)
        w = 1.0 / np.maximum(y, 1e-6)
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        sol, _ = nnls((x / scale) * w[:, None], y * w)
        return cls({k: float(c / s) for k, c, s in zip(FEATURES, sol, scale)}, source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Read a profile JSON written by ``save``.

        Raises:
            ValueError: the file is missing or not a cost model.
        """
        p = Path(path)
        try:
            d = json.loads(p.read_text())
            return cls(coef={k: float(v) for k, v in d["coef"].items()}, source=d.get("source", str(p)),
                       fit_error=d.get("fit_error", {}), body_table=d.get("body_table", []),
                       lm_table=d.get("lm_table", []))
        except (OSError, KeyError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{p}: not a cost-model profile ({e})") from None


def _interp(table: list[list[float]], x: float) -> float:
    """Piecewise-linear interpolation over ``[[x, y], ...]`` (sorted by x); linear extrapolation past
    the last point, 0 for x <= 0."""
    if x <= 0 or not table:
        return 0.0
    import bisect

    xs = [p[0] for p in table]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return table[i][1]
    if i == 0:
        return table[0][1] * x / xs[0]
    if i == len(xs):
        (x0, y0), (x1, y1) = table[-2] if len(table) > 1 else (0, 0), table[-1]
    else:
        (x0, y0), (x1, y1) = table[i - 1], table[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
