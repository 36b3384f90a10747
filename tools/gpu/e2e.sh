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
# Then the `cpu` run with gradient accumulation (two micro-batches of 8 a step) on both devices
# (`cpu-acc`, `gpu-acc`), judged on its first ACC_STEPS steps' training losses (ACC_TOL below).
# Then a rank-adaptive run of 288 steps (early stage to step 50, then the late stage towards
# half the size, truncations every 10 steps: 23 on the CPU, S 3,312 → 840, so the GPU's step
# is planned again after each cut) on the CPU (`cpu-rank`), on the CPU with the fused FFN's
# backward in one lane instead of 8 (`cpu-rank-1lane`: COMERA_FFN_LANES=1, another order of a few
# sums) and on the GPU (`gpu-rank`), judged by judge_rank_runs.py: the GPU's losses, S, Ŝ,
# truncations and end ranks against the CPU's, within 4 times what the CPU's own two
# summation orders differ by (the derivation is in that script's doc).
# Then evaluation and prediction on the GPU (issue 48): `predict --device cuda` and
# `eval --device cuda` of the `cpu` run against the same commands on the CPU, judged: every
# probability within PREDICT_TOL (below) and the same label wherever the CPU's top two
# probabilities are further apart than twice that.
# Then masked-LM pre-training of two phases (sequences of 8 at batch 8, then 16 at batch 4:
# the GPU's plan is reshaped at the phase change) on both devices (`mlm-cpu`, `mlm-gpu`): the
# held-out losses reported side by side, and the GPU-trained model's `eval` on the GPU judged
# against its `eval` on the CPU (MLM_TOL below) with `predict --device cuda` filling a mask.
# Writes OUTDIR/e2e.json, OUTDIR/predict-device.json, OUTDIR/accumulation.json and a table on
# standard output; exits non-zero if a command failed, the GPU's predictions are out of
# tolerance, the accumulated run's early losses are or the rank-adaptive run is (the classifier
# runs' training differences are reported, not judged).
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
# Gradient accumulation: the same run's batches of 16 as two micro-batches of 8 each step.
run "$bin" train --config "$cfg" --quiet --out "$out/cpu-acc" --device cpu --set train.accumulate_steps=2
run "$bin" train --config "$cfg" --quiet --out "$out/gpu-acc" --device cuda --set train.accumulate_steps=2
# The rank-adaptive run: learns the task (validation accuracy 1.0) while its ranks shrink
# (measured on the CPU, 2026-11-29: 23 truncations, S 3,312 → 840).
rank_set=(--set rank.enabled=true --set rank.gamma=0.1 --set rank.late_after_steps=50
    --set rank.truncate_every=10 --set optim.lr_gates=0.02 --set rank.target_ratio=0.5
    --set train.epochs=16)
run "$bin" --threads 2 train --config "$cfg" --quiet --out "$out/cpu-rank" --device cpu "${rank_set[@]}"
run env COMERA_FFN_LANES=1 "$bin" --threads 2 train --config "$cfg" --quiet --out "$out/cpu-rank-1lane" --device cpu "${rank_set[@]}"
run "$bin" --threads 2 train --config "$cfg" --quiet --out "$out/gpu-rank" --device cuda "${rank_set[@]}"
# Masked-LM pre-training in two phases on a corpus of 40 small files of repeated patterns.
python3 - "$out" <<'EOF'
import os, sys
out = sys.argv[1]
words = ["fn", "let", "mut", "if", "else", "return", "match", "loop"]
specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
os.makedirs(os.path.join(out, "corpus"), exist_ok=True)
open(os.path.join(out, "corpus-vocab.txt"), "w").write("\n".join(specials + words) + "\n")
for i in range(40):
    lines = []
    for l in range(30):
        w = lambda k: words[(i + l * 3 + k) % 8]
        lines.append(f"let mut {w(0)} if {w(1)} else return {w(0)}")
    open(os.path.join(out, "corpus", f"f{i}.rs"), "w").write("\n".join(lines) + "\n")
