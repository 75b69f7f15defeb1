#!/usr/bin/env python3
"""Does transformers, loading `moetrain merge`'s output with no adapter, compute what moetrain
computes with the adapter?

Run on a machine with torch and transformers 5, after the C++ test that writes the files:
    MOETRAIN_MERGE_EXPORT_DIR=/tmp/merge_export build/tests/test_merged_export
    python3 scripts/check_merged_export.py /tmp/merge_export
The directory holds one subdirectory per case of tests/unit/test_merged_export.cpp:
    noqlora/               deepseek_v3, per-expert experts, rank/alpha patterns
    noqlora_fused_rslora/  the same with rsLoRA and PEFT's fused gate_up expert adapter
    kimi_linear_t5/        kimi_linear in transformers 5's layout (fused 3-D experts), a shared expert A
each with merged/ (the merged Hugging Face directory: config.json, shards, index) and
ours.safetensors (input_ids and moetrain's logits with the adapter, an F64 forward stored as F32).
Each merged directory is loaded with AutoModelForCausalLM (float32, eager attention) and its logits
compared with ours: max |diff| / max |logit| <= 1e-4 is a match (the merged weights are F32, so
about 1e-7 is expected). The base model (tests/fixtures/golden/<fixture>) is run too, to show the
adapters matter (its difference must exceed 1e-3). Exit 0 when every case present matches, 1
otherwise; a case whose files are missing is reported and counts as a failure.
"""
import argparse
import os
import sys

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from export_check import check_logits, verdict

# case directory -> the golden fixture it was merged from
CASES = {
    "noqlora": "noqlora",
    "noqlora_fused_rslora": "noqlora",
    "kimi_linear_t5": "kimi_linear_t5",
}


def load(model_dir, device):
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", **kwargs)
    except TypeError:  # a transformers without experts_implementation
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    return model.to(device).eval()


def logits_of(model, input_ids, device):
    with torch.no_grad():
        return model(input_ids=input_ids.long().to(device)).logits.float().cpu()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export_dir", nargs="?", default=os.environ.get("MOETRAIN_MERGE_EXPORT_DIR", "/tmp/merge_export"))
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {args.device}")
    ok = True
    for case, fixture in CASES.items():
        merged_dir = os.path.join(args.export_dir, case, "merged")
        ours_file = os.path.join(args.export_dir, case, "ours.safetensors")
        if not (os.path.isdir(merged_dir) and os.path.isfile(ours_file)):
            print(f"{case}: missing from {args.export_dir} (run MOETRAIN_MERGE_EXPORT_DIR={args.export_dir} "
                  f"build/tests/test_merged_export first)")
            ok = False
            continue
        ours = load_file(ours_file)
        expected = ours["logits"].float()
        try:
            merged = load(merged_dir, args.device)
        except Exception as e:  # report and go on: the other cases may load
            print(f"{case}: transformers could not load {merged_dir}: {type(e).__name__}: {e}")
            ok = False
            continue
        logits = logits_of(merged, ours["input_ids"], args.device)
        del merged
        base_logits = logits_of(load(os.path.join(repo, "tests", "fixtures", "golden", fixture), args.device),
                                ours["input_ids"], args.device)
        if logits.shape != expected.shape:
            print(f"{case}: logits of shape {tuple(logits.shape)}, ours {tuple(expected.shape)}: MISMATCH")
            ok = False
            continue
        good = check_logits(f"{case}: merged model (transformers) vs moetrain with the adapter", logits, base_logits,
                            expected, "the base model alone", tolerance=args.tolerance)
        ok = ok and good
    return verdict("check_merged_export", ok)


if __name__ == "__main__":
    sys.exit(main())
