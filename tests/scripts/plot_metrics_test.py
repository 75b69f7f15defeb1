#!/usr/bin/env python3
"""ctest `plot_metrics`: trains a few steps of the quickstart model (shorter windows) on the CPU, checks the
metrics lines the plots need and the plot command `moetrain train` prints, then renders the
plots of that run (and of it overlaid with a copy whose last line is cut short, as in a run still
being written) and checks every expected PNG: present, a PNG by its signature and header, and of
a real size. Uses only the standard library; matplotlib is the plot script's (scripts/setup.sh
installs it, and without it this test fails saying so).

    plot_metrics_test.py --moetrain BUILD/apps/moetrain --source REPO --work SCRATCH_DIR
"""

import json
import math
import os
import re
import struct
import subprocess
import sys

import script_test_args

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 6
EVAL_EVERY = 4  # evaluations after steps 4 and 6 (the last)
EVAL_WINDOWS = 3
CURVES = ["loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png"]

failures = []


def check(condition, message):
    if not condition:
        failures.append(message)
        print(f"FAILED: {message}", file=sys.stderr)
    return condition


def run(command, **kwargs):
    print("+ " + " ".join(command), flush=True)
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def check_png(path, min_bytes=8000, min_side=300):
    """Present, starts with the PNG signature and an IHDR of a real width and height, not tiny."""
    if not check(os.path.isfile(path), f"{path}: not written"):
        return
    with open(path, "rb") as f:
        head = f.read(24)
    size = os.path.getsize(path)
    check(head[:8] == PNG_SIGNATURE, f"{path}: no PNG signature (starts {head[:8]!r})")
    check(head[12:16] == b"IHDR", f"{path}: no IHDR chunk first")
    width, height = struct.unpack(">II", head[16:24]) if len(head) == 24 else (0, 0)
    check(width >= min_side and height >= min_side, f"{path}: {width} x {height} pixels, expected >= {min_side}")
    check(size >= min_bytes, f"{path}: {size} bytes, expected a real plot (>= {min_bytes})")
    print(f"ok: {path} ({width} x {height}, {size} bytes)")