open(os.path.join(out, "mlm.toml"), "w").write(f"""
[data]
source = "corpus"
corpus = ["{out}/corpus"]
extensions = ["rs"]
vocab = "{out}/corpus-vocab.txt"
valid_fraction = 0.2

[model]
head = "mlm"
vocab_size = {len(specials) + len(words)}
seq_len = 16
d_model = 16
heads = 2
ffn = 32
layers = 1
dropout = 0.1
tt_linear = true
ttm_embedding = true
attn_tt = {{ in_modes = [4, 4], out_modes = [4, 4], rank = 3 }}
ffn_up_tt = {{ in_modes = [4, 4], out_modes = [4, 8], rank = 3 }}
ffn_down_tt = {{ in_modes = [4, 8], out_modes = [4, 4], rank = 3 }}
word_ttm = {{ vocab_modes = [4, 4], dim_modes = [4, 4], rank = 3 }}
mlm_decoder_tt = {{ in_modes = [4, 4], out_modes = [4, 4], rank = 3 }}

[optim]
lr_cores = 0.01
lr_gates = 0.01
lr_other = 0.01

[train]
warmup_steps = 5
log_every = 5
out_dir = "{out}/unused-mlm"

[[train.phases]]
seq_len = 8
batch_size = 8
epochs = 3
max_steps_per_epoch = 10

[[train.phases]]
seq_len = 16
batch_size = 4
epochs = 2
max_steps_per_epoch = 10
""")
EOF
run "$bin" train --config "$out/mlm.toml" --quiet --out "$out/mlm-cpu" --device cpu
run "$bin" train --config "$out/mlm.toml" --quiet --out "$out/mlm-gpu" --device cuda
if [ -d "$out/mlm-gpu" ]; then
    "$bin" eval "$out/mlm-gpu" --batch-size 4 >"$out/mlm-gpu.eval-cpu.txt" 2>>"$out/commands.log" || failed=1
    "$bin" eval "$out/mlm-gpu" --batch-size 4 --device cuda >"$out/mlm-gpu.eval-gpu.txt" 2>>"$out/commands.log" \
        || { echo "FAILED: eval --device cuda of a masked-LM run" | tee -a "$out/commands.log"; failed=1; }
    "$bin" predict "$out/mlm-gpu" --device cuda "let mut [MASK] if" >"$out/mlm-gpu.predict-gpu.txt" \
        2>>"$out/commands.log" || { echo "FAILED: predict --device cuda of a masked-LM run" | tee -a "$out/commands.log"; failed=1; }
fi
# MLM_TOL: the device's logits are within 1e-4 of their largest magnitude of the CPU's
# (gpu_engine's mlm_evaluation_matches_the_cpu_forward), a log-softmax moves by at most twice
# that, and this model's logits stay below 5 in size: 1e-3 on the mean loss, printed to 4
# decimals (5e-5 of rounding).
MLM_TOL=1e-3 python3 - "$out" <<'EOF' || failed=1
import json, os, re, sys
out = sys.argv[1]
tol = float(os.environ["MLM_TOL"])
def held_out(run):
    p = os.path.join(out, run, "metrics.jsonl")
    if not os.path.exists(p):
        return None
    ev = [json.loads(l) for l in open(p) if '"kind":"eval"' in l]
    return ev[-1].get("valid_loss") if ev else None
def eval_loss(name):
    p = os.path.join(out, name)
    m = re.search(r"MLM loss ([0-9.]+)", open(p).read()) if os.path.exists(p) else None
    return float(m.group(1)) if m else None
cpu, gpu = held_out("mlm-cpu"), held_out("mlm-gpu")
ec, eg = eval_loss("mlm-gpu.eval-cpu.txt"), eval_loss("mlm-gpu.eval-gpu.txt")
print(f"masked LM, two phases: held-out loss cpu {cpu}, gpu {gpu} (reported, not judged)")
print(f"masked LM eval of the GPU-trained run: cpu {ec}, gpu {eg} (tolerance {tol})")
res = {"held_out_cpu": cpu, "held_out_gpu": gpu, "eval_cpu": ec, "eval_gpu": eg, "tolerance": tol}
json.dump(res, open(os.path.join(out, "mlm-device.json"), "w"), indent=1)
if ec is None or eg is None or abs(ec - eg) > tol:
    print("OUT OF TOLERANCE: the masked-LM eval on the GPU against the CPU's")
    sys.exit(1)
EOF
texts="$out/valid-texts.txt"
tail -n 50 "$out/train.tsv" | cut -f1 >"$texts"
for r in cpu gpu gpu-cpu cpu-gpu; do
    [ -d "$out/$r" ] || continue
    "$bin" predict "$out/$r" --json <"$texts" >"$out/$r.predict.jsonl" 2>>"$out/commands.log" || failed=1
done
# The GPU's evaluation pass on the run trained on the CPU (the same model file both ways).
"$bin" predict "$out/cpu" --json --device cuda --out "$out/cpu.predict-gpu.jsonl" <"$texts" \
    2>>"$out/commands.log" || { echo "FAILED: predict --device cuda" | tee -a "$out/commands.log"; failed=1; }
"$bin" eval "$out/cpu" >"$out/cpu.eval-cpu.txt" 2>>"$out/commands.log" || failed=1
"$bin" eval "$out/cpu" --device cuda >"$out/cpu.eval-gpu.txt" 2>>"$out/commands.log" \
    || { echo "FAILED: eval --device cuda" | tee -a "$out/commands.log"; failed=1; }
