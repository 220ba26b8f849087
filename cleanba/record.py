"""Records the agent of a run while it trains: the training scripts' --capture-video starts it beside them.

    python cleanba/record.py runs/<run_name> TRAINING_PID
    python cleanba/record.py --check ENV_ID BACKEND  # exit 2 and one line if it cannot be recorded (--env-backend)

Each time the run writes a checkpoint, this process plays one episode with the checkpoint's parameters (on an
environment no training environment is, with the actors' own rollout program: see cleanba/evaluate.py), writes it to
runs/<run_name>/videos/update-<U>.mp4 and logs it to the run's TensorBoard events as `videos/agent` (an animated GIF)
at the checkpoint's global step; with --track, W&B's TensorBoard sync mirrors it. The recording is off the training
path: it reads the checkpoints the run writes anyway, in a process of its own, so the batches, the fingerprints and
the policy lag are those of the same run without it. It stops after the run's last checkpoint, or when the training
process (TRAINING_PID) is gone; it ignores Ctrl-C (the training process stops it). Checkpoints come every
--checkpoint-interval updates or --checkpoint-minutes minutes; one replaced by the next before this process got to it
is skipped (the run never waits for the recording).
"""

import io
import json
import os
import signal
import sys
import time

import flax.serialization
import imageio.v2 as imageio
from evaluate import FRAMES_PER_SECOND, Recorder, on_actor_axis, render_refusal, write_video
from tensorboardX import FileWriter
from tensorboardX.proto.summary_pb2 import Summary

MAX_FRAMES = 3_000  # an Atari episode can last 27,000 steps: its video stops here


def log_video(writer: FileWriter, tag: str, frames: list, step: int):
    """TensorBoard's video: an animated GIF in an image summary (what tensorboardX's add_video writes)."""
    buffer = io.BytesIO()
    imageio.mimwrite(buffer, frames, format="GIF", duration=1000 / FRAMES_PER_SECOND, loop=0)
    height, width, channels = frames[0].shape
    image = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=buffer.getvalue())
    writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
    writer.flush()


def main(run_dir: str, parent: int):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the training process, which stops this one
    with open(os.path.join(run_dir, "config.json")) as f:
        layout = json.load(f)["layout"]
    path = os.path.join(run_dir, "checkpoint.msgpack")
    writer = FileWriter(run_dir, filename_suffix=".videos")
    recorder = None
    recorded = None  # the inode and modification time of the last checkpoint recorded (each one is a new file)
    while True:
        training = os.getppid() == parent
        modified = None
        if os.path.exists(path):
            modified = (os.stat(path).st_ino, os.stat(path).st_mtime_ns)
        if modified is None or modified == recorded:
            if not training:
                return
            time.sleep(1.0)
            continue
        recorded = modified
        with open(path, "rb") as f:  # the scripts write checkpoints whole, then rename them into place
            checkpoint = flax.serialization.msgpack_restore(f.read().partition(b"\n")[2])  # after its checksum line
        recorder = recorder or Recorder(run_dir, max_frames=MAX_FRAMES)
        frames, episode_return = recorder.episode(on_actor_axis(checkpoint["state"]["params"]))
        update = int(checkpoint["update"])
        video = os.path.join(run_dir, "videos", f"update-{update}.mp4")
        try:
            write_video(video, frames)
            log_video(writer, "videos/agent", frames, update * layout["batch_size"])
        except OSError as error:  # a full disk, a quota: one line, exit 74 (EX_IOERR) as the scripts'; training goes on
            print(f"error: record.py: writing {video} failed ({error}); no more videos of this run", file=sys.stderr)
            sys.exit(74)
        print(f"record.py: update {update}: an episode of {len(frames) - 1} steps, return {episode_return:g}")
        if update == layout["num_updates"]:
            return


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--check":  # the scripts' --capture-video asks before a run starts
        if refusal := render_refusal(sys.argv[2], sys.argv[3]):
            print(refusal, file=sys.stderr)
        sys.exit(2 if refusal else 0)
    if len(sys.argv) != 3 or not os.path.isfile(os.path.join(sys.argv[1], "config.json")) or not sys.argv[2].isdigit():
        print(
            "usage: python cleanba/record.py RUN_DIR TRAINING_PID (a run directory with config.json)", file=sys.stderr
        )
        sys.exit(2)
    main(sys.argv[1], int(sys.argv[2]))
