"""Statistics for gate checks: paired bootstrap CIs, ratio bootstrap CIs, exact McNemar.

All bootstraps are percentile bootstraps with a fixed RNG seed, so a stored run re-evaluates to the
same interval. They need at least two paired observations; callers treat fewer as "too thin".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from scipy import stats as sps

DEFAULT_RESAMPLES = 5000
BOOT_SEED = 20240607


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    confidence: float
    n: int

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "confidence": self.confidence,
                "n": self.n}


def _percentiles(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(samples, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float],
                        statistic: Callable[[np.ndarray, np.ndarray], float] | None = None,
                        confidence: float = 0.95, resamples: int = DEFAULT_RESAMPLES,
                        seed: int = BOOT_SEED) -> Interval:
    """CI of statistic(a, b) (default: mean(b - a)) resampling the pairs (a_i, b_i) together."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired samples must be 1-D and the same length, got {x.shape} and {y.shape}")
    if len(x) < 2:
        raise ValueError("a bootstrap needs at least 2 pairs")
    stat = statistic or (lambda u, v: float(np.mean(v - u)))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(resamples, len(x)))
    boots = np.array([stat(x[i], y[i]) for i in idx])
    lo, hi = _percentiles(boots, confidence)
    return Interval(float(stat(x, y)), lo, hi, confidence, len(x))


def ratio_bootstrap_ci(numerators: Sequence[float], denominators: Sequence[float], confidence: float = 0.95,
                       resamples: int = DEFAULT_RESAMPLES, seed: int = BOOT_SEED) -> Interval:
    """CI of sum(num)/sum(den) over paired observations (e.g. candidate vs bracketing baseline tok/s)."""
    num, den = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    if num.shape != den.shape or len(num) < 2:
        raise ValueError("ratio bootstrap needs >= 2 paired (numerator, denominator) observations")
    if np.any(den <= 0):
        raise ValueError("ratio bootstrap: denominators must be positive")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(resamples, len(num)))
    boots = num[idx].sum(axis=1) / den[idx].sum(axis=1)
    lo, hi = _percentiles(boots, confidence)
    return Interval(float(num.sum() / den.sum()), lo, hi, confidence, len(num))


@dataclass(frozen=True)
class McNemar:
    baseline_only: int  # pairs where only the baseline passed
    candidate_only: int  # pairs where only the candidate passed
    p_value: float  # two-sided exact binomial test on the discordant pairs

    def as_dict(self) -> dict:
        return {"baseline_only": self.baseline_only, "candidate_only": self.candidate_only, "p_value": self.p_value}


def mcnemar_exact(baseline: Sequence[bool], candidate: Sequence[bool]) -> McNemar:
    if len(baseline) != len(candidate):
        raise ValueError("McNemar needs paired outcomes of equal length")
    b = sum(1 for x, y in zip(baseline, candidate) if x and not y)
    c = sum(1 for x, y in zip(baseline, candidate) if y and not x)
    p = 1.0 if b + c == 0 else float(sps.binomtest(b, b + c, 0.5, alternative="two-sided").pvalue)
    return McNemar(b, c, p)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    z = float(sps.norm.ppf(1 - (1 - confidence) / 2))
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return float(max(0.0, center - half)), float(min(1.0, center + half))


def bootstrap_ci(n: int, statistic: Callable[[np.ndarray], float], confidence: float = 0.95,
                 resamples: int = DEFAULT_RESAMPLES, seed: int = BOOT_SEED) -> Interval:
    """CI of statistic(indices) resampling n paired observations by index (for statistics that need
    several aligned arrays, e.g. per-segment NLL of both arms plus token counts)."""
    if n < 2:
        raise ValueError("a bootstrap needs at least 2 observations")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    boots = np.array([statistic(i) for i in idx])
    lo, hi = _percentiles(boots, confidence)
    return Interval(float(statistic(np.arange(n))), lo, hi, confidence, n)
