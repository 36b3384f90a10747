"""Forward + backward of TT linear layers on 2 CPU threads: comera.torch.TTLinear against the
CoMERA authors' TT layer (PyTorch) and tensorly-torch's TT FactorizedLinear.

    python python/bench/tt_layers.py --authors-dir /tmp/comera-authors

`--authors-dir` is a checkout of https://github.com/ziyangjoy/CoMERA (its
`tensor_layers_CoMERA` package is imported from there; nothing of it lives in this
repository). Without it the authors' arm is skipped.

Shapes (the paper's BERT-base layers): 768×768 (in modes 12·8·8, out modes 8·8·12) and
768×3072 (out modes 16·16·12), rank 30 on every inner bond, input 32 × 128 tokens, rank gates
applied by every arm that has them (comera, the authors'). Each iteration is
`y = layer(x); y.backward(dy)` with x requiring grad (dX is computed, as inside a network).
Arms are interleaved in blocks: each round runs every arm in turn for `--block` timed
iterations after `--block-warmup` untimed ones, each round starting one arm later than the
last (so that no arm always runs right after the same one); the table gives the median (and
min) ms per timed iteration.

Why blocks: torch's OpenMP worker threads keep spinning for several ms after a torch
operation (libgomp's default spin count; about 7 ms on Zen 3, where `pause` is slow), so an
arm that follows a torch arm immediately shares the 2 cores with a spinning thread. With
`--block 1 --block-warmup 0` (round-robin, every iteration right after another arm) comera's
layer measured 1.26x slower at 768x768 than in blocks (22.3 against 17.6 ms), while the
authors' layer took the same time both ways. Blocks measure each layer
as a loop of that layer sees it; inside a model whose torch operations run between comera's
layers, set OMP_WAIT_POLICY=passive (or give torch fewer threads) to avoid the contention.
Not run in CI.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

THREADS = int(os.environ.get("COMERA_BENCH_THREADS", "2"))
# comera's rayon pool reads this when it starts: set before comera is imported.
os.environ.setdefault("RAYON_NUM_THREADS", str(THREADS))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

import torch  # noqa: E402

import comera.torch as ct  # noqa: E402

LAYERS = {
    "768x768": ((12, 8, 8), (8, 8, 12)),
    "768x3072": ((12, 8, 8), (16, 16, 12)),
}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def authors_layer(authors_dir: str, in_modes, out_modes, rank: int):
    """The authors' TensorizedLinear_module with rank parameters (gates), and the forward
    config that applies them (prune_mask=True, threshold 0.01, as in their training)."""
    if authors_dir not in sys.path:
        sys.path.insert(0, authors_dir)
    from tensor_layers_CoMERA.layers import TensorizedLinear_module  # type: ignore
    from tensor_layers_CoMERA.utils import config_class  # type: ignore

    shape = list(in_modes) + list(out_modes)
    ranks = [1] + [rank] * (len(shape) - 1) + [1]
    n, m = int(torch.tensor(in_modes).prod()), int(torch.tensor(out_modes).prod())
    cfg = config_class(shape=shape, ranks=ranks, build_rank_parameters=True)
    layer = TensorizedLinear_module(n, m, cfg, bias=True)
    fwd_cfg = config_class(prune_mask=True, threshold=1e-2)
    return layer, (lambda x: layer(x, config_forward=fwd_cfg))


def tltorch_layer(in_modes, out_modes, rank: int, implementation: str):
    import tltorch  # type: ignore

    # tltorch's TT layer for matrices is the TT-matrix ("blocktt") format: len(in_modes) cores
    # of shape (r, n_k, m_k, r'); ranks (1, r, …, r, 1).
    k = len(in_modes)
    layer = tltorch.FactorizedLinear(
        in_tensorized_features=tuple(in_modes),
        out_tensorized_features=tuple(out_modes),
        factorization="blocktt",
        rank=(1,) + (rank,) * (k - 1) + (1,),
        implementation=implementation,
    )
    return layer, layer


def check_authors_agree(ours: ct.TTLinear, theirs, call, x: torch.Tensor) -> float:
    """Copies our cores, gates and bias into the authors' layer: the two must compute the same
    y (same layout conventions), else the comparison would be meaningless."""
    with torch.no_grad():
        for f, c in zip(theirs.tensor.factors, ours.cores):
            f.copy_(c)
        for d, g in zip(theirs.tensor.rank_parameters, ours.gates):
            d.copy_(g)
        theirs.bias.copy_(ours.bias)
        a, b = ours(x), call(x)
    return float((a - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--authors-dir", default=None, help="checkout of ziyangjoy/CoMERA")
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30, help="timed iterations per arm")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block", type=int, default=5, help="timed iterations of an arm per round")
    ap.add_argument("--block-warmup", type=int, default=2,
                    help="untimed iterations of an arm at the start of each of its blocks")
    ap.add_argument("--layers", default=",".join(LAYERS), help="comma-separated: " + ", ".join(LAYERS))
    ap.add_argument("--tltorch-factorized", action="store_true",
                    help="also time tltorch's implementation='factorized' (about 25x slower than "
                    "its 'reconstructed' one here: seconds per iteration)")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense nn.Linear reference")
    args = ap.parse_args()

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    print(f"CPU: {cpu_model()}; threads: torch {torch.get_num_threads()}, "
          f"RAYON_NUM_THREADS={os.environ['RAYON_NUM_THREADS']}; torch {torch.__version__}")
    print(f"input {args.batch} x {args.seq} tokens, rank {args.rank}, forward + backward (dX and "
          f"all parameter gradients), median of {max(1, args.reps // args.block) * args.block} after "
          f"{args.warmup} warm-up, in blocks of {args.block} (+{args.block_warmup} untimed); "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}\n")

    for name in args.layers.split(","):
        in_modes, out_modes = LAYERS[name]
        n = int(torch.tensor(in_modes).prod())
        m = int(torch.tensor(out_modes).prod())
        x = torch.randn(args.batch, args.seq, n, requires_grad=True)
        dy = torch.randn(args.batch, args.seq, m)

        arms: Dict[str, Tuple[torch.nn.Module, Callable]] = {}
        ours = ct.TTLinear(in_modes, out_modes, args.rank)
        arms["comera.torch.TTLinear"] = (ours, ours)
        if args.authors_dir:
            theirs, call = authors_layer(args.authors_dir, in_modes, out_modes, args.rank)
            err = check_authors_agree(ours, theirs, call, x[:2].detach())
            print(f"[{name}] authors' layer with comera's cores: relative difference {err:.2e}")
            assert err < 1e-4, "the authors' layer computes something else"
            arms["authors' TensorizedLinear_module"] = (theirs, call)
        impls = ["reconstructed"] + (["factorized"] if args.tltorch_factorized else [])
        for impl in impls:
            layer, call = tltorch_layer(in_modes, out_modes, args.rank, impl)
            arms[f"tltorch FactorizedLinear blocktt ({impl[:5]})"] = (layer, call)
        if not args.no_dense:
            dense = torch.nn.Linear(n, m)
            arms["dense nn.Linear (reference)"] = (dense, dense)

        def step(mod: torch.nn.Module, call: Callable) -> float:
            x.grad = None
            for p in mod.parameters():
                p.grad = None
            t0 = time.perf_counter()
            y = call(x)
            y.backward(dy)
            return time.perf_counter() - t0

        for mod, call in arms.values():
            for _ in range(args.warmup):
                step(mod, call)
        times: Dict[str, List[float]] = {k: [] for k in arms}
        # Each round starts one arm later, so that no arm always follows the same one (the
        # arm after a torch-heavy one shares the cores with its still-spinning threads).
        order = list(arms.items())
        for rnd in range(max(1, args.reps // args.block)):
            start = rnd % len(order)
            for k, (mod, call) in order[start:] + order[:start]:
                for _ in range(args.block_warmup):
                    step(mod, call)
                for _ in range(args.block):
                    times[k].append(step(mod, call))

        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{name}: comera path {ours.contraction_path(args.batch * args.seq)!r}")
        print(f"  {'arm':<40} {'median ms':>10} {'min ms':>8} {'vs comera':>10}")
        for k, v in times.items():
            print(f"  {k:<40} {med[k]:>10.2f} {min(v) * 1e3:>8.2f} {med[k] / med['comera.torch.TTLinear']:>9.2f}x")
        rivals = [k for k in med if k != "comera.torch.TTLinear" and not k.startswith("dense")]
        best = min(rivals, key=lambda k: med[k])
        print(f"  fastest other TT layer: {best} — comera is {med[best] / med['comera.torch.TTLinear']:.2f}x faster\n")


if __name__ == "__main__":
    main()
