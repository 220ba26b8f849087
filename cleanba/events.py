"""Reads the scalars of a run's TensorBoard event files with TensorBoard's own reader.

A tool for tests and result scripts; the algorithm scripts never import it.

    python cleanba/events.py runs/<run_name>        # prints the last value of every scalar
"""

import os
import sys

from tensorboard.backend.event_processing import event_accumulator


def read_scalars(run_dir: str, wall_time: bool = False) -> dict[str, list[tuple]]:
    """{tag: [(step, value), ...]} over every event file of the run directory, in the order written; with
    wall_time, (step, value, unix time of the point). Every point is kept (TensorBoard's reader otherwise samples
    10,000 per tag). A resumed run's points logged after the checkpoint it resumed from are dropped, as
    TensorBoard shows them: the restart writes a purge marker at its first step (tensorboardX's purge_step)."""
    events = event_accumulator.EventAccumulator(run_dir, size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    point = (lambda e: (e.step, e.value, e.wall_time)) if wall_time else (lambda e: (e.step, e.value))
    return {tag: [point(e) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        print("usage: python cleanba/events.py RUN_DIR", file=sys.stderr)
        sys.exit(2)
    for tag, series in sorted(read_scalars(sys.argv[1]).items()):
        print(f"{tag:40s} {len(series):6d} points, last {series[-1][1]:.6g} at step {series[-1][0]}")
