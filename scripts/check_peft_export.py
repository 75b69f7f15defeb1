#!/usr/bin/env python3
"""Does PEFT load moetrain's exported adapter and compute what moetrain computes?

Run on a machine with torch, transformers 5 and peft, after the C++ test that writes the files:
    MOETRAIN_PEFT_EXPORT_DIR=/tmp/peft_export build/tests/test_peft_export_golden
    python3 scripts/check_peft_export.py /tmp/peft_export
The directory holds adapter/ (our export of the golden noqlora model's adapter, with untied
per-expert gate/up factors, in the per-expert layout), adapter_transformers5/ (the same adapter in
the transformers 5 layout) and ours.safetensors (the batch and moetrain's logits), and
adapter_fused/ with ours_fused.safetensors: a model with PEFT's fused expert adapter
(lora.expert_gate_up: fused: gate_up_proj at rank 2r, alpha 2 alpha, a full B) exported and its
logits. The base model is tests/fixtures/golden/noqlora. Each adapter is loaded with PEFT and its
logits compared with ours (to 1e-4 of their largest magnitude); exit 0 when every one matches.
The per-expert layout is loaded only under transformers 4: transformers 5 has no per-expert
modules to put it on.
"""
import os
import sys

import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from export_check import check_logits, verdict


def main():
    export_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MOETRAIN_PEFT_EXPORT_DIR", "/tmp/peft_export")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base_dir = os.path.join(repo, "tests", "fixtures", "golden", "noqlora")
    ok = True
    layouts = [("adapter_transformers5", "ours.safetensors"), ("adapter_fused", "ours_fused.safetensors")]
    if int(transformers.__version__.split(".")[0]) < 5:
        layouts.insert(0, ("adapter", "ours.safetensors"))
    else:
        # transformers 5 fuses the routed experts into 3-D tensors, and PEFT maps per-expert
        # gate_proj/up_proj/down_proj targets onto them (leaving the dense MLP and shared experts
        # without adapters), so the per-expert layout cannot reproduce our logits here.
        print(f"adapter (per_expert layout, for transformers 4 and vLLM): not checked with transformers "
              f"{transformers.__version__} (docs/CHECKPOINTS.md)")
    for layout, ours_file in layouts:
        if not os.path.exists(os.path.join(export_dir, layout)):
            print(f"{layout}: missing from {export_dir} (run the C++ test first)")
            ok = False
            continue
        ours = load_file(os.path.join(export_dir, ours_file))
        expected = ours["logits"].float()
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
        try:
            model = PeftModel.from_pretrained(base, os.path.join(export_dir, layout))
        except Exception as e:  # report and go on: the other layout may load
            print(f"{layout}: PEFT could not load it: {type(e).__name__}: {e}")
            ok = False
            continue
        model.eval()
        # The rank PEFT gave each routed-expert gate_up adapter (2r in the fused layouts' rank_pattern).
        ranks = sorted({m.r["default"] for n, m in model.named_modules()
                        if type(m).__name__ == "ParamWrapper" and getattr(m, "parameter_name", "") == "gate_up_proj"})
        with torch.no_grad():
            logits = model(input_ids=ours["input_ids"].long()).logits.float()
            with model.disable_adapter():
                base_logits = model(input_ids=ours["input_ids"].long()).logits.float()
        good = check_logits(f"{layout}: PEFT logits vs moetrain", logits, base_logits, expected, "without the adapter",
                            f"; gate_up ranks {ranks}")
        ok = ok and good
    return verdict("check_peft_export", ok)

if __name__ == "__main__":
    sys.exit(main())
