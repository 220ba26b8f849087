#!/usr/bin/env bash
# The experiment grids, as launcher commands. Usage: bash benchmark.sh GRID [launcher flags...]
#
#   laptop                   PPO, IMPALA and PQN on CartPole-v1 and Acrobot-v1, 3 seeds, 500k steps, on this machine
#                            (2 workers, ~8 minutes on 2 CPU cores)
#   mujoco                   PPO and IMPALA on HalfCheetah-v4, Hopper-v4 and Walker2d-v4, 3 seeds, 1M steps
#                            (2 workers, ~28 minutes on 2 CPU cores)
#   minigrid                 PPO on MiniGrid: MemoryS7 with and without an LSTM (--lstm-size 64), 1M steps, and
#                            DoorKey-5x5 without, 500k steps; 3 seeds (2 workers; 67 minutes on 2 CPU cores with a
#                            third run beside them)
#   minigrid-memory          PPO on MiniGrid-MemoryS11-v0 (the smallest Memory room whose cue is out of view from the
#                            split) with and without an LSTM (--lstm-size 64), 3M steps, 3 seeds: the recurrent and
#                            the feed-forward seeds side by side, one worker each (~55 minutes on 2 CPU cores)
#   memory                   CartPole-v1 with its velocities hidden (--mask-obs 1 3: a memory test), PPO (200k steps)
#                            and IMPALA (500k), each with an LSTM (--lstm-size 64 --critic-core) and without, 3 seeds
#                            (1 worker, ~8 minutes on a CPU core)
#   results                  laptop, then mujoco: the README's results table. Then:
#                            .venv/bin/python cleanba/aggregate.py runs --out docs/results
#   ppo-atari57              PPO, Atari-57 x 3 seeds, one GPU per run (a0-l0-d1), synchronous (PPO's default)
#   ppo-atari57-cleanba      the same with the Cleanba architecture (--concurrency)
#   impala-atari57           IMPALA, Atari-57 x 3 seeds, one GPU per run (a0-l0-d1), Cleanba architecture
#   impala-atari57-sync      the same, synchronous (--no-concurrency)
#   ppo-atari57-8gpu         PPO on 8 GPUs per run: actors on 0 and 1, learner on 2..7 (a0,1-l2,3,4,5,6,7-d1)
#   impala-atari57-8gpu      IMPALA on 8 GPUs per run, same layout
#   impala-atari57-2nodes    IMPALA on 2 nodes x 4 GPUs per run (a0-l1,2,3-d2), --distributed under srun
#   pqn-atari57              PQN, Atari-57 x 3 seeds, 10M steps (the paper's budget), one GPU per run, synchronous
#   procgen                  PPO on the 16 Procgen games, easy mode, 200 training levels, 25M steps, 3 seeds, one GPU
#                            per run (the generalisation protocol of Cobbe et al., 2020, and the papers that report
#                            on it, with their PPO settings: 64 envs x 256 steps, 8 minibatches x 3 epochs, Adam 5e-4,
#                            gamma 0.999, rewards normalised); the model saved
#   procgen-cleanba          the same with the original Cleanba's number of Procgen envs (60: 2 x 30); its other
#                            settings are those above
#   procgen-test             each finished Procgen run under runs/ (one with its saved model; the others are named
#                            and skipped) plays 100 episodes on unseen levels (cleanba/evaluate.py --levels unseen);
#                            then aggregate.py reports train and test returns
#   procgen-cpu              what a CPU can show of Procgen in about an hour per game: IMPALA on StarpilotEasy-v0, then
#                            on CoinrunEasy-v0 (200 levels, 16 envs x 64 steps, 500k steps); then 20 episodes of each on
#                            its training levels and 20 on unseen ones (their returns printed); aggregate.py's train and
#                            test returns (the run's last tenth, and the unseen levels) and curves in
#                            docs/results/procgen_cpu/
#   soak                     the chaos soak (tests/soak.py): PPO, IMPALA and PQN, 2 processes on CartPole, 60 faults
#                            of 12 kinds each from a seeded schedule, every invariant checked; figures in
#                            docs/results/soak/soak.{json,md} (~30 minutes on 2 CPU cores)
#   soak-slurm               the same soak with the run as a SLURM job (cleanba/launch.py --slurm, its template's
#                            --requeue) on a one-node cluster started here (root, slurm-wlm and munge, as setup.sh
#                            installs them); figures in docs/results/soak/soak_slurm.{json,md}
#   gpu-throughput           on this machine's GPU: the throughput benchmark at the papers' Atari defaults (PPO,
#                            IMPALA and PQN, synchronous and Cleanba, a0-l0) against EnvPool alone on its cores (~12
#                            min on an H100); figures in results/gpu_throughput.json
#   gpu-learning             on this machine's GPU: each script on Breakout-v5 with its paper's defaults for 3.5
#                            minutes; steps/s and the return curve in results/gpu_learning/ (~12 min)
#   gpu-check                on this machine's GPU, in ~8 minutes: the machine, EnvPool alone, each script's steady
#                            steps/s on Breakout-v5 at its defaults and over the ceiling its architecture allows (its
#                            actors alone, its learner alone), then, as the budget allows, --no-deterministic-gpu,
#                            the default with the algorithms that run recorded, IMPALA's --env-pools 2 and 4, CUDA
#                            graphs for every kernel and one actor thread of 128 envs, and whether PPO reruns bit for
#                            bit (the same command twice; layout-free on 1 and 2 actor threads; with CUDA graphs);
#                            in docs/results/gpu/gpu_check.{json,md}
#                            (--out DIR elsewhere; --help: the sizes, for a dry run on a CPU)
#   gpu-profile              on this machine's GPU: where each script's update at its Atari defaults (Breakout-v5)
#                            spends the device's time, by part of the network and pass (forward, backward), from JAX's
#                            profiler (~1 minute a script); in docs/results/gpu/update_trace_<algo>_det.{json,md} (--out
#                            DIR elsewhere; --raw-out DIR: the programs and traces too; --no-deterministic-gpu: without
#                            XLA's deterministic ops; --actors: the actors' rollouts instead, actor_trace_<algo>_*)
#   gpu-actors               on this machine's GPU, in 6.5 min: where the actors' own work goes. IMPALA's actor calls
#                            without environments (tests/benchmarks/actor_calls.py: 32, 64 and 128 envs per call, 1, 2
#                            and 4 threads at once); whether the rollout compiled into one program, as on a CPU,
#                            collects what the GPU's loop does, and in how long (compiled_rollout.py); its actors'
#                            rollouts traced (device_trace.py --actors); then the calls again and the actors alone
#                            against EnvPool alone (actors_alone.py), each with XLA's CUDA graphs as they are (as-is),
#                            off (graphs-off), and holding every kernel, convolutions too (graphs-all); in
#                            docs/results/gpu/actors/<variant>/ (--out DIR elsewhere, then -- and the script's flags).
#                            It keeps to a budget, BUDGET=390 seconds by default (to fit a
#                            10-minute slot), reporting what did not fit as skipped (all of it takes ~8 min)
#   gpu-next                 on this machine's GPU, in 9 minutes (BUDGET=540 seconds): what chooses among the
#                            candidates for one GPU. gpu-check at 12 s a run with each script's ceiling (its actors
#                            alone, its learner alone), every kernel in CUDA graphs (-graphs, and whether PPO's bits
#                            stay the same with them) and one actor thread of 128 envs in 2 pools (-1x128), IMPALA's
#                            first, as the budget allows (RUNS=... for a second call with the rest, CHECK_FLAGS=...
#                            more of gpu_check.py's flags); then
#                            the learner in a second process (learner_process.py) and the learner's host time per
#                            update (learner_host_time.py), in docs/results/gpu/next/ (--out DIR elsewhere, then --
#                            and the scripts' flags; ENV_ID=... another environment)
#   gpu-procgen              on this machine's GPU: PPO on StarpilotEasy-v0 with the Procgen protocol's settings (200
#                            levels, 64 envs x 256 steps) for 2.6M steps (~4.5 minutes on an H200), stopped at 6
#                            minutes (MINUTES=...); if it finished, 20 episodes on its training levels and 20 on
#                            unseen ones; the curve and the returns in docs/results/gpu/procgen/ (flags after the
#                            grid's name go to the script, e.g. --total-timesteps; a command on the project's GPU
#                            machine runs 10 minutes at most)
#
# The 8-GPU and 2-node grids use 120 environments (2 actor devices or 2 nodes x 2 threads x 30), which
# split evenly over 6 learner devices (20 each, 5 per IMPALA minibatch); 128 would not.
# The Atari grids go to SLURM (cleanba/launch.py --slurm); add --dry-run to see the sbatch script, and
# --partition/--time as your cluster needs. Every run name is derived from its configuration, so a
# requeued or resubmitted task resumes from its checkpoint.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-.venv/bin/python}

