"""Reads the scalars of a run's TensorBoard event files with TensorBoard's own reader.

A tool for tests and result scripts; the algorithm scripts never import it.

    python cleanba/events.py runs/<run_name>        # prints the last value of every scalar
"""

import argparse
import os
import sys
from typing import NamedTuple

from tensorboard.backend.event_processing import event_accumulator


class Events(NamedTuple):
    scalars: dict[str, list[tuple]]  # {tag: [(step, value, unix time), ...]}
    started: float  # unix time of the run's first event: its TensorBoard writer's start, before compilation


def read_events(run_dir: str) -> Events:
    """The scalars of every event file of the run directory, in the order written. Every point is kept
    (TensorBoard's reader otherwise samples 10,000 per tag). A resumed run's points logged after the checkpoint
    it resumed from are dropped, as TensorBoard shows them: the restart writes a purge marker at its first step
    (tensorboardX's purge_step)."""
    events = event_accumulator.EventAccumulator(run_dir, size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value, e.wall_time) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    try:
        started = events.FirstEventTimestamp()
    except ValueError:  # no event written yet
        started = float("nan")
    return Events(scalars, started)


def read_scalars(run_dir: str, wall_time: bool = False) -> dict[str, list[tuple]]:
    """{tag: [(step, value), ...]}, or with wall_time (step, value, unix time of the point)."""
    return {tag: [p if wall_time else p[:2] for p in points] for tag, points in read_events(run_dir).scalars.items()}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory (runs/<run_name>): its TensorBoard event files")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    if not os.path.isdir(args.run_dir):
        print(f"error: {args.run_dir} is not a directory", file=sys.stderr)
        sys.exit(2)
    for tag, series in sorted(read_scalars(args.run_dir).items()):
        print(f"{tag:40s} {len(series):6d} points, last {series[-1][1]:.6g} at step {series[-1][0]}")


if __name__ == "__main__":
    main()
