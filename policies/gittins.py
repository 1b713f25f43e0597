"""The Gittins index of a job whose remaining cost follows a discrete distribution.

For support s₁ < … < sₙ (costs), probabilities pᵢ and attained cost a, the index is the best
ratio, over horizons sⱼ > a, of the chance to finish within the horizon to the expected cost
spent reaching it:

    G(a) = max_{j: sⱼ > a}  Σ_{a<sᵢ≤sⱼ} pᵢ  /  Σ_{sᵢ>a} pᵢ·(min(sᵢ, sⱼ) − a)

(Gittins; see REFERENCE.md §1). Serving the highest index first minimises mean completion
time for a single server under this belief. One point gives 1/(s − a), i.e. SRPT order.
Every candidate horizon is evaluated at once with prefix sums, so a call is O(n).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from policies.dist import FloatArray


def gittins_index(support: ArrayLike, probs: ArrayLike, attained: float) -> float:
    """Gittins index at attained cost `attained` (higher is served first).

    `support` must be increasing costs and `probs` their probabilities (summing to 1; only
    ratios matter). Returns 0.0 when no support point lies above `attained`: the belief says
    the job should have finished, so it has no chance left to finish "soon" (callers that want
    a different overrun rule condition the distribution first, see `LengthDist.condition`).
    """
    return gittins_index_and_horizon(support, probs, attained)[0]


def gittins_index_and_horizon(
    support: ArrayLike, probs: ArrayLike, attained: float
) -> tuple[float, float | None]:
    """The index and the horizon sⱼ that attains it (None when the index is 0)."""
    s = np.asarray(support, dtype=np.float64)
    p = np.asarray(probs, dtype=np.float64)
    a = float(attained)
    if a < s[0]:  # the common case: nothing spent yet, every point is a candidate
        s_k: FloatArray = s
        p_k: FloatArray = p
    else:
        k = int(np.searchsorted(s, a, side="right"))  # first support point strictly above a
        if k >= s.size:
            return 0.0, None
        s_k, p_k = s[k:], p[k:]
    left = s_k - a
    finished = np.cumsum(p_k)  # Σ_{a<sᵢ≤sⱼ} pᵢ
    spent_by_finishers = np.cumsum(p_k * left)  # Σ_{a<sᵢ≤sⱼ} pᵢ (sᵢ − a)
    # Σ_{sᵢ>sⱼ} pᵢ as a reversed cumulative sum: exact for tiny tails, no cancellation.
    survivors = np.empty_like(p_k)
    survivors[:-1] = np.cumsum(p_k[:0:-1])[::-1]
    survivors[-1] = 0.0
    ratio = finished / (spent_by_finishers + left * survivors)
    j = int(np.argmax(ratio))
    return float(ratio[j]), float(s_k[j])
