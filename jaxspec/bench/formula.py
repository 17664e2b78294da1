"""The speculative-decoding speedup model, as plain numpy-free functions (notebooks import these).

    E(α, γ) = (1 − α^(γ+1)) / (1 − α)          expected tokens per target forward (Leviathan et al.)
    speedup ≈ E(α, γ) / r(γ)                    r(γ): cost of one speculative step over one plain step

With a free verify and a draft step costing c target steps, r(γ) = 1 + γ·c (the textbook form). On a
CPU a verify over γ+1 positions costs more than a plain step, so the bench measures r(γ) directly
(speculative decode time per step / plain decode time per step) and fits r(γ) ≈ r0 + r1·γ.

α used by the bench: `alpha_from_accepted_length`, the per-token acceptance that makes
E(α, γ) equal the measured mean accepted length (tokens per target forward, bonus included). The
raw per-token ratio (accepted / drafted, `acceptance_rate`) is reported next to it; they differ when
drafters propose fewer than γ tokens (n-gram without a match) or acceptance is not i.i.d.
"""

from __future__ import annotations

from collections.abc import Sequence


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E = (1 − α^(γ+1)) / (1 − α): tokens emitted per target forward, bonus token included."""
    if gamma < 0:
        raise ValueError(f"gamma={gamma} must be >= 0")
    alpha = min(max(float(alpha), 0.0), 1.0)
    if alpha >= 1.0 - 1e-12:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, c: float = 0.0, step_cost: float | None = None) -> float:
    """E(α, γ) / (1 + γ·c), or E(α, γ) / step_cost when the per-step cost ratio was measured."""
    cost = step_cost if step_cost is not None else 1.0 + gamma * c
    return expected_tokens_per_step(alpha, gamma) / cost


def alpha_from_accepted_length(mean_accepted_length: float, gamma: int) -> float:
    """Invert E(α, γ) = L for α in [0, 1] (bisection; E is increasing in α)."""
    if gamma < 1:
        return 0.0
    target = min(max(float(mean_accepted_length), 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, gamma) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_step_cost(gammas: Sequence[int], ratios: Sequence[float]) -> tuple[float, float]:
    """Least-squares r(γ) ≈ r0 + r1·γ through measured (γ, step-cost ratio) points.

    One point: r0 = 1 (a plain step) and the slope through it. No point: (1, 0).
    """
    pts = [(float(g), float(r)) for g, r in zip(gammas, ratios) if r and r > 0]
    if not pts:
        return 1.0, 0.0
    if len(pts) == 1:
        g, r = pts[0]
        return 1.0, (r - 1.0) / g if g else 0.0
    n = len(pts)
    mg = sum(g for g, _ in pts) / n
    mr = sum(r for _, r in pts) / n
    var = sum((g - mg) ** 2 for g, _ in pts)
    if var == 0:
        return mr, 0.0
    slope = sum((g - mg) * (r - mr) for g, r in pts) / var
    return mr - slope * mg, slope


def speedup_curve(
    alpha: float, gammas: Sequence[int], r0: float = 1.0, r1: float = 0.0
) -> list[float]:
    """Predicted speedup for each γ with the step cost r(γ) = r0 + r1·γ."""
    return [speedup(alpha, g, step_cost=max(r0 + r1 * g, 1e-9)) for g in gammas]


def optimal_gamma(alpha: float, r0: float = 1.0, r1: float = 0.0, max_gamma: int = 16) -> int:
    """The γ in 1..max_gamma with the highest predicted speedup."""
    curve = speedup_curve(alpha, range(1, max_gamma + 1), r0, r1)
    return 1 + max(range(len(curve)), key=curve.__getitem__)
