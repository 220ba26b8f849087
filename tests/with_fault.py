"""Runs a training script with a fault injected at a known update, for the failure tests:

    CLEANBA_FAULT=<fault>@<update> python tests/with_fault.py cleanba/cleanba_ppo.py [flags]

    actor@K       the first actor thread raises in its rollout for update K
    learner@K     the learner raises at update K
    nan@K         update K's batch has NaN rewards (the loss becomes non-finite)
    sigterm@K     the process sends itself SIGTERM once update K is logged (a preemption at a known update; the
                  run stops after it, even when it is the first update of a resumed run)
    checkpoint@K  the process dies between writing update K's checkpoint and renaming it into place
    journal@K     the disk fills while updates.jsonl gets update K's record: half of the line is written
    torn@K        the process dies while updates.jsonl gets update K's record, half of the line written (as SIGKILL)
    events@K      the disk fills under TensorBoard's event file once update K's points are logged (its writer thread)
    inf@K         before update K, the optimiser's second-moment estimates become infinite: its losses stay finite,
                  the state it returns does not

The script is loaded as a module and some of its functions are wrapped here, so the scripts carry no test hook.
"""

import errno
import importlib.util
import os
import signal
import sys

import jax
import numpy as np
import tensorboardX.record_writer
import tyro


def announce():
    print(f"CLEANBA_FAULT: {fault} fault at update {due}", file=sys.stderr, flush=True)


def with_actor_fault(make_rollout):
    def faulty_make_rollout(args, networks, pools, platform):
        handle, rollout = make_rollout(args, networks, pools, platform)
        updates = iter(range(1, 2**31))  # a fresh run's rollouts, one per update

        def faulty_rollout(params, states):
            if next(updates) == due and states[0].ids[0] == 0:  # only the first actor thread fails
                announce()
                raise RuntimeError(f"CLEANBA_FAULT: injected actor failure at update {due}")
            return rollout(params, states)

        return handle, faulty_rollout

    return faulty_make_rollout


def full_disk(*_):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def killed(*_):
    os._exit(137)


class CutShort:
    """A file whose next write stops half-way: the disk fills (ENOSPC), or the process dies."""

    def __init__(self, file, how):
        self.file = file
        self.how = how

    def write(self, text):
        self.file.write(text[: len(text) // 2])
        self.file.flush()
        self.how()

    def __getattr__(self, name):
        return getattr(self.file, name)


def infinite_second_moments(opt_state):  # Adam's, RMSProp's and RAdam's nu: steps of 0, a non-finite state
    def poison(path, x):
        return x + np.inf if "nu" in jax.tree_util.keystr(path) else x  # (nu >= 0: never NaN)

    return jax.tree_util.tree_map_with_path(poison, opt_state)


def with_learner_fault(learn):
    def faulty_learn(update_fn, state, batch, update, last_checkpoint):
        if update == due:
            announce()
            if fault == "learner":
                raise RuntimeError(f"CLEANBA_FAULT: injected learner failure at update {update}")
            if fault == "nan":
                batch["rewards"] = batch["rewards"] * np.nan  # (on the learner devices, as the batch is)
            if fault == "inf":
                state = state.replace(opt_state=infinite_second_moments(state.opt_state))
        return learn(update_fn, state, batch, update, last_checkpoint)

    return faulty_learn


def with_stop_signal(log):
    def log_then_signal(run_dir, update, *args):
        log(run_dir, update, *args)
        if update == due:
            announce()
            os.kill(os.getpid(), signal.SIGTERM)

    return log_then_signal


def with_full_disk(log):
    def log_on_a_filling_disk(run_dir, update, *args):
        if update == due and fault in ("journal", "torn"):
            announce()
            run_dir.updates = CutShort(run_dir.updates, full_disk if fault == "journal" else killed)
        log(run_dir, update, *args)
        if update == due and fault == "events":
            announce()
            tensorboardX.record_writer.RecordWriter.write = full_disk

    return log_on_a_filling_disk


def with_checkpoint_fault(checkpoint):
    def faulty_checkpoint(run_dir, state, update, if_due=False):
        if update == due:

            def die(*_):  # the write happened; the rename never does
                announce()
                killed()

            os.replace = die
        return checkpoint(run_dir, state, update, if_due)

    return faulty_checkpoint


if __name__ == "__main__":  # (not in the fork server of a Gymnasium pool, which imports this file)
    path = sys.argv[1]
    sys.argv = [path, *sys.argv[2:]]
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[: -len(".py")], path)
    script = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))  # where a Gymnasium pool's worker processes import the script from
    spec.loader.exec_module(script)
    fault, _, due = os.environ["CLEANBA_FAULT"].partition("@")
    due = int(due)
    if fault == "actor":
        script.make_rollout = with_actor_fault(script.make_rollout)
    elif fault in ("learner", "nan", "inf"):
        script.learn = with_learner_fault(script.learn)
    elif fault == "sigterm":
        script.RunDir.log = with_stop_signal(script.RunDir.log)
    elif fault in ("journal", "torn", "events"):
        script.RunDir.log = with_full_disk(script.RunDir.log)
    elif fault == "checkpoint":
        script.RunDir.checkpoint = with_checkpoint_fault(script.RunDir.checkpoint)
    else:
        sys.exit(f"CLEANBA_FAULT={os.environ['CLEANBA_FAULT']}: unknown fault")
    sys.stdout.reconfigure(line_buffering=True)
    script.main(tyro.cli(script.Args))
