#!/bin/bash
# Multi-rank checkpoint scenarios through `moetrain train` under mpirun (CMakeLists.txt):
#   resume_w1, resume_w4   10 steps straight vs the same run resumed from its step-5 checkpoint:
#                          steps 6..10 have exactly the same losses (world 4: fsdp 4, ep 2)
#   reshard                save at world 4 (fsdp 4, ep 2) at step 5, resume at world 2 (ep 1) and
#                          world 1: step 6's loss equals world 4's within relative 1e-5, and no
#                          "config differs" warning (the global batch is what a reshard keeps)
#   context_parallel_w4    a KDA + MLA model at world 4 with parallel.cp 2 (two groups of two ranks
#                          sharing micro-batches; fsdp 2, ep 2) trains as world 1 does (every step
#                          within relative 1e-5), and its step-3 checkpoint resumes at world 1 (cp
#                          1) to the same losses; the aux loss is refused (exit 2)
#   signal_w2              SIGTERM to rank 1 of a world-2 run: every rank saves, exit 75, and the
#                          resumed run's losses equal an uninterrupted run's exactly
#   signal_all_w2          the same with SIGTERM to both ranks
#   signal_mpirun_w2       SIGTERM to scripts/slurm/mpirun_preemptible.sh: the ranks save, exit 75
#   hang_w1, hang_w2       a rank stops making progress during a save (MOETRAIN_FAULT=hang): the
#                          watchdog (parallel.timeout_s) ends the job in seconds, naming the phase
#   fault_w4_R_PHASE       kill -9 rank R of a world-4 run during its second save (MOETRAIN_FAULT,
#                          docs/CHECKPOINTS.md): the job exits, the first checkpoint survives, and
#                          the resumed run ends equal to the uninterrupted one
# The global batch is the same at every world size (micro_batch x world = 4), so the runs see
# the same samples per step. Losses are compared as written in metrics.jsonl (17 digits).
#
# usage: multirank.sh SCENARIO MOETRAIN MPIEXEC CONFIG WORK [MPIEXEC FLAGS...]
set -u
scenario=$1 moetrain=$2 mpiexec=$3 config=$4 work=$5
shift 5
mpi_flags=("$@")
launcher=()  # a prefix of the moetrain command (env VAR=...), set by a scenario
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work" || exit 1

fail() {
  echo "FAIL ($scenario): $*" >&2
  exit 1
}

# train NAME WORLD FSDP EP MICRO_BATCH [--set ...]: a run whose rank R logs to $work/NAME/rankR.
# Sets $rc; the output goes to $work/NAME.log.
train() {
  local name=$1 world=$2 fsdp=$3 ep=$4 micro_batch=$5
  shift 5
  local args=(train --config "$config" --set "parallel.fsdp=$fsdp" --set "parallel.ep=$ep"
              --set "data.micro_batch=$micro_batch" --set checkpoint.export_adapter=false "$@")
  if [ "$world" -eq 1 ]; then
    "$here/rank_exec.sh" "$work/$name" "${launcher[@]}" "$moetrain" "${args[@]}" >"$work/$name.log" 2>&1
  else
    "$mpiexec" -np "$world" "${mpi_flags[@]}" "$here/rank_exec.sh" "$work/$name" "${launcher[@]}" "$moetrain" "${args[@]}" \
      >"$work/$name.log" 2>&1
  fi
  rc=$?
}

expect_exit() {  # NAME EXPECTED
  [ "$rc" -eq "$2" ] || fail "$1: expected exit $2, got $rc:
$(tail -n 30 "$work/$1.log")"
}

# losses NAME [RANK]: "step loss" lines of a rank's metrics.jsonl, the loss as written.
losses() {
  sed -n 's/^{"step":\([0-9]*\),"loss":\([^,}]*\)[,}].*/\1 \2/p' "$work/$1/rank${2:-0}/metrics.jsonl"
}

# Rank 0 alone writes the run directory's logs (the losses are global reductions, the same on
# every rank): no other rank may have written a metrics.jsonl.
expect_ranks_agree() {  # NAME WORLD
  local r
  for ((r = 1; r < $2; ++r)); do
    [ ! -e "$work/$1/rank$r/metrics.jsonl" ] || fail "$1: rank $r wrote a metrics.jsonl (only rank 0 may)"
  done
}

