"""Near-equilibrium cluster prices for the balanced assignment, from a smoothed dual.

``balanced_assignment`` starts every point at its best net cluster under some prices and then
repairs the sizes one shortest path at a time, so its work grows with the number of points
those prices misplace. From zero prices (or last iteration's, after the centroids moved a lot)
that can be a sizeable fraction of N; from near-equilibrium prices it is a few dozen.

Those prices come from the entropy-smoothed dual of the transportation problem,

    F_tau(p) = tau * sum_i log sum_k exp((s_ik - p_k) / tau) + sum_k c_k p_k,

a smooth convex function of only K variables whose minimiser tends to the LP dual optimum as
tau -> 0 (softmax assignments whose column sums equal the capacities). Newton steps (gradient
c - sum_i softmax_i, Hessian sum_i (diag(pi_i) - pi_i pi_i^T) / tau, both O(N K^2)), damped
Levenberg-Marquardt style inside a trust region and checked by an Armijo line search, converge
in a handful of evaluations per level; tau shrinks geometrically, each level warm-starting the
next. The coarse levels run on a seeded row sample (prices are quantile-like, so a sample of
tens of thousands of rows pins them down), the finest on all rows.

These prices are only a starting point: exactness and the certificate come from the repair.
"""

from __future__ import annotations

import numpy as np

# Smoothing levels as fractions of the score range, coarse to fine.
_TAUS = (3e-2, 3e-3, 3e-4)
# Rows used for all but the finest level.
_SAMPLE_ROWS = 32_768
# Newton steps per level at most, and the tolerance on every cluster's soft mass: a fraction
# of the mean capacity, but never below one point (the repair fixes the last few exactly).
_MAX_STEPS = 20
_GRAD_TOL = 1e-3
_GRAD_TOL_POINTS = 1.0
# Initial trust radius of the Newton steps, in tau.
_TRUST = 8.0
# Rows per block when evaluating (bounds the float32 temporaries).
_BLOCK = 65_536


def smoothed_dual_prices(
    scores: np.ndarray,
    capacities: np.ndarray,
    prices: np.ndarray | None = None,
    seed: int = 0,
) -> tuple[np.ndarray, float]:
    """Prices approximately minimising the assignment dual; returns ``(prices, finest tau)``.

    ``capacities`` may be fractional (e.g. N/K each when the solver picks which clusters get
    the extra point).
    """
    n, k = scores.shape
    caps = np.asarray(capacities, dtype=np.float64)
    span = float(scores.max() - scores.min()) or 1.0
    p = np.zeros(k) if prices is None else np.asarray(prices, np.float64).copy()
    p = np.maximum(p - p.max(), -span)
    if n > 2 * _SAMPLE_ROWS:
        rows = np.sort(np.random.default_rng(seed).choice(n, _SAMPLE_ROWS, replace=False))
        sample, sample_caps = scores[rows], caps * (_SAMPLE_ROWS / n)
    else:
        sample, sample_caps = scores, caps
    for level, frac in enumerate(_TAUS):
        final = level == len(_TAUS) - 1
        data, data_caps = (scores, caps) if final else (sample, sample_caps)
        p = _newton(data, data_caps, p, frac * span, span)
    p -= p.max()
    return np.maximum(p, -span), _TAUS[-1] * span


def _newton(s: np.ndarray, caps: np.ndarray, p: np.ndarray, tau: float, span: float) -> np.ndarray:
    tol = max(_GRAD_TOL * float(caps.mean()), _GRAD_TOL_POINTS * len(s) / caps.sum())
    value, mass, gram = _evaluate(s, caps, p, tau)
    radius = _TRUST * tau
    for _ in range(_MAX_STEPS):
        grad = caps - mass
        if np.abs(grad).max() <= tol:
            break
        # sum_i (diag(pi_i) - pi_i pi_i^T) written as a graph Laplacian of the co-assignment
        # matrix (rows of pi sum to one): positive semi-definite whatever the rounding.
        hess = (np.diag(gram.sum(axis=1)) - gram) / tau
        step, clipped = _trust_step(hess, grad, radius)
        t = 1.0
        while True:
            new_value, new_mass, new_gram = _evaluate(s, caps, p + t * step, tau)
            if new_value <= value + 1e-4 * t * float(grad @ step):
                break
            t *= 0.5
            if t < 1e-3:
                return p  # no progress left at this tau; the exact repair takes it from here
        # Trust region, starting at a few tau: F_tau is close to piecewise linear beyond that
        # scale, so long Newton steps overshoot. It grows while clipped steps are accepted
        # whole and shrinks when they are not.
        if t == 1.0 and clipped:
            radius = min(2 * radius, span)
        elif t < 1.0:
            radius = max(t * radius, tau)
        p = p + t * step
        value, mass, gram = new_value, new_mass, new_gram
    return p


def _trust_step(hess: np.ndarray, grad: np.ndarray, radius: float) -> tuple[np.ndarray, bool]:
    """Levenberg-Marquardt step -(H + lam I)^-1 g with max |step| <= radius.

    H is singular along p + t*1 (the dual ignores a common shift) and nearly so for a cluster
    nobody wants; the gauge term pins the first, the damping lam the second. Any lam > 0 keeps
    the step a descent direction.
    """
    k = len(grad)
    scale = max(float(np.trace(hess)) / k, 1e-12)
    base = hess + scale * np.ones((k, k)) / k
    lam = 1e-9 * scale
    for attempt in range(64):
        step = -np.linalg.solve(base + lam * np.eye(k), grad)
        length = float(np.abs(step).max())
        if length <= radius:
            return step, attempt > 0  # damped: the radius was binding
        lam *= 4.0
    return step * (radius / length), True


def _evaluate(
    s: np.ndarray, caps: np.ndarray, p: np.ndarray, tau: float
) -> tuple[float, np.ndarray, np.ndarray]:
    """F_tau(p), the softmax column sums, and sum_i pi_i pi_i^T."""
    k = s.shape[1]
    value = float(caps @ p)
    mass = np.zeros(k)
    gram = np.zeros((k, k))
    for a in range(0, len(s), _BLOCK):
        # Net values and their row maxima in float64: near the optimum the line search
        # compares values of F that differ by ~1e-5, less than float32 rounding of s/tau
        # summed over 1e5 rows. Only the exponentials (of numbers <= 0) are float32.
        net = s[a : a + _BLOCK] - p
        top = net.max(axis=1)
        z = ((net - top[:, None]) / tau).astype(np.float32)
        np.exp(z, out=z)
        total = z.sum(axis=1, keepdims=True)
        value += float(top.sum()) + tau * float(np.log(total).sum(dtype=np.float64))
        z /= total
        mass += z.sum(axis=0, dtype=np.float64)
        pi = z.astype(np.float64)
        gram += pi.T @ pi
    return value, mass, gram
