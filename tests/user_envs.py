"""Gymnasium environments of a user's own module, for tests/test_gymnasium.py: the tests copy this file into a run's
working directory and train `--env-id user_envs:<Id>`, as a user does with theirs."""

import gymnasium
import numpy as np

SIZE = 6


class Seeker(gymnasium.Env):
    """A dot on a SIZE x SIZE image (height, width, channels: uint8) and the agent's position as a vector, in a Dict:
    the agent moves (0-3: up, down, left, right) and gets +1 on the dot, which then moves; 50 steps an episode,
    cut by a time limit (truncated, not terminated)."""

    observation_space = gymnasium.spaces.Dict(
        image=gymnasium.spaces.Box(0, 255, (SIZE, SIZE, 3), np.uint8),
        position=gymnasium.spaces.Box(0.0, 1.0, (2,), np.float32),
    )
    action_space = gymnasium.spaces.Discrete(4)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.agent = self.np_random.integers(SIZE, size=2)
        self.dot = self.np_random.integers(SIZE, size=2)
        self.steps = 0
        return self.observation(), {}

    def step(self, action):
        move = [(-1, 0), (1, 0), (0, -1), (0, 1)][int(action)]
        self.agent = np.clip(self.agent + move, 0, SIZE - 1)
        reward = float(np.array_equal(self.agent, self.dot))
        if reward:
            self.dot = self.np_random.integers(SIZE, size=2)
        self.steps += 1
        return self.observation(), reward, False, self.steps == 50, {}

    def observation(self):
        image = np.zeros((SIZE, SIZE, 3), np.uint8)
        image[self.dot[0], self.dot[1]] = 255
        return dict(image=image, position=(self.agent / (SIZE - 1)).astype(np.float32))


class FailsOnReset(Seeker):
    def reset(self, *, seed=None, options=None):
        raise ValueError("the simulator's licence server is unreachable")


class FailsOnStep(Seeker):
    def step(self, action):  # after 20 steps of this env
        if getattr(self, "total_steps", 0) == 20:
            raise RuntimeError("the simulator lost its connection\nsecond line of its message")
        self.total_steps = getattr(self, "total_steps", 0) + 1
        return super().step(action)


class TupleObservations(Seeker):
    observation_space = gymnasium.spaces.Tuple([gymnasium.spaces.Discrete(3), gymnasium.spaces.Discrete(3)])


class MultiDiscreteActions(Seeker):
    action_space = gymnasium.spaces.MultiDiscrete([2, 2])


gymnasium.register("Seeker-v0", entry_point=Seeker)
gymnasium.register("FailsOnReset-v0", entry_point=FailsOnReset)
gymnasium.register("FailsOnStep-v0", entry_point=FailsOnStep)
gymnasium.register("TupleObservations-v0", entry_point=TupleObservations)
gymnasium.register("MultiDiscreteActions-v0", entry_point=MultiDiscreteActions)
