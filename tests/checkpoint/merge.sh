#!/bin/bash
# `moetrain merge` through the command line (docs/CHECKPOINTS.md "Merged export"), on a checkpoint
# trained for 2 steps on the golden noqlora model (a Hugging Face directory):
#   merge_cli   a merge writes config.json (the base's bytes), shards and an index, and no .tmp;
#               --max-shard-size cuts it into several shards holding the same tensors; merging
#               into the same --out again is exit 2 and leaves it as it was; a missing
#               --checkpoint is exit 4; a stale <out>.tmp of an interrupted merge is cleared
#   merge_w2    the same merge by 2 ranks under mpirun (each writes its shards) is byte for byte
#               the 1-rank merge
#
# usage: merge.sh SCENARIO MOETRAIN MPIEXEC BASE_DIR WORK [MPIEXEC FLAGS...]
set -u
scenario=$1 moetrain=$2 mpiexec=$3 base=$4 work=$5
shift 5
mpi_flags=("$@")
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

fail() {
  echo "FAIL ($scenario): $*" >&2
  exit 1
}

cat >train.yaml <<YAML
model: {hf_dir: $base}
lora: {rank: 4, alpha: 8.0, targets: [q_proj, kv_b_proj, o_proj, shared_experts, experts], rank_pattern: {o_proj: 2}}
data: {source: synthetic, seq_len: 16, micro_batch: 2}
train: {steps: 2, lr: 1.0e-2, warmup_steps: 1, device: cpu}
checkpoint: {export_adapter: false}
logging: {run_dir: run, every: 100, level: warn}
YAML
"$moetrain" train --config train.yaml >train.log 2>&1 || fail "training failed: $(tail -n 20 train.log)"

# merge NAME [FLAGS...]: sets $rc; output in NAME.log.
merge() {
  local name=$1
  shift
  "$moetrain" merge --checkpoint run/checkpoints "$@" >"$name.log" 2>&1
  rc=$?
}

case "$scenario" in
  merge_cli)
    merge one --out merged
    [ "$rc" -eq 0 ] || fail "merge: exit $rc: $(tail -n 20 one.log)"
    cmp -s merged/config.json "$base/config.json" || fail "config.json is not the base's"
    [ -f merged/model.safetensors.index.json ] || fail "no index"
    [ -f merged/model-00001-of-00001.safetensors ] || fail "no shard: $(ls merged)"
    [ ! -e merged.tmp ] || fail "merged.tmp left behind"
    [ ! -e merged/.moetrain-merge-in-progress ] || fail "the in-progress marker is in the result"
    grep -q '"model.layers.1.mlp.experts.3.up_proj.weight"' merged/model.safetensors.index.json ||
      fail "the index lacks an expert tensor"

    # A second merge into the same --out: refused, nothing touched.
    before=$(sha256sum merged/* | sha256sum)
    merge again --out merged
    [ "$rc" -eq 2 ] || fail "merge into an existing --out: expected exit 2, got $rc: $(cat again.log)"
    grep -q "never overwrites" again.log || fail "no fix in the message: $(cat again.log)"
    [ "$before" == "$(sha256sum merged/* | sha256sum)" ] || fail "the existing --out was changed"

    # A checkpoint that is not there: exit 4.
    "$moetrain" merge --checkpoint run/nothing --out other >missing.log 2>&1
    rc=$?
    [ "$rc" -eq 4 ] || fail "missing --checkpoint: expected exit 4, got $rc: $(cat missing.log)"
    [ ! -e other ] && [ ! -e other.tmp ] || fail "a failed merge left a directory"

    # Several shards: the same tensors (the index's weight maps name the same keys).
    mkdir -p sharded.tmp && touch sharded.tmp/.moetrain-merge-in-progress sharded.tmp/half-written.safetensors
    merge sharded --out sharded --max-shard-size 40KB
    [ "$rc" -eq 0 ] || fail "sharded merge: exit $rc: $(tail -n 20 sharded.log)"
    [ ! -e sharded/half-written.safetensors ] || fail "the stale sharded.tmp was not cleared"
    shards=$(ls sharded/model-*-of-*.safetensors | wc -l)
    [ "$shards" -ge 3 ] || fail "--max-shard-size 40KB gave $shards shard(s)"
    keys() { grep -o '"model[^"]*": ' "$1" | sort; }
    [ "$(keys merged/model.safetensors.index.json)" == "$(keys sharded/model.safetensors.index.json)" ] ||
      fail "the sharded merge holds other tensors"

    "$moetrain" merge --checkpoint run/checkpoints --out bad --max-shard-size lots >bad.log 2>&1
    rc=$?
    [ "$rc" -eq 2 ] || fail "--max-shard-size lots: expected exit 2, got $rc"
    ;;
  merge_w2)
    merge one --out w1 --max-shard-size 40KB
    [ "$rc" -eq 0 ] || fail "1-rank merge: exit $rc: $(tail -n 20 one.log)"
    "$mpiexec" -np 2 "${mpi_flags[@]}" "$moetrain" merge --checkpoint run/checkpoints --out w2 --max-shard-size 40KB \
      >two.log 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || fail "2-rank merge: exit $rc: $(tail -n 20 two.log)"
    shards=$(ls w1/model-*-of-*.safetensors | wc -l)
    [ "$shards" -ge 3 ] || fail "only $shards shard(s): the ranks had nothing to share"
    diff -r w1 w2 >diff.log 2>&1 || fail "the 2-rank merge differs from the 1-rank merge: $(cat diff.log)"
    ;;
  *)
    fail "unknown scenario"
    ;;
esac
echo "PASS ($scenario)"
