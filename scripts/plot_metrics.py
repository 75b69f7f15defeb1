#!/usr/bin/env python3
"""Draws a moetrain run's metrics.jsonl as PNGs.

    scripts/plot_metrics.py RUN_DIR [RUN_DIR ...] [--out DIR]

One run: the PNGs go next to its metrics.jsonl. Several runs: their curves are overlaid (one
colour per run, with a legend) and the PNGs go to --out (default ./plots); each run still gets
its own expert-load heat map. Files (docs/METRICS.md describes the keys they come from):

    loss.png          loss per step (and the data's entropy floor, for synthetic data), with the
                      eval loss (eval_loss, data.eval) as points joined by a dashed line
    lr.png            learning rate
    grad_norm.png     gradient norm before clipping
    tokens_per_s.png  throughput
    mfu.png           model FLOPs utilisation (runs on a GPU only)
    expert_load.png   per MoE layer and step: the max and min expert load (expert_load_<run>.png
                      when several runs are given)

A figure whose keys no run has is left out, with a note. A run still being written (its last
line cut short) is read up to its last whole line; a resumed run's repeated steps keep the
latest line. Needs matplotlib (scripts/setup.sh installs python3-matplotlib); `--check` only
says whether it is there. Exit codes: 0 done, 1 matplotlib missing, 2 bad arguments, 3 no
metrics to draw.
"""

import argparse
import json
import math
import os
import sys

SYSTEM_PYTHON = "/usr/bin/python3"
SETUP_HINT = "run scripts/setup.sh (it installs the system package python3-matplotlib), or pip install matplotlib"


