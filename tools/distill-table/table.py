#!/usr/bin/env python3
"""The distillation tables of docs/results/pretrained-compression.md from run directories.

    python3 tools/distill-table/table.py RUNS/trec RUNS/reviews

Each directory holds `ARM-SEED` runs (ARM: teacher, kd, ft, scratch; with `lr3` appended, the
same at lr_other = 1e-3; kdfresh: distilled with a fresh head instead of the teacher's; kdX
for the distilled student at X× beside the main 10×; kdlong, ftlong: 5× the steps; kdprune:
imported at 5× and pruned to 10× by the rank schedule while distilled). Per arm: the mean and spread of the final validation
accuracy over seeds (the last evaluation, not the best: the validation set is the test set),
the parameters of the encoder blocks (`encoder.*`), of the embeddings and of the whole model
(from `model.safetensors`' header), and the wall time per run. Standard library only.
"""
import json
import re
import statistics
import struct
import sys
from pathlib import Path

ARMS = [
    ("teacher", "dense MiniLM fine-tuned (teacher)"),
    ("kd", "TT student distilled from the teacher"),
    ("kdfresh", "TT student distilled, fresh classifier head"),
    ("ft", "TT student fine-tuned without a teacher"),
    ("scratch", "same TT modes from scratch"),
    ("kdlr3", "TT student distilled, fresh head, lr_other 1e-3"),
    ("ftlr3", "TT student without a teacher, lr_other 1e-3"),
    ("scratchlr3", "same TT modes from scratch, lr_other 1e-3"),
    ("kdlong", "TT student distilled, 5× the steps"),
    ("ftlong", "TT student without a teacher, 5× the steps"),
    ("kdprune", "TT student imported at 5×, pruned to 10× while distilled"),
]


def param_counts(run: Path) -> dict:
    """Scalars by part, from the safetensors header (8-byte length, then JSON)."""
    with open(run / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    parts = {"blocks": 0, "embeddings": 0, "all": 0}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        size = 1
        for s in t["shape"]:
            size *= s
        parts["all"] += size
        if name.startswith("encoder."):
            parts["blocks"] += size
        elif name.startswith("embeddings."):
            parts["embeddings"] += size
    return parts


def runs_of(task: Path, arm: str) -> list:
    pat = re.compile(rf"^{re.escape(arm)}-(\d+)$")
    return sorted(p for p in task.iterdir() if pat.match(p.name) and finished(p))


def finished(run: Path) -> bool:
    """A run that ended (a stopped one also writes report.json, with `stopped` true)."""
    report = run / "report.json"
    return report.exists() and not json.loads(report.read_text())["stopped"]


def row(label: str, runs: list, dense_blocks: int) -> str:
    reports = [json.loads((r / "report.json").read_text()) for r in runs]
    acc = [r["final_valid"]["accuracy"] for r in reports]
    mean = statistics.mean(acc)
    spread = f" ± {statistics.stdev(acc):.4f}" if len(acc) > 1 else ""
    p = param_counts(runs[0])
    secs = statistics.mean(r["seconds"] for r in reports)
    teacher = [r.get("extra", {}).get("teacher") or r.get("teacher") for r in reports]
    tf = [t["forward_seconds"] for t in teacher if t]
    tnote = f" (teacher forward {statistics.mean(tf):.0f} s)" if tf else ""
    seeds = ", ".join(r.name.split("-")[-1] for r in runs)
    return (
        f"| {label} | {mean:.4f}{spread} | {seeds} | {p['blocks']:,} ({dense_blocks / p['blocks']:.1f}×) "
        f"| {p['embeddings']:,} | {p['all']:,} | {secs:.0f} s{tnote} |"
    )


def table(task: Path) -> str:
    teachers = runs_of(task, "teacher")
    if not teachers:
        return f"{task}: no teacher runs"
    dense_blocks = param_counts(teachers[0])["blocks"]
    lines = [
        f"**{task.name}**",
        "",
        "| arm | final accuracy (mean ± sd) | seeds | encoder blocks (vs dense) | embeddings | whole model | time per run |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, label in ARMS:
        runs = runs_of(task, arm)
        if runs:
            lines.append(row(label, runs, dense_blocks))
    for p in sorted(task.iterdir()):
        m = re.match(r"^kd(\d+)$", p.name.split("-")[0])
        if m and p.name.endswith("-0") and finished(p):
            lines.append(row(f"TT student at {m.group(1)}×, distilled", [p], dense_blocks))
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(Path(a)) for a in sys.argv[1:]))
