"""Catch, a Gymnasium environment to copy when you bring your own (after DeepMind's bsuite game).

A ball falls from the top row of a 10 x 5 board, one row a step, from a random column; the agent moves a paddle along
the bottom row (0: left, 1: stay, 2: right). Each ball that reaches the bottom gives +1 if the paddle is under it, else
-1, and the next ball starts at the top: an episode is 10 balls (90 steps), so its return lies in [-10, 10] and a
random policy's is about -6.

Train it (the module is imported from the working directory, the id after the colon is registered below):

    .venv/bin/python cleanba/cleanba_ppo.py --env-id examples.catch:Catch-v0 \
        --local-num-envs 8 --num-actor-threads 1 --num-steps 32 --total-timesteps 100000

`Catch-v0` observes the board as a vector of 50 numbers (the MLP torso); `CatchPixels-v0` as an RGB image of
height x width x channels, uint8 (the ResNet torso). Both render with render_mode="rgb_array" for videos.
"""

import gymnasium
import numpy as np

ROWS = 10
COLUMNS = 5
BALLS = 10  # per episode
SCALE = 16  # pixels per cell in render()'s frames


class Catch(gymnasium.Env):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 15}

    def __init__(self, pixels: bool = False, render_mode: str | None = None):
        self.pixels = pixels
        self.render_mode = render_mode
        self.action_space = gymnasium.spaces.Discrete(3)
        if pixels:
            self.observation_space = gymnasium.spaces.Box(0, 255, (ROWS, COLUMNS, 3), np.uint8)
        else:
            self.observation_space = gymnasium.spaces.Box(0.0, 1.0, (ROWS * COLUMNS,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)  # seeds self.np_random: the same seed, the same balls
        self.paddle = COLUMNS // 2
        self.balls_left = BALLS
        self.drop_ball()
        return self.observation(), {}

    def step(self, action):
        self.paddle = int(np.clip(self.paddle + int(action) - 1, 0, COLUMNS - 1))
        self.ball_row += 1
        reward = 0.0
        if self.ball_row == ROWS - 1:  # the ball reached the paddle's row
            reward = 1.0 if self.ball_column == self.paddle else -1.0
            self.balls_left -= 1
            self.drop_ball()
        terminated = self.balls_left == 0
        return self.observation(), reward, terminated, False, {}

    def drop_ball(self):
        self.ball_row = 0
        self.ball_column = int(self.np_random.integers(COLUMNS))

    def board(self) -> np.ndarray:  # 1 where the ball and the paddle are
        board = np.zeros((ROWS, COLUMNS), np.float32)
        board[self.ball_row, self.ball_column] = 1.0
        board[ROWS - 1, self.paddle] = 1.0
        return board

    def observation(self) -> np.ndarray:
        if self.pixels:
            return (np.stack([self.board()] * 3, axis=-1) * 255).astype(np.uint8)
        return self.board().reshape(-1)

    def render(self) -> np.ndarray:  # the board in white on black, each cell SCALE x SCALE pixels
        frame = (self.board() * 255).astype(np.uint8).repeat(SCALE, axis=0).repeat(SCALE, axis=1)
        return np.stack([frame] * 3, axis=-1)


gymnasium.register("Catch-v0", entry_point=Catch)
gymnasium.register("CatchPixels-v0", entry_point=Catch, kwargs=dict(pixels=True))