ATARI57="Alien-v5 Amidar-v5 Assault-v5 Asterix-v5 Asteroids-v5 Atlantis-v5 BankHeist-v5 BattleZone-v5
BeamRider-v5 Berzerk-v5 Bowling-v5 Boxing-v5 Breakout-v5 Centipede-v5 ChopperCommand-v5 CrazyClimber-v5
Defender-v5 DemonAttack-v5 DoubleDunk-v5 Enduro-v5 FishingDerby-v5 Freeway-v5 Frostbite-v5 Gopher-v5
Gravitar-v5 Hero-v5 IceHockey-v5 Jamesbond-v5 Kangaroo-v5 Krull-v5 KungFuMaster-v5 MontezumaRevenge-v5
MsPacman-v5 NameThisGame-v5 Phoenix-v5 Pitfall-v5 Pong-v5 PrivateEye-v5 Qbert-v5 Riverraid-v5 RoadRunner-v5
Robotank-v5 Seaquest-v5 Skiing-v5 Solaris-v5 SpaceInvaders-v5 StarGunner-v5 Surround-v5 Tennis-v5
TimePilot-v5 Tutankham-v5 UpNDown-v5 Venture-v5 VideoPinball-v5 WizardOfWor-v5 YarsRevenge-v5 Zaxxon-v5"
PROCGEN16="BigfishEasy-v0 BossfightEasy-v0 CaveflyerEasy-v0 ChaserEasy-v0 ClimberEasy-v0 CoinrunEasy-v0
DodgeballEasy-v0 FruitbotEasy-v0 HeistEasy-v0 JumperEasy-v0 LeaperEasy-v0 MazeEasy-v0 MinerEasy-v0 NinjaEasy-v0
PlunderEasy-v0 StarpilotEasy-v0"
# Procgen's PPO (Cobbe et al., 2020): 256-step rollouts, 8 minibatches (along time) x 3 epochs, gamma 0.999, lambda
# 0.95, entropy 0.01, clip 0.2, gradient norm 0.5, Adam 5e-4 (not annealed), rewards normalised; then the grids'
# run: 25M steps, the model saved for the test on unseen levels, tracked (gpu-procgen runs the same settings shorter).
PROCGEN_PPO="--num-levels 200 --num-steps 256 --num-minibatches 8 --update-epochs 3 --learning-rate 5e-4
--no-anneal-lr --gamma 0.999 --gae-lambda 0.95 --ent-coef 0.01 --clip-coef 0.2 --max-grad-norm 0.5 --norm-reward True"
PROCGEN_RUN="--total-timesteps 25000000 --save-model --track"
# Procgen on a CPU (procgen-cpu): IMPALA, its defaults but 1 actor thread of 16 envs x 64 steps, on 200 levels for 500k
# steps (about an hour on one core), the model saved for the test on unseen levels.
PROCGEN_CPU="--num-levels 200 --num-actor-threads 1 --local-num-envs 16 --num-steps 64 --total-timesteps 500000
--save-model"
SEEDS="1 2 3"
launch() { $PYTHON cleanba/launch.py "$@"; }
# The GPU grids that keep to a budget: each measurement runs whatever became of the one before, stopped after its CAP
# seconds or at the budget's $deadline (SIGTERM: the benchmarks write what they measured), skipped with under 30 s left.
failed=0
measure() {  # CAP COMMAND...
  local left=$((deadline - SECONDS))
  if [ $left -lt 30 ]; then echo "$grid: skipped, out of budget: ${*:2}" >&2; failed=1; return; fi
  timeout -k 20 $((left < $1 ? left : $1)) "${@:2}" || failed=1  # -k: killed 20 s after a stop it ignores
}

