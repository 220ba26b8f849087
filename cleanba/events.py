"""Reads the scalars of a run's TensorBoard event files, without TensorFlow or TensorBoard.

Event files are TFRecord files: each record is a little-endian uint64 length, a uint32 masked CRC of the
length, the serialised `Event` protobuf, and a uint32 masked CRC of the data. tensorboardX ships the
protobuf classes. A tool for tests and result scripts; the algorithm scripts never import it.

    python cleanba/events.py runs/<run_name>        # prints the last value of every scalar
"""

import glob
import os
import struct
import sys

from tensorboardX.proto import event_pb2


def iter_events(path: str):
    with open(path, "rb") as f:
        while header := f.read(12):
            if len(header) < 12:
                return  # a record still being written
            (length,) = struct.unpack("<Q", header[:8])
            data = f.read(length)
            if len(data) < length or len(f.read(4)) < 4:
                return
            event = event_pb2.Event()
            event.ParseFromString(data)
            yield event


def read_scalars(run_dir: str, wall_time: bool = False) -> dict[str, list[tuple]]:
    """{tag: [(step, value), ...]} over every event file of the run directory, in the order written;
    with wall_time, (step, value, unix time of the point).

    A resumed run starts a new file with a SessionLog START at its resume step (tensorboardX's
    purge_step): as in TensorBoard, points logged before it at that step or later are dropped.
    """
    scalars: dict[str, list[tuple]] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
        for event in iter_events(path):
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                for tag in scalars:
                    scalars[tag] = [point for point in scalars[tag] if point[0] < event.step]
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    point = (event.step, value.simple_value, event.wall_time) if wall_time else (event.step, value.simple_value)
                    scalars.setdefault(value.tag, []).append(point)
    return scalars


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        print("usage: python cleanba/events.py RUN_DIR", file=sys.stderr)
        sys.exit(2)
    for tag, series in sorted(read_scalars(sys.argv[1]).items()):
        print(f"{tag:40s} {len(series):6d} points, last {series[-1][1]:.6g} at step {series[-1][0]}")
