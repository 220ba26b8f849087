"""GAE of cleanba_ppo.py on a hand-made unroll with a termination, a truncation and EnvPool's reset
steps, against the definition (Schulman et al., 2016) written as an explicit sum over each episode."""

import numpy as np
import pytest
from helpers import load_script

ppo = load_script("ppo")

GAMMA, LAMBDA = 0.9, 0.8
# t:            0    1    2 (terminated)  3 (reset step)  4 (truncated)  5 (reset step)  6
VALUES = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])  # V(x_0) .. V(x_7); x_5 is step 4's final observation
REWARDS = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
TERMINATIONS = np.array([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
DONES = np.array([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # terminated or truncated


def test_gae_stops_at_episode_ends_and_bootstraps_truncation():
    args = ppo.Args(gamma=GAMMA, gae_lambda=LAMBDA)
    advantages, returns = map(np.asarray, ppo.gae(args, REWARDS, VALUES, TERMINATIONS, DONES))

    def delta(t):
        return REWARDS[t] + GAMMA * VALUES[t + 1] * (1 - TERMINATIONS[t]) - VALUES[t]

    def explicit(t, last):  # sum_{k=t}^{last} (gamma lambda)^(k-t) delta_k, within one episode
        return sum((GAMMA * LAMBDA) ** (k - t) * delta(k) for k in range(t, last + 1))

    assert advantages[2] == pytest.approx(1.0 - 3.0)  # terminated: no bootstrap
    assert advantages[0] == pytest.approx(explicit(0, 2)) and advantages[1] == pytest.approx(explicit(1, 2))
    assert advantages[4] == pytest.approx(1.0 + GAMMA * VALUES[5] - VALUES[4])  # truncated: bootstraps from x_5
    # The unroll's last step bootstraps from the value after it; the reset step at t=5 only sees the
    # episode that starts after it, never the one that ended at t=4.
    assert advantages[6] == pytest.approx(delta(6))
    assert advantages[5] == pytest.approx(explicit(5, 6))
    np.testing.assert_allclose(returns, advantages + VALUES[:-1], rtol=1e-6)