# The settings of the results table. Each grid runs to the end even if an experiment fails, then says so.
# PQN on classic control: CleanRL's pqn.py settings (4 envs x 128 steps, 4 minibatches x 4 epochs, RAdam 2.5e-4,
# epsilon annealed over half the run, Q(lambda) 0.65, gradient norms clipped at 10) but a final epsilon of 0.01, not
# 0.05: at 0.05 one Acrobot seed of three ended at -100.7, at 0.01 all at -84 to -92 (see the README's results).
# IMPALA on CartPole: gradient norms clipped at 10 (not Atari's 40) and V-trace's lambda 0.95, which stop
# the value-loss spikes that made it lose the task after solving it (see the README's results).
# --8<-- [start:classic_control]
classic_control() {
  local status=0
  launch --env-ids CartPole-v1 Acrobot-v1 --seeds $SEEDS --workers 2 --log-dir launch_logs/ppo_classic "$@" -- \
    $PYTHON cleanba/cleanba_ppo.py --exp-name ppo --local-num-envs 8 --num-actor-threads 1 \
    --learning-rate 1e-3 --clip-coef 0.2 --total-timesteps 500000 --log-frequency 10 || status=1
  launch --env-ids CartPole-v1 Acrobot-v1 --seeds $SEEDS --workers 2 --log-dir launch_logs/impala_classic "$@" -- \
    $PYTHON cleanba/cleanba_impala.py --exp-name impala --local-num-envs 16 --num-actor-threads 1 \
    --learning-rate 1e-3 --max-grad-norm 10 --vtrace-lambda 0.95 --total-timesteps 500000 --log-frequency 10 || status=1
  launch --env-ids CartPole-v1 Acrobot-v1 --seeds $SEEDS --workers 2 --log-dir launch_logs/pqn_classic "$@" -- \
    $PYTHON cleanba/cleanba_pqn.py --exp-name pqn --local-num-envs 4 --num-actor-threads 1 --num-steps 128 \
    --num-minibatches 4 --update-epochs 4 --end-e 0.01 --exploration-fraction 0.5 --total-timesteps 500000 \
    --log-frequency 10 || status=1
  return $status
}
# --8<-- [end:classic_control]
# PPO as CleanRL's ppo_continuous_action.py (8 envs x 256 steps, 32 minibatches, 10 epochs, Adam 3e-4, no entropy
# bonus; observations and rewards normalised by default for continuous actions). IMPALA: 16 envs x 32 steps,
# 16 minibatches (one environment's unroll each), RMSProp 6e-4 with eps 1e-5 and gradient norms clipped at 0.5.
# --8<-- [start:mujoco]
mujoco() {
  local status=0
  launch --env-ids HalfCheetah-v4 Hopper-v4 Walker2d-v4 --seeds $SEEDS --workers 2 --log-dir launch_logs/ppo_mujoco "$@" -- \
    $PYTHON cleanba/cleanba_ppo.py --exp-name ppo --local-num-envs 8 --num-actor-threads 1 --num-steps 256 \
    --num-minibatches 32 --update-epochs 10 --learning-rate 3e-4 --clip-coef 0.2 --ent-coef 0 \
    --total-timesteps 1000000 --log-frequency 10 || status=1
  launch --env-ids HalfCheetah-v4 Hopper-v4 Walker2d-v4 --seeds $SEEDS --workers 2 --log-dir launch_logs/impala_mujoco "$@" -- \
    $PYTHON cleanba/cleanba_impala.py --exp-name impala --local-num-envs 16 --num-actor-threads 1 --num-steps 32 \
    --num-minibatches 16 --learning-rate 6e-4 --rmsprop-eps 1e-5 --max-grad-norm 0.5 --ent-coef 0 \
    --total-timesteps 1000000 --log-frequency 50 || status=1
  return $status
}
# --8<-- [end:mujoco]

