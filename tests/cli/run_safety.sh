#!/bin/bash
# A new user's sequences through `moetrain train` (docs/CHECKPOINTS.md, "The run directory"):
#   readme        the README's two commands: the quickstart, then the same run directory with
#                 lora.rank 16: exit 2 naming lora.rank (8 -> 16) and the fix, not a bare exit 4
#   fresh         --resume none where checkpoints are: exit 2, nothing touched; with
#                 checkpoint.overwrite=true they are moved aside and the run starts afresh
#   lock          a run directory held by a live process (its lock file flock-ed): exit 2 naming
#                 the owner; once it is gone the next run takes the lock over
#   output_paths  checkpoint.export_adapter or checkpoint.dir naming a regular file: exit 2
#                 before step 1 (no metrics written)
#   nothing       resuming a run at step 3 with train.steps 2: exit 2, "nothing to do"
#   every_zero    checkpoint.every 0 saves at the end on one rank
# usage: run_safety.sh SCENARIO MOETRAIN CONFIG WORK
set -u
scenario=$1 moetrain=$2 config=$3 work=$4
rm -rf "$work" && mkdir -p "$work" || exit 1
run="$work/run"

fail() {
  echo "FAIL ($scenario): $*" >&2
  exit 1
}

# train EXPECTED_EXIT [args...]: a 3-step quickstart run in $run (stderr in $work/last.log).
train() {
  local expected=$1
  shift
  "$moetrain" train --config "$config" --set train.steps=3 --set train.warmup_steps=1 --set data.seq_len=32 \
    --set logging.every=1 --set logging.run_dir="$run" "$@" >/dev/null 2>"$work/last.log"
  local rc=$?
  [ "$rc" -eq "$expected" ] || fail "expected exit $expected, got $rc ($*):
$(tail -n 20 "$work/last.log")"
}

expect_log() {  # REGEX
  grep -Eq "$1" "$work/last.log" || fail "the output does not say /$1/:
$(tail -n 20 "$work/last.log")"
}

case "$scenario" in
  readme)
    train 0
    train 2 --set train.steps=50 --set lora.rank=16
    expect_log "it differs in lora.rank: 8 -> 16"
    expect_log "use another logging.run_dir"
    ;;

  fresh)
    train 0
    [ -f "$run/checkpoints/step_3/manifest.json" ] || fail "no final checkpoint"
    listing=$(ls -R "$run/checkpoints")
    train 2 --resume none
    expect_log "holds checkpoints of another run \(steps 3\)"
    expect_log "checkpoint.overwrite=true"
    [ "$(ls -R "$run/checkpoints")" == "$listing" ] || fail "a refused start changed the checkpoints"
    train 0 --resume none --set checkpoint.overwrite=true
    expect_log "moved the checkpoints of steps 3 from"
    aside=$(ls -d "$run"/checkpoints.old-*) || fail "nothing moved aside"
    [ -f "$aside/step_3/manifest.json" ] || fail "the old checkpoint is not in $aside"
    ls "$run"/metrics.old-*.jsonl >/dev/null 2>&1 || fail "the old metrics.jsonl was not moved aside"
    [ "$(grep -c . "$run/metrics.jsonl")" -eq 3 ] || fail "metrics.jsonl holds more than the new run's 3 steps"
    ;;

  lock)
    mkdir -p "$run"
    echo "pid 4242 on host somewhere-else" >"$run/moetrain.lock"
    # One process that holds the flock for as long as it lives (killed below).
    python3 -c 'import fcntl, sys, time; f = open(sys.argv[1], "a"); fcntl.flock(f, fcntl.LOCK_EX); time.sleep(300)' \
      "$run/moetrain.lock" >/dev/null 2>&1 &
    holder=$!
    for ((i = 0; i < 400; ++i)); do flock -n "$run/moetrain.lock" true || break; sleep 0.05; done
    train 2
    kill "$holder"
    wait "$holder" 2>/dev/null
    expect_log "is in use by another run \(pid 4242 on host somewhere-else\)"
    train 0
    expect_log "took over the lock of a run that no longer holds it"
    [ ! -s "$run/moetrain.lock" ] || fail "the lock file still names an owner after the run: $(cat "$run/moetrain.lock")"
    ;;

  output_paths)
    mkdir -p "$run"
    touch "$work/a_file"
    train 2 --set checkpoint.export_adapter="$work/a_file"
    expect_log "checkpoint.export_adapter: $work/a_file exists and is not a directory"
    [ ! -e "$run/metrics.jsonl" ] || fail "steps ran before the export path was checked"
    train 2 --set checkpoint.dir="$work/a_file"
    expect_log "checkpoint.dir: $work/a_file exists and is not a directory"
    ;;

  nothing)
    train 0
    train 2 --set train.steps=2
    expect_log "nothing to do: .*step_3 is at step 3 and train.steps is 2"
    ;;

  every_zero)
    train 0 --set checkpoint.every=0 --set checkpoint.export_adapter=false
    [ -f "$run/checkpoints/step_3/manifest.json" ] || fail "checkpoint.every 0 did not save at the end"
    ;;

  *) fail "unknown scenario" ;;
esac
echo "PASS ($scenario)"
