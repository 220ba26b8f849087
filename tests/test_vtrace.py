"""V-trace targets of cleanba_impala.py on hand-made unrolls with a termination, a truncation and
EnvPool's reset steps, against the definition in Espeholt et al. (2018), eq. (1), written as an
explicit sum (not the script's backward recursion)."""

import numpy as np
import pytest
from helpers import load_script

impala = load_script("impala")

GAMMA = 0.9
# t:            0    1    2 (terminated)  3 (reset step)  4 (truncated)  5 (reset step)
VALUES = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])  # V(x_0) .. V(x_6); x_5 is step 4's final observation
REWARDS = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
TERMINATIONS = np.array([0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
VALID = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])  # a reset step's action is ignored: not a transition


def reference_vtrace(rhos, lambda_=1.0, rho_bar=1.0, c_bar=1.0, pg_rho_bar=1.0):
    """vs_t = V(x_t) + sum_{k>=t} (prod_{i=t}^{k-1} gamma_i c_i) delta_k, with c_i = lambda min(1, rho_i)
    and delta_k = min(rho_bar, rho_k) (r_k + gamma_k V(x_{k+1}) - V(x_k)); invalid steps contribute nothing."""
    T = len(REWARDS)
    discounts = GAMMA * (1 - TERMINATIONS)
    rhos = rhos * VALID
    deltas = np.minimum(rho_bar, rhos) * (REWARDS + discounts * VALUES[1:] - VALUES[:-1])
    cs = lambda_ * np.minimum(c_bar, rhos)
    vs = np.zeros(T)
    for t in range(T):
        total, weight = 0.0, 1.0
        for k in range(t, T):
            total += weight * deltas[k]
            weight *= discounts[k] * cs[k]
        vs[t] = VALUES[t] + total
    # The Q estimate bootstraps from lambda * vs_{t+1} + (1 - lambda) V(x_{t+1}), the paper's
    # r_t + gamma vs_{t+1} at the default lambda = 1.
    vs_next = np.append(lambda_ * vs[1:] + (1 - lambda_) * VALUES[1:T], VALUES[T])
    pg_advantages = np.minimum(pg_rho_bar, rhos) * (REWARDS + discounts * vs_next - VALUES[:-1])
    return vs, pg_advantages


def targets(rhos, **overrides):
    args = impala.Args(gamma=GAMMA, **overrides)
    errors, pg_advantages = impala.vtrace_targets(
        args, VALUES, REWARDS, TERMINATIONS, VALID, np.asarray(rhos, np.float32)
    )
    return np.asarray(errors) + VALUES[:-1], np.asarray(pg_advantages)


def test_on_policy_targets_by_hand():
    vs, pg_advantages = targets(np.ones(6))
    # Terminated at t=2: no bootstrap. t=0,1 accumulate rewards up to it and no further.
    assert vs[2] == pytest.approx(1.0)
    assert vs[1] == pytest.approx(1.0 + GAMMA * 1.0)
    assert vs[0] == pytest.approx(1.0 + GAMMA * 1.9)
    # Truncated at t=4: bootstraps from the value of its final observation x_5, not across the reset.
    assert vs[4] == pytest.approx(1.0 + GAMMA * VALUES[5])
    # Reset steps carry no TD error: their target is their value, and nothing flows through them.
    assert vs[3] == pytest.approx(VALUES[3]) and vs[5] == pytest.approx(VALUES[5])
    assert pg_advantages[[3, 5]] == pytest.approx([0.0, 0.0])
    assert pg_advantages[4] == pytest.approx(1.0 + GAMMA * VALUES[5] - VALUES[4])
    assert pg_advantages[2] == pytest.approx(1.0 - VALUES[2])


@pytest.mark.parametrize("rhos", [[2.0, 0.5, 1.0, 3.0, 0.25, 1.0], [0.1, 1.5, 0.7, 1.0, 4.0, 0.0]])
@pytest.mark.parametrize(
    "overrides", [{}, dict(vtrace_lambda=0.8), dict(clip_rho_threshold=2.0, clip_pg_rho_threshold=0.5)]
)
def test_off_policy_targets_match_the_definition(rhos, overrides):
    vs, pg_advantages = targets(rhos, **overrides)
    expected_vs, expected_pg = reference_vtrace(
        np.asarray(rhos),
        lambda_=overrides.get("vtrace_lambda", 1.0),
        rho_bar=overrides.get("clip_rho_threshold", 1.0),
        pg_rho_bar=overrides.get("clip_pg_rho_threshold", 1.0),
    )
    np.testing.assert_allclose(vs, expected_vs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pg_advantages, expected_pg, rtol=1e-6, atol=1e-6)