# MiniGrid (dict observations): PPO with 2 x 8 envs x 128 steps, 4 minibatches of whole 32-step chunks when recurrent.
# MemoryS7 twice, the same settings but the memory: the cue is seen at the start, the choice made at the end.
# --8<-- [start:minigrid]
minigrid() {
  local status=0 ppo="$PYTHON cleanba/cleanba_ppo.py --local-num-envs 8 --num-actor-threads 2 --learning-rate 1e-3
    --log-frequency 10"
  launch --env-ids MiniGrid-MemoryS7-v0 --seeds $SEEDS --workers 2 --log-dir launch_logs/minigrid_lstm "$@" -- \
    $ppo --exp-name ppo_lstm --lstm-size 64 --total-timesteps 1000000 || status=1
  launch --env-ids MiniGrid-MemoryS7-v0 --seeds $SEEDS --workers 2 --log-dir launch_logs/minigrid "$@" -- \
    $ppo --exp-name ppo --total-timesteps 1000000 || status=1
  launch --env-ids MiniGrid-DoorKey-5x5-v0 --seeds $SEEDS --workers 2 --log-dir launch_logs/minigrid_doorkey "$@" -- \
    $ppo --exp-name ppo --total-timesteps 500000 || status=1
  return $status
}
# --8<-- [end:minigrid]
# MemoryS11: the same settings as MemoryS7's. The cue (x = 1) is 8 cells from the split (x = 9), beyond the 7x7
# view, so a feed-forward policy can only guess; the agent sees it at the start only if it starts at x = 1 (1 in 8).
# --8<-- [start:minigrid_memory]
minigrid_memory() {
  local status=0 lstm ppo="$PYTHON cleanba/cleanba_ppo.py --local-num-envs 8 --num-actor-threads 2 --learning-rate 1e-3
    --log-frequency 10 --total-timesteps 3000000"
  trap 'trap - INT TERM; kill -TERM 0' INT TERM  # a background job ignores Ctrl-C: SIGTERM (a checkpoint) to all
  launch --env-ids MiniGrid-MemoryS11-v0 --seeds $SEEDS --workers 1 --log-dir launch_logs/minigrid_s11_lstm "$@" -- \
    $ppo --exp-name ppo_lstm --lstm-size 64 &
  lstm=$!
  launch --env-ids MiniGrid-MemoryS11-v0 --seeds $SEEDS --workers 1 --log-dir launch_logs/minigrid_s11 "$@" -- \
    $ppo --exp-name ppo || status=1
  wait $lstm || status=1
  return $status
}
# --8<-- [end:minigrid_memory]