def main():
    args = script_test_args.parse_args()
    plot_script = os.path.join(args.source, "scripts", "plot_metrics.py")

    probe = run([sys.executable, plot_script, "--check"])
    if probe.returncode != 0:
        print(probe.stdout + probe.stderr, file=sys.stderr)
        print("plot_metrics test: matplotlib is missing, so the plots cannot be checked: run scripts/setup.sh "
              "(it installs python3-matplotlib; CI runs it before the tests)", file=sys.stderr)
        return 1

    run_dir = os.path.join(args.work, "run")
    train = run([args.moetrain, "train", "--config", os.path.join(args.source, "configs", "quickstart.yaml"),
                 "--resume", "none", "--set", "train.device=cpu", "--set", f"train.steps={STEPS}",
                 "--set", "train.warmup_steps=2", "--set", "data.seq_len=64", "--set", "data.micro_batch=2",
                 "--set", "data.grad_accum=2", "--set", "checkpoint.every=0",
                 "--set", "data.eval.source=synthetic", "--set", f"data.eval.windows={EVAL_WINDOWS}",
                 "--set", f"train.eval_every={EVAL_EVERY}",
                 "--set", "checkpoint.export_adapter=false", "--set", f"logging.run_dir={run_dir}"])
    if not check(train.returncode == 0, f"moetrain train exited {train.returncode}"):
        print(train.stdout + train.stderr, file=sys.stderr)
        return 1
    output = train.stdout + train.stderr
    check(f"python3 scripts/plot_metrics.py {run_dir}" in output,
          "moetrain train did not print the plot command:\n" + output[-2000:])

    # Every layer after the first first_k_dense is a MoE layer (the resolved config the run wrote).
    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
        resolved = f.read()
    moe_layers = int(re.search(r"^  num_layers: (\d+)$", resolved, re.M).group(1)) - int(
        re.search(r"^  first_k_dense: (\d+)$", resolved, re.M).group(1))
    check(moe_layers > 0, f"the quickstart model has {moe_layers} MoE layers")

    metrics = os.path.join(run_dir, "metrics.jsonl")
    with open(metrics, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    check(len(lines) == STEPS, f"{metrics}: {len(lines)} lines, expected {STEPS}")
    for line in lines:
        for key in ("expert_load_max", "expert_load_min"):
            check(len(line.get(key, [])) == moe_layers, f"step {line.get('step')}: {key} = {line.get(key)}, "
                  f"expected {moe_layers} values")
        check(isinstance(line.get("loss_floor"), float) and 0 < line["loss_floor"] < line["loss"],
              f"step {line.get('step')}: loss_floor {line.get('loss_floor')} not a floor under loss {line.get('loss')}")
        evaluated = line.get("step") in (EVAL_EVERY, STEPS)
        check(("eval_loss" in line) == evaluated and ("eval_ppl" in line) == evaluated,
              f"step {line.get('step')}: eval keys {sorted(k for k in line if k.startswith('eval'))}, expected them "
              f"only on steps {EVAL_EVERY} and {STEPS}")
        if evaluated and isinstance(line.get("eval_loss"), float):
            check(line["loss_floor"] < line["eval_loss"] < 10 and
                  abs(line["eval_ppl"] - math.exp(line["eval_loss"])) <= 1e-9 * line["eval_ppl"],
                  f"step {line['step']}: eval_loss {line['eval_loss']}, eval_ppl {line.get('eval_ppl')}")
    check(re.search(r"step 4/6 \| loss [0-9.]+ .*\| eval loss [0-9.]+ \| eval ppl [0-9.]+ \| [0-9hms]+ elapsed \| eta [0-9hms]+",
                    output) is not None, "no progress line with the eval loss, elapsed time and ETA:\n" + output[-2000:])

    one = run([sys.executable, plot_script, run_dir])
    check(one.returncode == 0, f"plot_metrics.py {run_dir} exited {one.returncode}:\n{one.stdout}{one.stderr}")
    for name in CURVES + ["expert_load.png"]:
        check_png(os.path.join(run_dir, name))
    check(f"wrote {os.path.join(run_dir, 'loss.png')} (loss, eval_loss)" in one.stdout,
          "loss.png was drawn without the eval curve:\n" + one.stdout)
    # A CPU run has no MFU: that figure is left out, and the script says so.
    check(not os.path.exists(os.path.join(run_dir, "mfu.png")), "mfu.png drawn for a run without mfu")
    check("no data for mfu.png" in one.stdout, "no note that mfu.png was not drawn:\n" + one.stdout)

    # Several runs, one still being written: its last line is cut in the middle.
    partial_dir = os.path.join(args.work, "partial")
    os.makedirs(partial_dir)
    with open(metrics, encoding="utf-8") as f:
        text = f.read()
    cut = text.rstrip("\n").rfind("\n") + 40
    with open(os.path.join(partial_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
        f.write(text[:cut])
    compare_dir = os.path.join(args.work, "compare")
    both = run([sys.executable, plot_script, run_dir, partial_dir, "--out", compare_dir])
    check(both.returncode == 0, f"plot_metrics.py of two runs exited {both.returncode}:\n{both.stdout}{both.stderr}")
    check("not a JSON object" not in both.stderr, "the cut last line was reported as bad:\n" + both.stderr)
    for name in CURVES + ["expert_load_run.png", "expert_load_partial.png"]:
        check_png(os.path.join(compare_dir, name))

    missing = run([sys.executable, plot_script, os.path.join(args.work, "no_such_run")])
    check(missing.returncode == 2 and "no such file" in missing.stderr,
          f"a missing run directory: exit {missing.returncode}, stderr {missing.stderr!r} (expected 2, 'no such file')")

    print(f"plot_metrics test: {len(failures)} failed" if failures else "plot_metrics test: all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