# PREDICT_TOL: the device's logits z agree with the CPU's within 1e-4 of max|z|
# (gpu_engine's inference_logits_match_the_cpu_forward_without_dropout, derived there); a
# softmax moves by |Δp_i| = p_i·|Δz_i − Σ_j p_j·Δz_j| ≤ 2·max|Δz|, so 1e-3 holds for logits
# up to |z| ≤ 5, which this small two-class model stays within (the script prints the
# largest logit gap, ln(p_max / p_min), so a miss from larger logits is told apart).
PREDICT_TOL=1e-3 python3 - "$out" <<'EOF'
import json, math, os, sys
out = sys.argv[1]
tol = float(os.environ["PREDICT_TOL"])
def rows(name):
    p = os.path.join(out, name)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
cpu, gpu = rows("cpu.predict.jsonl"), rows("cpu.predict-gpu.jsonl")
bad = []
if not cpu or len(cpu) != len(gpu):
    bad.append(f"{len(gpu)} GPU predictions for {len(cpu)} CPU ones")
dp, gap = 0.0, 0.0
for i, (c, g) in enumerate(zip(cpu, gpu)):
    pc, pg = c["probabilities"], g["probabilities"]
    d = max(abs(a - b) for a, b in zip(pc, pg))
    dp = max(dp, d)
    gap = max(gap, math.log(max(pc) / max(min(pc), 1e-30)))
    top = sorted(pc, reverse=True)
    if d > tol:
        bad.append(f"text {i + 1}: |Δp| {d:.3g} > {tol}")
    if c["label"] != g["label"] and (len(top) < 2 or top[0] - top[1] > 2 * tol):
        bad.append(f"text {i + 1}: label {g['label']} on the GPU, {c['label']} on the CPU")
def metrics(name):
    p = os.path.join(out, name)
    return open(p).read().strip() if os.path.exists(p) else None
res = {"predict_max_abs_diff": dp, "largest_logit_gap": gap, "tolerance": tol,
       "texts": len(cpu), "problems": bad,
       "eval_cpu": metrics("cpu.eval-cpu.txt"), "eval_gpu": metrics("cpu.eval-gpu.txt")}
json.dump(res, open(os.path.join(out, "predict-device.json"), "w"), indent=1)
print(f"predict --device cuda vs cpu: max |Δp| {dp:.3g} (tolerance {tol}), largest logit gap {gap:.2f}, {len(cpu)} texts")
print(f"eval cpu: {res['eval_cpu']}")
print(f"eval gpu: {res['eval_gpu']}")
for b in bad:
    print("OUT OF TOLERANCE:", b)
sys.exit(1 if bad else 0)
EOF
[ $? -eq 0 ] || failed=1
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
# ACC_TOL: gpu_engine's an_accumulated_step_matches_the_cpu_stepper holds the device's step
# loss within 1e-4 of the CPU's (relative) and its parameters after within the update's own
# rounding; before the two runs' float differences compound (the first few steps, as the
# rank-adaptive judge's early window), their logged losses agree within 1e-3 relative.
ACC_TOL=1e-3 ACC_STEPS=5 python3 - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
tol, steps = float(os.environ["ACC_TOL"]), int(os.environ["ACC_STEPS"])
def losses(run):
    p = os.path.join(out, run, "metrics.jsonl")
    if not os.path.exists(p):
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if r.get("kind") == "train"}
cpu, gpu = losses("cpu-acc"), losses("gpu-acc")
early = [s for s in sorted(cpu) if s <= steps]
bad = [] if early and set(early) <= set(gpu) else [f"steps missing: cpu {sorted(cpu)[:steps]}, gpu {sorted(gpu)[:steps]}"]
rel = {s: abs(gpu[s] - cpu[s]) / max(abs(cpu[s]), 1e-12) for s in early if s in gpu}
bad += [f"step {s}: loss {gpu[s]} on the GPU, {cpu[s]} on the CPU (rel {r:.2e} > {tol})" for s, r in rel.items() if r > tol]
allrel = [abs(gpu[s] - cpu[s]) / max(abs(cpu[s]), 1e-12) for s in cpu if s in gpu]
res = {"steps": len(cpu), "early_steps": early, "early_rel": rel, "tolerance": tol,
       "max_rel_all_steps": max(allrel) if allrel else None, "problems": bad}
json.dump(res, open(os.path.join(out, "accumulation.json"), "w"), indent=1)
print(f"accumulated (2 micro-batches): {len(cpu)} steps, first {len(early)} within {tol}: "
      f"max rel {max(rel.values()) if rel else None}; over all steps {res['max_rel_all_steps']} (reported)")
for b in bad:
    print("OUT OF TOLERANCE:", b)
sys.exit(1 if bad else 0)
EOF
[ $? -eq 0 ] || failed=1
if [ -d "$out/gpu-rank" ] && [ -d "$out/cpu-rank" ] && [ -d "$out/cpu-rank-1lane" ]; then
    python3 "$(dirname "$0")/judge_rank_runs.py" "$out/cpu-rank" "$out/cpu-rank-1lane" "$out/gpu-rank" \
        --json "$out/rank-judge.json" || failed=1
else
    echo "FAILED: the rank-adaptive runs are missing (see commands.log)"
    failed=1
fi
exit $failed
