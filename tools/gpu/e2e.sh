#!/usr/bin/env bash
# One run trained on the GPU and the same run on the CPU, and runs moved between the two
# through their checkpoints, from a prebuilt `comera` binary (building nothing):
#
#   tools/gpu/e2e.sh COMERA_BINARY OUTDIR
#
# Writes a small sentiment-like TSV and its vocabulary (no network), a TT/TTM classifier config
# (2 post-LN blocks, dropout 0.1, rank schedule off: what the GPU path takes), then trains
#   cpu      every step on the CPU
#   gpu      every step on the GPU (--device cuda)
#   gpu-cpu  6 steps on the GPU, stopped, resumed on the CPU to the end
#   cpu-gpu  6 steps on the CPU, stopped, resumed on the GPU to the end
# and compares each with `cpu`: the logged training losses, the final validation loss and
# accuracy, and `predict --json` probabilities on the validation texts (max |difference|).
# Writes OUTDIR/e2e.json and a table on standard output; exits non-zero if a command failed
# (the differences are reported, not judged: their tolerance is to be derived from them and
# from the step test's, docs/gpu.md).
set -uo pipefail
[ $# -eq 2 ] || { sed -n '2,4p' "$0" >&2; exit 2; }
bin="$1"
out="$2"
mkdir -p "$out"
python3 - "$out" <<'EOF'
import random, sys, os
out = sys.argv[1]
words = ["the", "film", "was", "plot", "acting", "and", "really", "quite", "story", "very"]
vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "great", "bad", "awful"] + words
open(os.path.join(out, "vocab.txt"), "w").write("\n".join(vocab) + "\n")
rng = random.Random(7)
rows = ["sentence\tlabel"]
for i in range(400):
    pos = i % 2 == 0
    key = rng.choice(["good", "great"] if pos else ["bad", "awful"])
    body = [rng.choice(words) for _ in range(rng.randint(3, 10))]
    body.insert(rng.randint(0, len(body)), key)
    rows.append(" ".join(body) + "\t" + ("pos" if pos else "neg"))
open(os.path.join(out, "train.tsv"), "w").write("\n".join(rows) + "\n")
open(os.path.join(out, "run.toml"), "w").write(f"""
[data]
source = "tsv"
train = "{out}/train.tsv"
text_a = "sentence"
label = "label"
labels = ["neg", "pos"]
vocab = "{out}/vocab.txt"
valid_fraction = 0.25

[model]
vocab_size = {len(vocab)}
seq_len = 16
d_model = 32
heads = 4
ffn = 64
layers = 2
dropout = 0.1
tt_linear = true
ttm_embedding = true
attn_tt = {{ in_modes = [4, 8], out_modes = [4, 8], rank = 4 }}
ffn_up_tt = {{ in_modes = [4, 8], out_modes = [8, 8], rank = 4 }}
ffn_down_tt = {{ in_modes = [8, 8], out_modes = [4, 8], rank = 4 }}
word_ttm = {{ vocab_modes = [3, 7], dim_modes = [4, 8], rank = 4 }}

[optim]
lr_cores = 0.01
lr_gates = 0.01
lr_other = 0.01
clip_norm = 1.0

[rank]
enabled = false

[train]
epochs = 2
batch_size = 16
warmup_steps = 4
log_every = 1
checkpoint_every = 6
out_dir = "{out}/unused"
""")
EOF
failed=0
run() {
    echo "+ $*" >>"$out/commands.log"
    "$@" >>"$out/commands.log" 2>&1 || { echo "FAILED: $*" | tee -a "$out/commands.log"; failed=1; }
}
cfg="$out/run.toml"
run "$bin" train --config "$cfg" --quiet --out "$out/cpu" --device cpu
run "$bin" train --config "$cfg" --quiet --out "$out/gpu" --device cuda
run "$bin" train --config "$cfg" --quiet --out "$out/gpu-cpu" --device cuda --stop-after-steps 6
run "$bin" train --resume "$out/gpu-cpu" --quiet --device cpu
run "$bin" train --config "$cfg" --quiet --out "$out/cpu-gpu" --device cpu --stop-after-steps 6
run "$bin" train --resume "$out/cpu-gpu" --quiet --device cuda
texts="$out/valid-texts.txt"
tail -n 50 "$out/train.tsv" | cut -f1 >"$texts"
for r in cpu gpu gpu-cpu cpu-gpu; do
    [ -d "$out/$r" ] || continue
    "$bin" predict "$out/$r" --json <"$texts" >"$out/$r.predict.jsonl" 2>>"$out/commands.log" || failed=1
done
python3 - "$out" <<'EOF'
import json, sys, os
out = sys.argv[1]
def records(run, kind):
    p = os.path.join(out, run, "metrics.jsonl")
    if not os.path.exists(p):
        return []
    return [r for r in map(json.loads, open(p)) if r.get("kind") == kind]
def probs(run):
    p = os.path.join(out, run + ".predict.jsonl")
    return [json.loads(l)["probabilities"] for l in open(p)] if os.path.exists(p) else []
base = {r["step"]: r["loss"] for r in records("cpu", "train")}
base_eval = records("cpu", "eval")
base_p = probs("cpu")
result = {}
for run in ["gpu", "gpu-cpu", "cpu-gpu"]:
    tr = {r["step"]: r["loss"] for r in records(run, "train")}
    common = sorted(set(tr) & set(base))
    rel = [abs(tr[s] - base[s]) / max(abs(base[s]), 1e-12) for s in common]
    ev = records(run, "eval")
    p = probs(run)
    dp = [abs(a - b) for x, y in zip(p, base_p) for a, b in zip(x, y)]
    result[run] = {
        "steps_compared": len(common),
        "train_loss_max_rel_diff": max(rel) if rel else None,
        "train_loss_rel_diff_by_step": {s: r for s, r in zip(common, rel)},
        "final_valid_loss": ev[-1].get("valid_loss") if ev else None,
        "final_valid_accuracy": ev[-1].get("valid_accuracy") if ev else None,
        "predict_probabilities_max_abs_diff": max(dp) if dp else None,
        "predict_texts": len(p),
    }
result["cpu"] = {
    "final_valid_loss": base_eval[-1].get("valid_loss") if base_eval else None,
    "final_valid_accuracy": base_eval[-1].get("valid_accuracy") if base_eval else None,
}
json.dump(result, open(os.path.join(out, "e2e.json"), "w"), indent=1)
print("run       steps  max rel Δ train loss  valid loss  valid acc  max |Δ p| predict")
for run in ["cpu", "gpu", "gpu-cpu", "cpu-gpu"]:
    r = result[run]
    print(f"{run:8}  {r.get('steps_compared', '-')!s:>5}  {r.get('train_loss_max_rel_diff')!s:>20}  "
          f"{r['final_valid_loss']!s:>10}  {r['final_valid_accuracy']!s:>9}  {r.get('predict_probabilities_max_abs_diff')!s}")
EOF
exit $failed
