"""Videos of the agent: cleanba/evaluate.py --video records a saved model's episodes, and a training run with
--capture-video records each checkpoint's policy (cleanba/record.py) without changing a single batch."""

import glob
import os
import shutil
import subprocess
import sys

import imageio.v2 as imageio
import numpy as np
import pytest
from conftest import SYNC_FLAGS
from helpers import REPO, check, finished_run, run
from tensorboard.backend.event_processing import event_accumulator
from test_training import run_evaluate

RECORD = os.path.join(REPO, "cleanba", "record.py")  # --capture-video's recorder, which asks it first (--check)


@pytest.mark.parametrize("algo", ["ppo"], indirect=True)
def test_evaluate_records_playable_videos(sync_run, tmp_path):
    """One MP4 per episode, its return in its name, with the episode's length + 1 frames (the reset's, then one
    after each step), frames that change, at CartPole's render size; --video with nothing to play is refused."""
    run_dir = tmp_path / "sync"
    shutil.copytree(sync_run.path, run_dir)
    result = run_evaluate(str(run_dir), "--episodes", "2", "--video")
    assert result.returncode == 0, result.stderr[-3000:]
    videos = sorted(glob.glob(str(run_dir / "videos" / "eval-seed1-episode*-return*.mp4")))
    assert len(videos) == 2, os.listdir(run_dir)
    for path in videos:
        episode_return = float(path.rsplit("return", 1)[1][: -len(".mp4")])  # CartPole: +1 per step
        count = 0
        changed = 0  # frames unlike the one before
        previous = None
        for frame in imageio.get_reader(path):
            assert frame.shape == (400, 600, 3)
            count += 1
            changed += previous is not None and bool(np.any(frame != previous))
            previous = frame
        assert count == episode_return + 1, (path, count)
        assert changed >= 0.9 * (count - 1), (path, changed, count)
    config_only = tmp_path / "config-only"  # a run directory with neither a model nor a checkpoint
    config_only.mkdir()
    shutil.copy(os.path.join(sync_run.path, "config.json"), config_only)
    refused = run_evaluate(str(config_only), "--video")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: {config_only} holds no model (--save-model) and no intact checkpoint to play"
    ]
    model_only = tmp_path / "model-only"  # a model copied without the rest of its run directory
    model_only.mkdir()
    shutil.copy(glob.glob(os.path.join(sync_run.path, "*.cleanba_model"))[0], model_only)
    refused = run_evaluate(str(model_only))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: {model_only} holds no config.json: not a run directory of the scripts"
    ]
    unknown = subprocess.run(
        [sys.executable, RECORD, "--check", "NoSuchGame-v5", "None"], capture_output=True, text=True
    )
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1  # neither EnvPool's nor Gymnasium's
    assert unknown.stderr.startswith("NoSuchGame-v5: Gymnasium cannot render it") and "NameNotFound" in unknown.stderr


@pytest.mark.parametrize("algo", ["ppo"], indirect=True)
def test_capture_video_logs_videos_and_changes_no_batch(sync_run, tmp_path):
    """--capture-video: videos of the checkpoints in videos/ and in TensorBoard (an animated GIF at the checkpoint's
    global step), the last one's always (the recorder skips a checkpoint replaced before it got to it), and every
    batch fingerprint and loss equal to those of the same run without it."""
    check(run(tmp_path, *SYNC_FLAGS, "--capture-video", "--checkpoint-interval", 6, algo="ppo"))
    captured = finished_run(tmp_path)
    assert [r["fingerprint"] for r in captured.records] == [r["fingerprint"] for r in sync_run.records]
    assert [r["losses"] for r in captured.records] == [r["losses"] for r in sync_run.records]
    videos = sorted(os.listdir(os.path.join(captured.path, "videos")))
    assert "update-12.mp4" in videos and set(videos) <= {"update-6.mp4", "update-12.mp4"}, videos
    events = event_accumulator.EventAccumulator(captured.path, size_guidance={event_accumulator.IMAGES: 0})
    events.Reload()
    images = events.Images("videos/agent")
    batch_size = captured.config["layout"]["batch_size"]
    assert [image.step // batch_size for image in images] == sorted(int(v[7:-4]) for v in videos)
    assert all(image.encoded_image_string.startswith(b"GIF89a") for image in images)
    assert all((image.width, image.height) == (600, 400) for image in images)