# CartPole without its velocities (cart and pole positions only): a memoryless policy cannot balance it. PPO as SB3's
# recurrent PPO on CartPoleNoVel (8 envs x 32 steps, 1 minibatch, 20 epochs, Adam 1e-3 annealed, gamma 0.98, lambda
# 0.8, clip 0.2, no entropy bonus, observations and rewards normalised, an LSTM of 64 per tower); IMPALA with the
# CartPole settings of the laptop grid and normalised observations. The feed-forward runs: the same without a core.
# --8<-- [start:memory]
memory() {
  local status=0 ppo impala
  ppo="$PYTHON cleanba/cleanba_ppo.py --mask-obs 1 3 --local-num-envs 8 --num-actor-threads 1 --num-steps 32
    --num-minibatches 1 --update-epochs 20 --learning-rate 1e-3 --gamma 0.98 --gae-lambda 0.8 --clip-coef 0.2
    --ent-coef 0 --norm-obs True --norm-reward True --total-timesteps 200000 --log-frequency 10"
  impala="$PYTHON cleanba/cleanba_impala.py --mask-obs 1 3 --local-num-envs 16 --num-actor-threads 1
    --learning-rate 1e-3 --max-grad-norm 10 --vtrace-lambda 0.95 --norm-obs True --total-timesteps 500000
    --log-frequency 10"
  launch --env-ids CartPole-v1 --seeds $SEEDS --workers 1 --log-dir launch_logs/memory "$@" -- \
    $ppo --exp-name ppo_lstm_novel --lstm-size 64 --critic-core || status=1
  launch --env-ids CartPole-v1 --seeds $SEEDS --workers 1 --log-dir launch_logs/memory "$@" -- \
    $ppo --exp-name ppo_novel || status=1
  launch --env-ids CartPole-v1 --seeds $SEEDS --workers 1 --log-dir launch_logs/memory "$@" -- \
    $impala --exp-name impala_lstm_novel --lstm-size 64 --critic-core || status=1
  launch --env-ids CartPole-v1 --seeds $SEEDS --workers 1 --log-dir launch_logs/memory "$@" -- \
    $impala --exp-name impala_novel || status=1
  return $status
}
# --8<-- [end:memory]

