"""Q(lambda) returns of cleanba_pqn.py on test_gae.py's hand-made unroll (a termination, a truncation, EnvPool's reset
steps), against the definition (Peng & Williams, 1996; Gallici et al., 2024): the lambda-weighted mix of the n-step
returns that bootstrap from max_a Q, each written out as a sum within its episode."""

import numpy as np
import pytest
from helpers import load_script
from test_gae import DONES, GAMMA, REWARDS, TERMINATIONS, VALUES

pqn = load_script("pqn")
# The last step of the segment each step's return may look into: the termination at t=2, the truncation at t=4, the
# unroll's end at t=6. A reset step (t=3, t=5) belongs to the segment after it and is left out of the loss.
LAST = [2, 2, 2, 4, 4, 6, 6]


def n_step_return(t: int, n: int, last: int) -> float:
    """r_t + ... + gamma^(n-1) r_(t+n-1) + gamma^n max_a Q(x_(t+n)), cut at `last`: past a termination nothing is
    bootstrapped, past a truncation or the unroll's end the value of the observation after `last`."""
    n = min(n, last - t + 1)
    bootstrap = VALUES[t + n] * (1 - TERMINATIONS[t + n - 1])
    return sum(GAMMA**k * REWARDS[t + k] for k in range(n)) + GAMMA**n * bootstrap


@pytest.mark.parametrize("q_lambda", [0.0, 0.65, 1.0])
def test_q_lambda_returns_mix_n_step_returns_within_each_episode(q_lambda):
    args = pqn.Args(gamma=GAMMA, q_lambda=q_lambda)
    targets = np.asarray(pqn.q_lambda_returns(args, REWARDS, VALUES, TERMINATIONS, DONES))
    for t, last in enumerate(LAST):
        steps = last - t + 1  # the longest n-step return takes all the remaining weight
        mixed = sum((1 - q_lambda) * q_lambda ** (n - 1) * n_step_return(t, n, last) for n in range(1, steps))
        mixed += q_lambda ** (steps - 1) * n_step_return(t, steps, last)
        assert targets[t] == pytest.approx(mixed, rel=1e-6), t
    # lambda = 0 is one-step Q-learning; at a termination the target is the reward alone, whatever lambda.
    if q_lambda == 0.0:
        np.testing.assert_allclose(targets, REWARDS + GAMMA * VALUES[1:] * (1 - TERMINATIONS), rtol=1e-6)
    assert targets[2] == pytest.approx(REWARDS[2])
    assert targets[4] == pytest.approx(REWARDS[4] + GAMMA * VALUES[5])  # truncated: the final observation's value
