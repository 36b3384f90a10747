"""The authors' CoMERA training step on the CPU or a CUDA GPU (their public code, imported
unchanged).

Model: their paper model via utils.init_Transformer -- 6 post-LN encoders, d 768, 12 heads,
FFN 3072, 3 classes, TT rank 30 (linear layers), TTM rank 32 (word embedding); seq 128.
Step: zero_grad, forward with their config_forward (rank gates, prune_mask on), loss =
CE + 0.01 * their rank_loss, backward, AdamW with their three groups from run_MNLI.sh
(TT/TTM cores 1e-4, other parameters 5e-5, rank gates 1e-3; weight decay 0). Synthetic batch
(fixed seed). fp32. `--models dense` is the same code with tensorization off.

`--device cpu` (the default): eager, timed by the wall clock. Their code hard-codes 'cuda' in
one constructor (TensorizedEmbedding_order4.__init__); while the model is built (only then) a
TorchFunctionMode maps device 'cuda' to 'cpu'. The timed steps run with no mode active, so no
Python hook sits on the step's hot path.

`--device cuda` (cuda:0): `--modes eager,graph`. Eager: each step between two CUDA events.
Graph: their `_build_graph` recipe -- AdamW made capturable, 5 warm-up steps on a side stream,
one step (forward, loss, backward, AdamW) captured as a CUDA graph and replayed, each replay
between two CUDA events. Peak GPU memory: torch.cuda.max_memory_allocated over the arm.

Prints one JSON line per (model, batch, mode): median_ms, min_ms, max_ms, steps, warmup,
threads, peak_rss_bytes (getrusage ru_maxrss of this process so far: run one (model, batch)
per process for a clean per-model peak), peak_gpu_mib (cuda), n_params, loss, torch version.

usage: COMERA_SRC=/path/to/authors-CoMERA python3 tools/authors/step.py \
           --threads 2 --batch 1 --steps 20 --warmup 2 --models comera
       COMERA_SRC=... python3 tools/authors/step.py --device cuda --batch 1,32 --steps 50 \
           --models comera,dense --modes eager,graph
"""
import argparse
import importlib.machinery
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
import types

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument('--threads', type=int, default=2, help='torch.set_num_threads (inter-op threads: 1)')
ap.add_argument('--batch', default='1', help='batch size, or a comma list (e.g. 1,32)')
ap.add_argument('--steps', type=int, default=20, help='timed steps')
ap.add_argument('--warmup', type=int, default=2, help='untimed steps before timing')
ap.add_argument('--models', default='comera', help='comma list of comera (TT/TTM) and dense')
ap.add_argument('--seq', type=int, default=128)
ap.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
ap.add_argument('--modes', default='eager', help='comma list of eager and graph (graph: cuda only)')
a = ap.parse_args()
if a.device == 'cpu' and 'graph' in a.modes.split(','):
    sys.exit('--modes graph needs --device cuda')

src = os.environ.get('COMERA_SRC')
if not src or not os.path.isfile(os.path.join(src, 'MNLI_trainer.py')):
    sys.exit('set COMERA_SRC to a checkout of the authors\' repository (github.com/boopa5/CoMERA)')

import torch  # noqa: E402

torch.set_num_threads(a.threads)
torch.set_num_interop_threads(1)

# Their modules import packages the step never uses (transformers, datasets, tqdm): stub the
# ones that are not installed, so that torch + numpy suffice.
for name in ('transformers', 'datasets', 'tqdm'):
    try:
        __import__(name)
    except Exception:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)

        def _missing(attr, _n=name):
            if attr.startswith('__'):
                raise AttributeError(attr)
            def _unavailable(*x, **k):
                raise RuntimeError(f'{_n}.{attr} is stubbed out by step.py')
            return _unavailable
        m.__getattr__ = _missing
        sys.modules[name] = m

sys.path.insert(0, src)
import utils as comera_utils  # noqa: E402  (theirs)
import MNLI_trainer  # noqa: E402  (theirs)

from torch.overrides import TorchFunctionMode  # noqa: E402