def import_pyplot():
    """pyplot on the Agg backend (no display needed), or None when matplotlib is missing.

    A python3 from pyenv or a venv does not see the system's python3-matplotlib: when this
    interpreter lacks matplotlib and the system's python3 is another one, this script runs
    again under it (once)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot

        return pyplot
    except ImportError:
        pass
    other = os.path.exists(SYSTEM_PYTHON) and os.path.realpath(SYSTEM_PYTHON) != os.path.realpath(sys.executable)
    if other and os.environ.get("MOETRAIN_PLOT_REEXEC") != "1":
        os.environ["MOETRAIN_PLOT_REEXEC"] = "1"
        os.execv(SYSTEM_PYTHON, [SYSTEM_PYTHON, os.path.abspath(__file__)] + sys.argv[1:])
    return None


def read_metrics(path):
    """The run's lines by step (the last line of a repeated step wins), in step order."""
    by_step = {}
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    # A file being written may end in a partial line; every whole line ends with "\n".
    last_whole = len(lines) - 1
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError:
            if number <= last_whole:
                print(f"plot_metrics: {path}:{number}: not a JSON object; line skipped", file=sys.stderr)
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def series(records, key):
    """(steps, values) where the key holds a finite number (NaN/Inf steps are written as null)."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def moving_average(values, window):
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


class Run:
    def __init__(self, path):
        self.metrics = path if os.path.isfile(path) else os.path.join(path, "metrics.jsonl")
        self.dir = os.path.dirname(os.path.abspath(self.metrics))
        self.label = os.path.basename(self.dir)
        self.records = read_metrics(self.metrics) if os.path.isfile(self.metrics) else []


def plot_curves(pyplot, runs, key, title, ylabel, path, scale=1.0, log_y=False, floor_key=None, eval_key=None):
    """One line per run that has `key`; noisy per-step values get a moving average on top. With
    eval_key, each run's evaluations too (a few steps only: points, dashed). Returns the names of
    the curves drawn (empty when no run has `key`)."""
    drawn = [(run, series(run.records, key)) for run in runs]
    drawn = [(run, s) for run, s in drawn if s[0]]
    if not drawn:
        return []
    curves = [key]
    figure, axes = pyplot.subplots(figsize=(8, 4.5))
    colours = pyplot.rcParams["axes.prop_cycle"].by_key()["color"]
    floors_drawn = []  # runs on the same data share one floor line
    for index, (run, (steps, values)) in enumerate(drawn):
        colour = colours[index % len(colours)]
        values = [v * scale for v in values]
        window = max(1, len(values) // 25)
        if window > 1:
            axes.plot(steps, values, color=colour, alpha=0.3, linewidth=0.8)
            axes.plot(steps, moving_average(values, window), color=colour, linewidth=1.6,
                      label=f"{run.label} (mean of {window} steps)")
        else:
            axes.plot(steps, values, color=colour, linewidth=1.6, marker="." if len(values) < 30 else None,
                      label=run.label)
        if eval_key:
            eval_steps, eval_values = series(run.records, eval_key)
            if eval_steps:
                axes.plot(eval_steps, [v * scale for v in eval_values], color=colour, linestyle="--", marker="o",
                          markersize=4, linewidth=1.2, label=f"{run.label}: {eval_key} (data.eval)")
                if eval_key not in curves:
                    curves.append(eval_key)
        if floor_key:
            _, floors = series(run.records, floor_key)
            if floors and all(abs(floors[-1] - drawn_floor) > 1e-9 for drawn_floor in floors_drawn):
                floors_drawn.append(floors[-1])
                axes.axhline(floors[-1], color=colour, linestyle="--", linewidth=1.0,
                             label=f"{run.label}: data entropy floor {floors[-1]:.3f}")
    if log_y and all(v > 0 for _, (_, values) in drawn for v in values):
        axes.set_yscale("log")
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return curves


def load_matrix(records, key, first, last):
    """[MoE layer][step - first] of the per-layer arrays, NaN where a step has none."""
    layers = max((len(r[key]) for r in records if isinstance(r.get(key), list)), default=0)
    matrix = [[float("nan")] * (last - first + 1) for _ in range(layers)]
    for record in records:
        values = record.get(key)
        if not isinstance(values, list):
            continue
        for layer, value in enumerate(values):
            if isinstance(value, (int, float)) and math.isfinite(value):
                matrix[layer][record["step"] - first] = float(value)
    return matrix


def plot_expert_load(pyplot, run, path):
    """Heat maps (MoE layer x step) of the max and the min expert load; 1 is a perfect balance."""
    records = [r for r in run.records if isinstance(r.get("expert_load_max"), list) and r["expert_load_max"]]
    if not records:
        return False
    first, last = records[0]["step"], records[-1]["step"]
    figure, (top, bottom) = pyplot.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    panels = [(top, "expert_load_max", "max over experts (1 = balanced, higher = hotter expert)", "magma"),
              (bottom, "expert_load_min", "min over experts (1 = balanced, 0 = an idle expert)", "viridis")]
    for axes, key, what, colour_map in panels:
        matrix = load_matrix(records, key, first, last)
        if not matrix:
            axes.set_visible(False)
            continue
        image = axes.imshow(matrix, aspect="auto", origin="lower", interpolation="nearest", cmap=colour_map,
                            extent=(first - 0.5, last + 0.5, -0.5, len(matrix) - 0.5))
        figure.colorbar(image, ax=axes, label="load / mean load")
        axes.set_ylabel("MoE layer")
        if len(matrix) <= 16:
            axes.set_yticks(range(len(matrix)))
        axes.set_title(f"{run.label}: expert load, {what}", fontsize="medium")
    bottom.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Files and keys: docs/METRICS.md.")
    parser.add_argument("runs", nargs="*", metavar="RUN_DIR", help="a run directory (or its metrics.jsonl)")
    parser.add_argument("--out", metavar="DIR",
                        help="where the PNGs go (default: next to metrics.jsonl for one run, ./plots for several)")
    parser.add_argument("--check", action="store_true", help="only check that matplotlib can be imported")
    args = parser.parse_args()

    pyplot = import_pyplot()
    if pyplot is None:
        tried = sys.executable
        if os.environ.get("MOETRAIN_PLOT_REEXEC") == "1" and os.path.realpath(sys.executable) == os.path.realpath(
                SYSTEM_PYTHON):
            tried += " (nor for the python3 this was started with)"
        print(f"plot_metrics: matplotlib is not installed for {tried}: {SETUP_HINT}", file=sys.stderr)
        return 1
    if args.check:
        print(f"plot_metrics: matplotlib {sys.modules['matplotlib'].__version__} ({sys.executable})")
        return 0
    if not args.runs:
        parser.print_usage(sys.stderr)
        print("plot_metrics: give at least one RUN_DIR", file=sys.stderr)
        return 2

    runs = []
    for path in args.runs:
        run = Run(path)
        if not os.path.isfile(run.metrics):
            print(f"plot_metrics: {run.metrics}: no such file (is {path} a run directory, logging.run_dir?)",
                  file=sys.stderr)
            return 2
        if not run.records:
            print(f"plot_metrics: {run.metrics}: no finished step yet; left out", file=sys.stderr)
            continue
        runs.append(run)
    if not runs:
        print("plot_metrics: no metrics to draw", file=sys.stderr)
        return 3
    labels = [run.label for run in runs]
    if len(set(labels)) < len(labels):  # same directory names: tell them apart by path
        for run, path in zip(runs, args.runs):
            run.label = os.path.normpath(path)

    out = args.out or (runs[0].dir if len(args.runs) == 1 else "plots")
    os.makedirs(out, exist_ok=True)
    figures = [
        ("loss.png", dict(key="loss", title="training and eval loss", ylabel="loss (nats per target token)",
                          floor_key="loss_floor", eval_key="eval_loss")),
        ("lr.png", dict(key="lr", title="learning rate", ylabel="lr")),
        ("grad_norm.png", dict(key="grad_norm", title="gradient norm (before clipping)", ylabel="global L2 norm",
                               log_y=True)),
        ("tokens_per_s.png", dict(key="tokens_per_s", title="throughput", ylabel="tokens / s")),
        ("mfu.png", dict(key="mfu", title="model FLOPs utilisation", ylabel="MFU (%)", scale=100.0)),
    ]
    written, missing = [], []
    for name, options in figures:
        path = os.path.join(out, name)
        curves = plot_curves(pyplot, runs, path=path, **options)
        if curves:
            written.append(f"{path} ({', '.join(curves)})")
        else:
            missing.append(path)
    for run in runs:
        name = "expert_load.png" if len(runs) == 1 else f"expert_load_{safe_name(run.label)}.png"
        path = os.path.join(out, name)
        (written if plot_expert_load(pyplot, run, path) else missing).append(path)
    for path in written:
        print(f"plot_metrics: wrote {path}")
    for path in missing:
        print(f"plot_metrics: no data for {os.path.basename(path)} (its keys are not in the metrics); not drawn")
    return 0


def safe_name(label):
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label).strip("._") or "run"


if __name__ == "__main__":
    sys.exit(main())
