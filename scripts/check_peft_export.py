#!/usr/bin/env python3
"""Does PEFT load moetrain's exported adapter and compute what moetrain computes?

Run on a machine with torch, transformers 5 and peft, after the C++ test that writes the files:
    MOETRAIN_PEFT_EXPORT_DIR=/tmp/peft_export build/tests/test_peft_export_golden
    python3 scripts/check_peft_export.py /tmp/peft_export
The directory holds adapter/ (our export of the golden noqlora model's adapter, with untied
per-expert gate/up factors) and ours.safetensors (the batch and moetrain's logits). The base
model is tests/fixtures/golden/noqlora. Exit 0 when PEFT's logits match ours to 1e-4 of their
largest magnitude, 1 otherwise.
"""
import os
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    export_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MOETRAIN_PEFT_EXPORT_DIR", "/tmp/peft_export")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base_dir = os.path.join(repo, "tests", "fixtures", "golden", "noqlora")
    ours = load_file(os.path.join(export_dir, "ours.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(model, os.path.join(export_dir, "adapter"))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ours["input_ids"].long()).logits.float()
    expected = ours["logits"].float()
    scale = expected.abs().max().item()
    error = (logits - expected).abs().max().item() / scale
    # The same model without the adapter, to show the adapter matters at this tolerance.
    with model.disable_adapter(), torch.no_grad():
        base_logits = model(input_ids=ours["input_ids"].long()).logits.float()
    base_error = (base_logits - expected).abs().max().item() / scale
    print(f"PEFT logits vs moetrain: max |diff| / max |logit| = {error:.3e} (without the adapter: {base_error:.3e})")
    ok = error <= 1e-4 and base_error > 1e-3
    print("check_peft_export: " + ("OK" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