class CudaToCpu(TorchFunctionMode):
    """Maps device='cuda' (and Tensor.to('cuda')) to the CPU; used only while building."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if isinstance(kwargs.get('device'), (str, torch.device)) and 'cuda' in str(kwargs['device']):
            kwargs['device'] = 'cpu'
        if func is torch.Tensor.to:
            args = tuple('cpu' if (i > 0 and 'cuda' in str(x)) else x for i, x in enumerate(args))
        return func(*args, **kwargs)


dev = torch.device('cuda:0' if a.device == 'cuda' else 'cpu')
if a.device == 'cuda':
    print(json.dumps({'gpu': torch.cuda.get_device_name(0), 'torch': torch.__version__}), flush=True)


def build(model_kind, B):
    torch.manual_seed(0)
    tz = model_kind == 'comera'
    if a.device == 'cuda':
        model = comera_utils.init_Transformer(emb_tensorized=tz, encoder_tensorized=tz, r=30,
                                              num_class=3, n_layers=6).to(dev)
    else:
        with CudaToCpu():
            model = comera_utils.init_Transformer(emb_tensorized=tz, encoder_tensorized=tz,
                                                  r=30, num_class=3, n_layers=6).to(dev)
    for mod in model.modules():  # everything on the device asked for
        for v in list(vars(mod).values()) + list(mod.parameters(recurse=False)):
            if isinstance(v, torch.Tensor) and v.device.type != dev.type:
                raise RuntimeError(f'tensor on {v.device} in {type(mod).__name__}')
    model.train()
    pt, po, pr = comera_utils.split_tensor_rank_params(model)
    groups = [g for g in [{'params': pt, 'lr': 1e-4, 'weight_decay': 0},
                          {'params': po, 'lr': 5e-5, 'weight_decay': 0},
                          {'params': pr, 'lr': 1e-3, 'weight_decay': 0}] if g['params']]
    opt = torch.optim.AdamW(groups)
    targs = types.SimpleNamespace(emb_tensorized=tz, encoder_tensorized=tz, prune_rank=tz,
                                  batch_size=B, max_len=a.seq, print_every=10 ** 9)
    tr = MNLI_trainer.Transformer_MNLI_Trainer.__new__(MNLI_trainer.Transformer_MNLI_Trainer)
    tr.args, tr.gpu_id, tr.model, tr.optimizer = targs, 0, model, opt
    tr.loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100)
    tr._build_config_forward(targs)
    n_params = sum(p.numel() for p in model.parameters())
    return tr, n_params


def make_batch(B):
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 30522, (B, a.seq), generator=g)
    lab = torch.randint(0, 3, (B,), generator=g)
    attn = torch.ones((B, a.seq), dtype=torch.int)
    seg = torch.zeros((B, a.seq), dtype=torch.int)
    seg[:, a.seq // 2:] = 1
    return tuple(x.to(dev) for x in (ids, lab, attn, seg))


def step(tr, ids, lab, attn, seg):
    tr.optimizer.zero_grad(set_to_none=True)
    y = tr.model(ids, mask=attn, seg=seg, config_forward=tr.config_forward)
    loss = tr.loss_fn(y, lab) + 0.01 * tr.rank_loss()
    loss.backward()
    tr.optimizer.step()
    return loss


def wall_times(fn, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1000)
    return ts


def event_times(fn, n):
    ts = []
    for _ in range(n):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return ts


def graph_step(tr, batch):
    """Their _build_graph recipe: capturable AdamW, warm-up on a side stream, one captured step."""
    for group in tr.optimizer.param_groups:
        group['capturable'] = True
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(5):
            step(tr, *batch)
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    tr.optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(g, stream=side):
        ids, lab, attn, seg = batch
        y = tr.model(ids, mask=attn, seg=seg, config_forward=tr.config_forward)
        loss = tr.loss_fn(y, lab) + 0.01 * tr.rank_loss()
        loss.backward()
        tr.optimizer.step()
    return g, loss


for model_kind in a.models.split(','):
    if model_kind not in ('comera', 'dense'):
        sys.exit(f'unknown model {model_kind!r} (comera, dense)')
    for B in [int(x) for x in a.batch.split(',')]:
        for mode in a.modes.split(','):
            if mode not in ('eager', 'graph'):
                sys.exit(f'unknown mode {mode!r} (eager, graph)')
            tr = None
            try:
                if a.device == 'cuda':
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                tr, n_params = build(model_kind, B)
                batch = make_batch(B)
                if mode == 'graph':
                    g, loss = graph_step(tr, batch)
                    for _ in range(max(a.warmup, 1)):
                        g.replay()
                    torch.cuda.synchronize()
                    ts = event_times(g.replay, a.steps)
                else:
                    for _ in range(a.warmup):
                        step(tr, *batch)
                    timer = event_times if a.device == 'cuda' else wall_times
                    out = []
                    ts = timer(lambda: out.append(step(tr, *batch)), a.steps)
                    loss = out[-1]
                r = dict(side='authors', device=a.device, model=model_kind, batch=B, mode=mode,
                         seq_len=a.seq, median_ms=statistics.median(ts), min_ms=min(ts),
                         max_ms=max(ts), steps=a.steps, warmup=a.warmup,
                         threads=torch.get_num_threads(),
                         interop_threads=torch.get_num_interop_threads(),
                         peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                         n_params=n_params, loss=float(loss.detach()), torch=torch.__version__,
                         python=platform.python_version())
                if a.device == 'cuda':
                    r['peak_gpu_mib'] = torch.cuda.max_memory_allocated() / 2 ** 20
            except Exception as e:  # report and go on to the next arm
                traceback.print_exc()
                r = dict(side='authors', device=a.device, model=model_kind, batch=B, mode=mode,
                         error=repr(e)[:300])
            print(json.dumps(r), flush=True)
            del tr