# expect_steps_equal A B FIRST LAST: steps FIRST..LAST of runs A and B have identical losses.
expect_steps_equal() {
  local a b
  a=$(losses "$1" | awk -v f="$3" -v l="$4" '$1 >= f && $1 <= l')
  b=$(losses "$2" | awk -v f="$3" -v l="$4" '$1 >= f && $1 <= l')
  [ "$(echo "$a" | grep -c .)" -eq $(($4 - $3 + 1)) ] || fail "$1 does not have steps $3..$4:
$(losses "$1")"
  [ "$a" == "$b" ] || fail "steps $3..$4: $1 and $2 differ:
$1:
$a
$2:
$b"
}

# expect_step_close A B STEP: the losses at STEP agree within relative 1e-5 (reduction order).
expect_step_close() {
  local a b
  a=$(losses "$1" | awk -v s="$3" '$1 == s { print $2 }')
  b=$(losses "$2" | awk -v s="$3" '$1 == s { print $2 }')
  [ -n "$a" ] && [ -n "$b" ] || fail "step $3 missing: $1 '$a', $2 '$b'"
  awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; m = (a < 0 ? -a : a);
                                    exit !(a == a && b == b && d <= 1e-5 * m) }' ||
    fail "step $3: $1 loss $a, $2 loss $b: not within relative 1e-5"
  echo "step $3: $1 $a, $2 $b"
}

expect_checkpoint() {  # DIR WORLD: committed, with one shard per rank of a WORLD-rank job
  [ -f "$1/manifest.json" ] || fail "$1 is not a committed checkpoint"
  local r
  for ((r = 0; r < $2; ++r)); do
    local shard
    shard=$(printf 'rank_%05d.safetensors' $r)
    [ -f "$1/$shard" ] || fail "$1 has no $shard"
    grep -q "\"$shard\"" "$1/manifest.json" || fail "$1/manifest.json does not list $shard"
  done
}

await_two_steps() {  # JOB: until rank 0 of the signalled run logged two steps; both ranks started
  local i
  for ((i = 0; i < 1200; ++i)); do
    [ -f "$work/signalled/rank0/metrics.jsonl" ] && [ "$(grep -c . "$work/signalled/rank0/metrics.jsonl")" -ge 2 ] && break
    sleep 0.05
  done
  [ -f "$work/signalled/pid.0" ] && [ -f "$work/signalled/pid.1" ] || { kill "$1"; fail "the ranks never started"; }
}

case $scenario in
  resume_w1 | resume_w4)
    if [ "$scenario" == resume_w1 ]; then layout=(1 1 1 4); else layout=(4 4 2 1); fi
    world=${layout[0]}
    # Straight: 10 steps, saving at 5 (and 10); saving does not change the run.
    train straight "${layout[@]}" --set train.steps=10 --set checkpoint.every=5 --set checkpoint.dir="$work/ckpt"
    expect_exit straight 0
    expect_checkpoint "$work/ckpt/step_5" "$world"
    expect_ranks_agree straight "$world"
    # Resumed from step 5 into a checkpoint directory of its own: 5 more steps.
    train resumed "${layout[@]}" --set train.steps=10 --set checkpoint.every=0 \
      --set checkpoint.resume="$work/ckpt/step_5" --set checkpoint.dir="$work/ckpt_resumed"
    expect_exit resumed 0
    expect_ranks_agree resumed "$world"
    [ "$(losses resumed | head -n 1 | cut -d' ' -f1)" == 6 ] || fail "the resumed run did not start at step 6"
    expect_steps_equal resumed straight 6 10
    ;;

  reshard)
    # World 4 saves at step 5 and continues to step 6: the reference.
    train w4 4 4 2 1 --set train.steps=6 --set checkpoint.every=5 --set checkpoint.dir="$work/ckpt"
    expect_exit w4 0
    expect_checkpoint "$work/ckpt/step_5" 4
    # Adapters and Adam moments of the experts were saved in 2 EP slices, the rest once.
    train w2 2 2 1 2 --set train.steps=6 --set checkpoint.every=0 \
      --set checkpoint.resume="$work/ckpt/step_5" --set checkpoint.dir="$work/ckpt_w2"
    expect_exit w2 0
    expect_ranks_agree w2 2
    train w1 1 1 1 4 --set train.steps=6 --set checkpoint.every=0 \
      --set checkpoint.resume="$work/ckpt/step_5" --set checkpoint.dir="$work/ckpt_w1"
    expect_exit w1 0
    [ "$(losses w2 | cut -d' ' -f1)" == 6 ] || fail "the world-2 run did not train exactly step 6"
    [ "$(losses w1 | cut -d' ' -f1)" == 6 ] || fail "the world-1 run did not train exactly step 6"
    expect_step_close w2 w4 6
    expect_step_close w1 w4 6
    # A documented reshard (the global batch kept) is not a changed config.
    ! grep -q "config differs" "$work/w2.log" "$work/w1.log" || fail "a reshard warned of a changed config:
$(grep -h "config differs" "$work/w2.log" "$work/w1.log")"
    # A sanity check that the comparison can fail: step 6 is not step 5.
    a=$(losses w4 | awk '$1 == 5 { print $2 }')
    b=$(losses w4 | awk '$1 == 6 { print $2 }')
    [ "$a" != "$b" ] || fail "steps 5 and 6 have the same loss: the data or the update does not move"
    ;;

  context_parallel_w4)
    hybrid=(--set "model.layers=[kda,mla]" --set model.kda.num_heads=2 --set model.kda.head_dim=8
            --set train.steps=6 --set checkpoint.every=3)
    train w1 1 1 1 4 "${hybrid[@]}" --set checkpoint.dir="$work/ckpt_w1"
    expect_exit w1 0
    # micro_batch 2 x world 4 / cp 2: the same global batch of 4 windows per step.
    train cp2 4 2 2 2 "${hybrid[@]}" --set parallel.cp=2 --set logging.level=info --set checkpoint.dir="$work/ckpt"
    expect_exit cp2 0
    expect_ranks_agree cp2 4
    grep -q "context parallel cp=2 .*balanced" "$work/cp2.log" || fail "the cp run did not report its layout:
$(tail -n 30 "$work/cp2.log")"
    for step in 1 2 3 4 5 6; do expect_step_close cp2 w1 $step; done
    expect_checkpoint "$work/ckpt/step_3" 4
    train resumed 1 1 1 4 "${hybrid[@]}" --set checkpoint.every=0 --set checkpoint.resume="$work/ckpt/step_3" \
      --set checkpoint.dir="$work/ckpt_resumed"
    expect_exit resumed 0
    ! grep -q "config differs" "$work/resumed.log" || fail "resuming at another cp warned of a changed config:
$(grep -h "config differs" "$work/resumed.log")"
    for step in 4 5 6; do expect_step_close resumed w1 $step; done
    # The balanced run's checkpoint resumed at cp 2 in the contiguous layout.
    train contiguous 4 2 2 2 "${hybrid[@]}" --set parallel.cp=2 --set parallel.cp_layout=contiguous \
      --set checkpoint.every=0 --set checkpoint.resume="$work/ckpt/step_3" --set checkpoint.dir="$work/ckpt_contiguous"
    expect_exit contiguous 0
    expect_ranks_agree contiguous 4
    for step in 4 5 6; do expect_step_close contiguous w1 $step; done
    # Refused before any work: what context parallelism does not split.
    train aux 2 1 1 4 "${hybrid[@]}" --set model.moe.aux_loss_coef=0.01 --set parallel.cp=2
    expect_exit aux 2
    grep -q "model.moe.aux_loss_coef = 0.01 needs each sequence" "$work/aux.log" || fail "no aux-loss refusal:
$(tail -n 20 "$work/aux.log")"
    echo "cp 2 (balanced) at world 4 trained as world 1; resumed at world 1 and at cp 2 contiguous; the aux loss refused"
    ;;

  signal_w2 | signal_all_w2)
    # A constant schedule, so the learning rate does not depend on train.steps: the signalled
    # run may be long and the comparison runs end just after its checkpoint.
    common=(--set train.schedule=constant --set checkpoint.every=0)
    train_args=(train --config "$config" --set parallel.fsdp=2 --set parallel.ep=2 --set data.micro_batch=2
                --set checkpoint.export_adapter=false "${common[@]}" --set train.steps=100000
                --set checkpoint.dir="$work/ckpt")
    "$mpiexec" -np 2 "${mpi_flags[@]}" "$here/rank_exec.sh" "$work/signalled" "$moetrain" "${train_args[@]}" \
      >"$work/signalled.log" 2>&1 &
    job=$!
    # After rank 0 logged two steps, SIGTERM rank 1 (signal_w2) or both ranks.
    await_two_steps "$job"
    if [ "$scenario" == signal_w2 ]; then victims=(1); else victims=(0 1); fi
    # One kill for all victims: signals sent by separate commands can be far enough apart on a
    # loaded machine that the ranks agree, save and exit on the first before the second arrives.
    pids=()
    for r in "${victims[@]}"; do pids+=("$(cat "$work/signalled/pid.$r")"); done
    kill -TERM "${pids[@]}"
    wait "$job"
    rc=$?
    expect_exit signalled 75
    grep -q "\[rank 1/2\] stopped by SIGTERM" "$work/signalled.log" || fail "rank 1 did not report the SIGTERM"
    if [ "$scenario" == signal_w2 ]; then
      grep -q "\[rank 0/2\] stopped by a signal on another rank" "$work/signalled.log" ||
        fail "rank 0 did not stop for rank 1's signal:
$(tail -n 30 "$work/signalled.log")"
    fi
    last=$(losses signalled | tail -n 1 | cut -d' ' -f1)
    expect_checkpoint "$work/ckpt/step_$last" 2
    [ "$(ls -d "$work"/ckpt/step_* | wc -l)" -eq 1 ] || fail "expected one checkpoint: $(ls "$work/ckpt")"
    expect_ranks_agree signalled 2
    end=$((last + 3))
    train reference 2 2 2 2 "${common[@]}" --set train.steps=$end --set checkpoint.dir="$work/ckpt_reference"
    expect_exit reference 0
    train resumed 2 2 2 2 "${common[@]}" --set train.steps=$end --set checkpoint.dir="$work/ckpt"
    expect_exit resumed 0
    expect_ranks_agree resumed 2
    expect_steps_equal signalled reference 1 "$last"
    expect_steps_equal resumed reference $((last + 1)) "$end"
    echo "signalled after step $last; resumed steps $((last + 1))..$end equal the uninterrupted run"
    ;;

  signal_mpirun_w2)
    # scripts/slurm/mpirun_preemptible.sh, as the multi-node batch script runs it: a SIGTERM to it
    # (what slurm sends the batch shell's job at preemption) makes every rank save, and the
    # launch exits 75, which a SIGTERM to mpirun itself does not (Open MPI's mpirun exits 1).
    train_args=(train --config "$config" --set parallel.fsdp=2 --set parallel.ep=2 --set data.micro_batch=2
                --set checkpoint.export_adapter=false --set checkpoint.every=0 --set train.steps=100000
                --set checkpoint.dir="$work/ckpt")
    MPIRUN="$mpiexec" "$here/../../scripts/slurm/mpirun_preemptible.sh" -np 2 "${mpi_flags[@]}" "$here/rank_exec.sh" "$work/signalled" \
      "$moetrain" "${train_args[@]}" >"$work/signalled.log" 2>&1 &
    job=$!
    await_two_steps "$job"
    kill -TERM "$job"
    wait "$job"
    rc=$?
    expect_exit signalled 75
    grep -q "\[rank 0/2\] stopped by SIGUSR1 after step [0-9]*: checkpoint .* is committed" "$work/signalled.log" ||
      fail "rank 0 did not save and stop:
$(tail -n 30 "$work/signalled.log")"
    last=$(losses signalled | tail -n 1 | cut -d' ' -f1)
    expect_checkpoint "$work/ckpt/step_$last" 2
    echo "SIGTERM to the launch script after step $last: saved, exit 75"
    ;;

  fault_w4_*)
    [[ $scenario =~ ^fault_w4_([0-9]+)_(.*)$ ]] || fail "expected fault_w4_<rank>_<phase>"
    rank=${BASH_REMATCH[1]} phase=${BASH_REMATCH[2]}
    train reference 4 4 2 1 --set train.steps=10 --set checkpoint.every=0 --set checkpoint.dir="$work/ckpt_reference"
    expect_exit reference 0
    # Saves at steps 3, 6, 9; the second save dies.
    launcher=(env "MOETRAIN_FAULT=kill:rank=$rank:phase=$phase:hit=2")
    train crashed 4 4 2 1 --set train.steps=10 --set checkpoint.every=3 --set checkpoint.dir="$work/ckpt"
    [ "$rc" -ne 0 ] || fail "the job survived the kill of rank $rank at $phase"
    launcher=()
    expect_checkpoint "$work/ckpt/step_3" 4
    [ ! -f "$work/ckpt/step_6/manifest.json" ] || [ "$phase" == before_latest ] ||
      fail "step_6 is committed although rank $rank died at $phase"
    expect_steps_equal crashed reference 1 6
    train resumed 4 4 2 1 --set train.steps=10 --set checkpoint.every=3 --set checkpoint.dir="$work/ckpt"
    expect_exit resumed 0
    expect_ranks_agree resumed 4
    first=$(losses resumed | head -n 1 | cut -d' ' -f1)
    # Killed before updating `latest`, step_6 was already committed (renamed): it is resumed.
    if [ "$phase" == before_latest ]; then expected_first=7; else expected_first=4; fi
    [ "$first" == "$expected_first" ] || fail "the resumed run started at step $first, not $expected_first"
    expect_steps_equal resumed reference "$first" 10
    leftovers=$(ls -d "$work"/ckpt/*.tmp "$work"/ckpt/*.deleting 2>/dev/null)
    [ -z "$leftovers" ] || fail "incomplete checkpoints not cleaned up: $leftovers"
    echo "rank $rank killed at $phase; resumed from step $((first - 1)); steps $first..10 equal the uninterrupted run"
    ;;

  hang_w1 | hang_w2)
    # A rank wedges during the second save (hang: it stops making progress but does not exit):
    # the watchdog (parallel.timeout_s = 3) must end the whole job well before mpirun's
    # --timeout, naming the phase, with the first checkpoint intact. World 2: rank 1 hangs after
    # writing its shard and rank 0 waits for it in the commit agreement; world 1: the only rank
    # hangs before writing the manifest.
    if [ "$scenario" == hang_w2 ]; then world=2 victim=1 phase=after_shard_write; else world=1 victim=0 phase=before_manifest; fi
    launcher=(env "MOETRAIN_FAULT=hang:rank=$victim:phase=$phase:hit=2")
    started=$SECONDS
    train hung "$world" "$world" 1 $((4 / world)) --set train.steps=10 --set checkpoint.every=3 \
      --set checkpoint.dir="$work/ckpt" --set parallel.timeout_s=3
    elapsed=$((SECONDS - started))
    launcher=()
    [ "$rc" -ne 0 ] && [ "$rc" -ne 75 ] || fail "expected the watchdog's failure exit, got $rc"
    [ "$elapsed" -lt 40 ] || fail "the job took $elapsed s to end; the watchdog should end it ~3 s after the hang"
    grep -q "no progress for [0-9]* s (parallel.timeout_s = 3) since this rank began: checkpoint save" "$work/hung.log" ||
      fail "no watchdog message naming the checkpoint phase:
$(tail -n 20 "$work/hung.log")"
    expect_checkpoint "$work/ckpt/step_3" "$world"
    [ ! -f "$work/ckpt/step_6/manifest.json" ] || fail "step_6 was committed although a rank hung during its save"
    echo "rank $victim hung at $phase; the job ended after $elapsed s with exit $rc; step_3 intact"
    ;;

  *) fail "unknown scenario" ;;
esac
echo "PASS ($scenario)"