grid=${1:-}
shift || true
case "$grid" in
  laptop)
    classic_control "$@" ;;
  mujoco)
    mujoco "$@" ;;
  minigrid)
    minigrid "$@" ;;
  minigrid-memory)
    minigrid_memory "$@" ;;
  memory)
    memory "$@" ;;
  results)
    status=0
    classic_control "$@" || status=1
    mujoco "$@" || status=1
    exit $status ;;
  # --8<-- [start:atari]
  ppo-atari57)
    launch --slurm --job-name ppo --log-dir launch_logs/ppo --env-ids $ATARI57 --seeds $SEEDS --gpus-per-task 1 --cpus-per-task 10 "$@" -- \
      $PYTHON cleanba/cleanba_ppo.py --exp-name cleanba_ppo_a0_l0_d1 --track ;;
  ppo-atari57-cleanba)
    launch --slurm --job-name ppo-cleanba --log-dir launch_logs/ppo-cleanba --env-ids $ATARI57 --seeds $SEEDS --gpus-per-task 1 --cpus-per-task 10 "$@" -- \
      $PYTHON cleanba/cleanba_ppo.py --exp-name cleanba_ppo_concurrency_a0_l0_d1 --concurrency --track ;;
  impala-atari57)
    launch --slurm --job-name impala --log-dir launch_logs/impala --env-ids $ATARI57 --seeds $SEEDS --gpus-per-task 1 --cpus-per-task 10 "$@" -- \
      $PYTHON cleanba/cleanba_impala.py --exp-name cleanba_impala_a0_l0_d1 --track ;;
  impala-atari57-sync)
    launch --slurm --job-name impala-sync --log-dir launch_logs/impala-sync --env-ids $ATARI57 --seeds $SEEDS --gpus-per-task 1 --cpus-per-task 10 "$@" -- \
      $PYTHON cleanba/cleanba_impala.py --exp-name cleanba_impala_sync_a0_l0_d1 --no-concurrency --track ;;
  ppo-atari57-8gpu)
    launch --slurm --job-name ppo-8gpu --log-dir launch_logs/ppo-8gpu --env-ids $ATARI57 --seeds $SEEDS --gpus-per-task 8 --cpus-per-task 46 "$@" -- \
      $PYTHON cleanba/cleanba_ppo.py --exp-name cleanba_ppo_a01_l234567_d1 --actor-device-ids 0 1 \
      --learner-device-ids 2 3 4 5 6 7 --local-num-envs 30 --track ;;
  impala-atari57-8gpu)
    launch --slurm --job-name impala-8gpu --log-dir launch_logs/impala-8gpu --env-ids $ATARI57 --seeds $SEEDS --gpus-per-task 8 --cpus-per-task 46 "$@" -- \
      $PYTHON cleanba/cleanba_impala.py --exp-name cleanba_impala_a01_l234567_d1 --actor-device-ids 0 1 \
      --learner-device-ids 2 3 4 5 6 7 --local-num-envs 30 --track ;;
  impala-atari57-2nodes)
    launch --slurm --job-name impala-2nodes --log-dir launch_logs/impala-2nodes --env-ids $ATARI57 --seeds $SEEDS --nodes 2 --ntasks-per-node 1 \
      --gpus-per-task 4 --cpus-per-task 20 "$@" -- \
      $PYTHON cleanba/cleanba_impala.py --exp-name cleanba_impala_a0_l123_d2 --actor-device-ids 0 \
      --learner-device-ids 1 2 3 --local-num-envs 30 --distributed --track ;;
  pqn-atari57)
    launch --slurm --job-name pqn --log-dir launch_logs/pqn --env-ids $ATARI57 --seeds $SEEDS --gpus-per-task 1 --cpus-per-task 10 "$@" -- \
      $PYTHON cleanba/cleanba_pqn.py --exp-name cleanba_pqn_a0_l0_d1 --track ;;
  # --8<-- [end:atari]
  # --8<-- [start:procgen]
  procgen)
    launch --slurm --job-name procgen --log-dir launch_logs/procgen --env-ids $PROCGEN16 --seeds $SEEDS --gpus-per-task 1 --cpus-per-task 10 "$@" -- \
      $PYTHON cleanba/cleanba_ppo.py --exp-name cleanba_ppo_procgen --local-num-envs 32 $PROCGEN_PPO $PROCGEN_RUN ;;
  procgen-cleanba)
    launch --slurm --job-name procgen-cleanba --log-dir launch_logs/procgen-cleanba --env-ids $PROCGEN16 --seeds $SEEDS --gpus-per-task 1 --cpus-per-task 10 "$@" -- \
      $PYTHON cleanba/cleanba_ppo.py --exp-name cleanba_ppo_procgen_cleanba --local-num-envs 30 $PROCGEN_PPO $PROCGEN_RUN ;;
  procgen-test)
    for run in runs/*Easy-v0__cleanba_ppo_procgen*; do
      if compgen -G "$run/*.cleanba_model" > /dev/null; then
        $PYTHON cleanba/evaluate.py "$run" --levels unseen --episodes 100 "$@"
      else  # a run still training, or stopped before its end: the grid goes on with the others
        echo "procgen-test: skipped $run: no saved model (not finished)" >&2
      fi
    done ;;
  # --8<-- [end:procgen]
  procgen-cpu)
    $PYTHON cleanba/cleanba_impala.py --env-id StarpilotEasy-v0 $PROCGEN_CPU --run-name procgen_cpu_starpilot "$@"
    $PYTHON cleanba/cleanba_impala.py --env-id CoinrunEasy-v0 $PROCGEN_CPU --run-name procgen_cpu_coinrun "$@"
    for run in procgen_cpu_starpilot procgen_cpu_coinrun; do
      $PYTHON cleanba/evaluate.py "runs/$run" --levels train --episodes 20
      $PYTHON cleanba/evaluate.py "runs/$run" --levels unseen --episodes 20
    done
    $PYTHON cleanba/aggregate.py runs/procgen_cpu_starpilot runs/procgen_cpu_coinrun --out docs/results/procgen_cpu \
      --no-profiles ;;
  soak)
    $PYTHON tests/soak.py --algo ppo impala pqn --faults 60 --dir "${SOAK_DIR:-soak}" --out docs/results/soak "$@" ;;
  soak-slurm)
    $PYTHON tests/soak.py --slurm --algo ppo impala pqn --faults 60 --dir "${SOAK_DIR:-soak-slurm}" --out docs/results/soak "$@" ;;
  gpu-throughput)
    mkdir -p results
    $PYTHON tests/benchmarks/throughput.py --configs atari --out results/gpu_throughput.json "$@" ;;
  gpu-learning)
    $PYTHON tests/benchmarks/learning.py --env-id Breakout-v5 --minutes 3.5 --out results/gpu_learning "$@" ;;
  gpu-check)
    $PYTHON tests/benchmarks/gpu_check.py "$@" ;;
  gpu-profile)
    failed=0  # each script's profile, whatever became of the one before
    for algo in ppo impala pqn; do $PYTHON tests/benchmarks/device_trace.py --algo "$algo" "$@" || failed=1; done
    exit $failed ;;
  gpu-actors)
    out=docs/results/gpu/actors
    if [ "${1:-}" = --out ]; then out=${2:?--out needs a directory}; shift 2; fi
    [ "${1:-}" = -- ] && shift  # then the script's flags (a dry run on a CPU: -- --local-num-envs 8 --num-steps 8)
    variants=(as-is graphs-off graphs-all)
    flags=("" "--xla_gpu_enable_command_buffer="
      "--xla_gpu_enable_command_buffer=+CONVOLUTION --xla_gpu_graph_min_graph_size=1")
    deadline=$((SECONDS + ${BUDGET:-390}))
    measure 100 $PYTHON tests/benchmarks/actor_calls.py --seconds 2 --out "$out/as-is" -- "$@"
    measure 150 $PYTHON tests/benchmarks/compiled_rollout.py --out "$out/as-is" -- "$@"
    measure 100 $PYTHON tests/benchmarks/device_trace.py --actors --algo impala --calls 3 --out "$out/as-is" -- "$@"
    for i in 1 2; do
      XLA_FLAGS="${XLA_FLAGS:-} ${flags[$i]}" measure 100 $PYTHON tests/benchmarks/actor_calls.py --seconds 2 \
        --out "$out/${variants[$i]}" -- "$@"
    done
    for i in 0 2 1; do
      XLA_FLAGS="${XLA_FLAGS:-} ${flags[$i]}" measure 100 $PYTHON tests/benchmarks/actors_alone.py --algos impala \
        --pools 1 --seconds 3 --out "$out/${variants[$i]}" -- "$@"
    done
    exit $failed ;;
  gpu-next)
    out=docs/results/gpu/next
    if [ "${1:-}" = --out ]; then out=${2:?--out needs a directory}; shift 2; fi
    [ "${1:-}" = -- ] && shift  # then the scripts' flags (a dry run on a CPU: -- --local-num-envs 8 --num-steps 32)
    env_id=${ENV_ID:-Breakout-v5}
    budget=${BUDGET:-540}
    deadline=$((SECONDS + budget))
    # In order: IMPALA's ceiling and candidates first (its goal is EnvPool alone's rate), then PPO's and PQN's; what
    # the budget leaves out is reported as skipped, for a second call (RUNS="pqn pqn-parts ppo-1x128 ...").
    runs=${RUNS:-impala impala-parts impala-graphs impala-1x128 ppo ppo-parts ppo-graphs pqn pqn-parts ppo-1x128
      pqn-graphs pqn-1x128}
    # (unquoted: the runs and CHECK_FLAGS split into words)
    measure $((budget - 210)) $PYTHON tests/benchmarks/gpu_check.py --out "$out" --env-id "$env_id" \
      --repro-env-id "$env_id" --budget $((budget - 230)) --seconds 12 --parts-seconds 3 --repro-seconds 60 \
      ${CHECK_FLAGS:-} --runs $runs -- "$@"
    measure 150 $PYTHON tests/benchmarks/learner_process.py --env-id "$env_id" --seconds 8 --out "$out" -- "$@"
    measure 60 $PYTHON tests/benchmarks/learner_host_time.py --algos impala --env-id "$env_id" --out "$out" -- "$@"
    exit $failed ;;
  gpu-procgen)
    $PYTHON tests/benchmarks/learning.py --env-id StarpilotEasy-v0 --algos ppo --minutes "${MINUTES:-6}" --evaluate 20 \
      --out docs/results/gpu/procgen -- --local-num-envs 32 $PROCGEN_PPO --total-timesteps 2621440 --save-model "$@" ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
    [ -z "$grid" ] && exit 0 || { echo "unknown grid: $grid" >&2; exit 2; } ;;
esac
