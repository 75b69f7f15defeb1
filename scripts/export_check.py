"""The verdict that scripts/check_merged_export.py and scripts/check_peft_export.py share: logits of a
Hugging Face load of moetrain's export against moetrain's own, and the base model's against them too
(it must differ, or the comparison would pass without the adapter)."""


def check_logits(head, logits, base_logits, expected, base_label, tail="", tolerance=1e-4):
    """Whether logits match expected (max |diff| / max |expected logit| within tolerance) while
    base_logits do not (above 1e-3: the adapter matters); prints one line that starts with head."""
    scale = expected.abs().max().item()
    error = (logits - expected).abs().max().item() / scale
    base_error = (base_logits - expected).abs().max().item() / scale
    good = error <= tolerance and base_error > 1e-3
    print(f"{head}: max |diff| / max |logit| = {error:.3e} ({base_label}: {base_error:.3e}{tail}): "
          f"{'OK' if good else 'MISMATCH'}")
    return good


def verdict(tool, ok):
    """Prints the last line and returns the exit status."""
    print(f"{tool}: " + ("OK" if ok else "MISMATCH"))
    return 0 if ok else 1
