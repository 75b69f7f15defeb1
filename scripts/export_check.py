"""The verdict that scripts/check_merged_export.py and scripts/check_peft_export.py share: logits of a
Hugging Face load of moetrain's export against moetrain's own, and the base model's against them too
(it must differ, or the comparison would pass without the adapter)."""


def compare_logits(logits, base_logits, expected, tolerance=1e-4):
    """(error, base_error, good): max |diff| / max |expected logit| of logits and of base_logits;
    good when the first is within tolerance and the second above 1e-3 (the adapter matters)."""
    scale = expected.abs().max().item()
    error = (logits - expected).abs().max().item() / scale
    base_error = (base_logits - expected).abs().max().item() / scale
    return error, base_error, error <= tolerance and base_error > 1e-3


def verdict(tool, ok):
    """Prints the last line and returns the exit status."""
    print(f"{tool}: " + ("OK" if ok else "MISMATCH"))
    return 0 if ok else 1
