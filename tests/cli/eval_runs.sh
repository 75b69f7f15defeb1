#!/bin/bash
# Evaluation (data.eval, docs/DATA.md) through `moetrain train` on the fixture dataset:
#   w1   the same 6 steps without eval, with a separate eval dataset every 2 steps, and with a
#        held-out 20% every 3 steps (vs the held-out run's twin without eval_every, which
#        evaluates only at the end): each pair trains exactly the same losses; eval_loss and
#        eval_ppl = exp(eval_loss) are on the evaluated steps' lines only; the progress lines show
#        the eval loss, the elapsed time and the ETA; the summary names tokens, tok/s, wall time,
#        the last checkpoint and the adapter
#   w2   the held-out run on 2 ranks (fsdp 2, ep 2; micro_batch 1, the same global batch) under
#        mpirun: its eval losses equal world 1's within relative 1e-5 (reduction order)
# usage: eval_runs.sh SCENARIO MOETRAIN CONFIG DATA WORK [MPIEXEC [MPIEXEC FLAGS...]]
set -u
scenario=$1 moetrain=$2 config=$3 data=$4 work=$5
shift 5
mpiexec=${1:-}
[ $# -gt 0 ] && shift
mpi_flags=("$@")
rm -rf "$work" && mkdir -p "$work" || exit 1

fail() {
  echo "FAIL ($scenario): $*" >&2
  exit 1
}

# train NAME WORLD MICRO_BATCH [--set ...]: $work/NAME is the run directory, $work/NAME.log the output.
train() {
  local name=$1 world=$2 micro_batch=$3
  shift 3
  local args=(train --config "$config" --resume none --set "data.source=$data" --set model.vocab_size=260
              --set train.steps=6 --set checkpoint.every=3 --set "data.micro_batch=$micro_batch"
              --set logging.every=1 --set logging.level=info --set "logging.run_dir=$work/$name" "$@")
  if [ "$world" -eq 1 ]; then
    "$moetrain" "${args[@]}" >"$work/$name.log" 2>&1
  else
    "$mpiexec" -np "$world" "${mpi_flags[@]}" "$moetrain" "${args[@]}" --set parallel.fsdp=2 --set parallel.ep=2 \
      >"$work/$name.log" 2>&1
  fi
  local rc=$?
  [ "$rc" -eq 0 ] || fail "$name: exit $rc:
$(tail -n 30 "$work/$name.log")"
}

# column NAME KEY: "step value" for every line of NAME's metrics.jsonl that has KEY, the value as written.
column() {
  sed -n "s/^{\"step\":\([0-9]*\),.*\"$2\":\([^,}]*\)[,}].*/\1 \2/p" "$work/$1/metrics.jsonl"
}

same_losses() {  # A B
  [ -n "$(column "$1" loss)" ] || fail "$1: no losses"
  [ "$(column "$1" loss)" = "$(column "$2" loss)" ] || fail "$2 trained other losses than $1:
$(paste <(column "$1" loss) <(column "$2" loss))"
}

evaluated_steps() {  # NAME EXPECTED ("2 4 6")
  local steps
  steps=$(column "$1" eval_loss | cut -d' ' -f1 | tr '\n' ' ' | sed 's/ $//')
  [ "$steps" = "$2" ] || fail "$1: eval_loss on steps '$steps', expected '$2'"
  [ "$(column "$1" eval_ppl | cut -d' ' -f1 | tr '\n' ' ' | sed 's/ $//')" = "$2" ] || fail "$1: eval_ppl steps differ"
  paste -d' ' <(column "$1" eval_loss) <(column "$1" eval_ppl) | awk -v name="$1" '
    { if (!($2 > 0 && $2 < 20) || ($4 - exp($2)) > 1e-9 * $4 || (exp($2) - $4) > 1e-9 * $4) {
        print name ": step " $1 ": eval_loss " $2 ", eval_ppl " $4 " is not exp(eval_loss)"; bad = 1 } }
    END { exit bad }' >&2 || fail "$1: eval_ppl"
}

case "$scenario" in
  w1)
    train plain 1 2 --set checkpoint.export_adapter=false
    train separate 1 2 --set "data.eval.source=$data" --set data.eval.windows=5 --set train.eval_every=2
    same_losses plain separate
    evaluated_steps separate "2 4 6"
    log="$work/separate.log"
    grep -Eq "eval: 5 windows of [^ ]*tiny \(10 documents" "$log" || fail "no eval set line in $log"
    grep -Eq "step 4/6 \| loss [0-9.]+ .*\| eval loss [0-9.]+ \| eval ppl [0-9.]+ \| [0-9hms]+ elapsed \| eta [0-9hms]+$" \
      "$log" || fail "no step-4 progress line with eval loss, elapsed and ETA in $log"
    grep -Eq "step 3/6 \| loss [0-9.]+ .*\| max load [0-9.]+ \| [0-9hms]+ elapsed \| eta [0-9hms]+$" "$log" ||
      fail "step 3 (no evaluation) has no plain progress line in $log"
    grep -Eq "summary: 192 tokens in 6 steps, [0-9hms]+ wall, [0-9.]+ tok/s; eval loss [0-9.]+ \(ppl [0-9.]+\); last checkpoint $work/separate/checkpoints/step_6 \(step 6\); adapter $work/separate/adapter$" \
      "$log" || fail "no summary line in $log:
$(tail -n 5 "$log")"
    grep -q "no adapter exported" "$work/plain.log" || fail "the summary does not say no adapter was exported"
    # Resuming with other eval settings continues the run as it was: no "config differs" warning,
    # and the summary counts this run's 2 steps only.
    "$moetrain" train --config "$config" --resume auto --set "data.source=$data" --set model.vocab_size=260 \
      --set train.steps=8 --set checkpoint.every=3 --set data.micro_batch=2 --set logging.level=info \
      --set "logging.run_dir=$work/separate" --set "data.eval.source=$data" --set data.eval.windows=2 \
      --set train.eval_every=1 >"$work/resumed.log" 2>&1 || fail "resume: exit $?: $(tail -n 20 "$work/resumed.log")"
    ! grep -q "config differs" "$work/resumed.log" || fail "changed eval settings were taken for a training change:
$(grep "config differs" "$work/resumed.log")"
    grep -Eq "summary: 64 tokens in 2 steps, .* \(this run: resumed at step 6\); eval loss" "$work/resumed.log" ||
      fail "no resumed-run summary: $(grep summary "$work/resumed.log")"
    evaluated_steps separate "2 4 6 7 8"
    # Held out: the training data changes (fewer documents), but evaluating more often does not.
    train holdout_end 1 2 --set data.eval.holdout=0.2
    train holdout 1 2 --set data.eval.holdout=0.2 --set train.eval_every=3
    same_losses holdout_end holdout
    evaluated_steps holdout_end "6"
    evaluated_steps holdout "3 6"
    [ "$(column holdout eval_loss | tail -n 1)" = "$(column holdout_end eval_loss)" ] || fail "the final eval differs"
    grep -q "(8 of 10 documents" "$work/holdout.log" || fail "training did not leave the held-out documents out"
    ;;
  w2)
    train holdout_w1 1 2 --set data.eval.holdout=0.2 --set train.eval_every=3
    train holdout_w2 2 1 --set data.eval.holdout=0.2 --set train.eval_every=3
    evaluated_steps holdout_w2 "3 6"
    paste -d' ' <(column holdout_w1 eval_loss) <(column holdout_w2 eval_loss) | awk '
      { d = $2 - $4; if (d < 0) d = -d; if (d > 1e-5 * $2) { print "step " $1 ": world 1 " $2 ", world 2 " $4; bad = 1 } }
      END { exit bad }' >&2 || fail "world 2's eval losses differ from world 1's"
    ;;
  *) fail "unknown scenario" ;;
esac
echo "PASS ($scenario)"
