"""comera.torch: TT layers for PyTorch backed by comera's kernels.

Every gradient is checked against autograd through a dense reconstruction written here in
plain PyTorch (float64), in the layout conventions of comera's TtShape / TtmShape:
W = (H_1 ⋯ H_K) reshaped to (∏ in_modes, ∏ out_modes), E = the TTM chain with (v_k, e_k)
pairs, rows over vocab digits, columns over dim digits, first digit slowest.
"""

import copy
import math
import pickle

import pytest

torch = pytest.importorskip("torch")
ct = pytest.importorskip("comera.torch")

TAU = 0.01


# ---------------------------------------------------------------------------------------------
# References in plain PyTorch.


def gate(g, tau=TAU):
    return torch.where(g > tau, g, torch.zeros_like(g))


def ref_weight(cores, gates, n, m, tau=TAU):
    """W (n × m) from TT cores (r, s, r') with gates on the inner bonds."""
    h = [c * gate(g, tau) for c, g in zip(cores[:-1], gates)] + [cores[-1]]
    w = h[0]
    for c in h[1:]:
        w = torch.einsum("...a,abc->...bc", w, c)
    return w.reshape(n, m)


def ref_table(cores, gates, vocab_modes, dim_modes, rows, tau=TAU):
    """E (rows × D) from TTM cores (r, v, e, r')."""
    h = [c * gate(g, tau) for c, g in zip(cores[:-1], gates)] + [cores[-1]]
    t = h[0][0]  # (v1, e1, r1)
    for c in h[1:]:
        t = torch.einsum("...a,abcd->...bcd", t, c)
    p = len(h)
    t = t.reshape([x for pair in zip(vocab_modes, dim_modes) for x in pair])
    t = t.permute(*range(0, 2 * p, 2), *range(1, 2 * p, 2))
    return t.reshape(math.prod(vocab_modes), math.prod(dim_modes))[:rows]


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def randomise(layer, seed, prune=True):
    """Random cores (already), random gates with some entries pruned, random bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gt in layer.gates:
            gt.copy_(0.5 + torch.rand(gt.shape, generator=g))
            if prune and gt.numel() > 1:
                gt[0] = 0.005  # below τ: pruned
                gt[-1] = -0.3  # negative: pruned
        if getattr(layer, "bias", None) is not None:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))


# ---------------------------------------------------------------------------------------------
# TTLinear: forward and gradients.

SHAPES = [([4, 4], [2, 8], 3), ([4, 2, 2], [3, 5], [4, 3, 5, 2])]
# Row counts 5 and 6 take comera's sequential path, 30 the merged one, 1024 the dense one.
BATCHES = [(5,), (2, 3), (2, 15), (32, 32)]


@pytest.mark.parametrize("in_modes,out_modes,rank", SHAPES)
@pytest.mark.parametrize("lead", BATCHES)
def test_tt_linear_matches_autograd_through_dense_weight(in_modes, out_modes, rank, lead):
    torch.manual_seed(0)
    layer = ct.TTLinear(in_modes, out_modes, rank)
    randomise(layer, 1)
    n, m = layer.in_features, layer.out_features
    x = torch.randn(*lead, n, requires_grad=True)
    y = layer(x)
    assert y.shape == (*lead, m) and y.dtype == torch.float32
    dy = torch.randn_like(y)
    (y * dy).sum().backward()

    cores = [c.detach().double().requires_grad_() for c in layer.cores]
    gates = [g.detach().double().requires_grad_() for g in layer.gates]
    bias = layer.bias.detach().double().requires_grad_()
    xr = x.detach().double().requires_grad_()
    yr = xr @ ref_weight(cores, gates, n, m) + bias
    (yr * dy.double()).sum().backward()

    assert rel(y, yr) < 1e-5
    assert rel(x.grad, xr.grad) < 1e-5
    for c, cr in zip(layer.cores, cores):
        assert rel(c.grad, cr.grad) < 1e-5
    for g, gr in zip(layer.gates, gates):
        assert rel(g.grad, gr.grad) < 1e-5
        assert torch.all(g.grad[g.detach() <= TAU] == 0)  # pruned entries get nothing
    assert rel(layer.bias.grad, bias.grad) < 1e-5


def test_kernel_dense_weight_uses_the_same_layout():
    """comera's own dense W (from its TtShape conventions) equals the reference einsum."""
    torch.manual_seed(3)
    layer = ct.TTLinear([3, 4], [5, 2, 2], 4)
    randomise(layer, 3)
    w_comera = layer._kernel.dense_weight(
        [c.detach().numpy() for c in layer.cores], [g.detach().numpy() for g in layer.gates]
    )
    w_ref = ref_weight(list(layer.cores), list(layer.gates), 12, 20)
    assert rel(torch.from_numpy(w_comera), w_ref) < 1e-6
    assert rel(layer.dense_weight(), w_ref) < 1e-6


def test_tt_linear_without_bias_non_contiguous_input_and_frozen_parameters():
    torch.manual_seed(1)
    layer = ct.TTLinear([4, 4], [4, 4], 3, bias=False)
    assert layer.bias is None
    randomise(layer, 2)
    base = torch.randn(16, 7)
    x = base.t().requires_grad_()  # (7, 16), non-contiguous
    layer.cores[0].requires_grad_(False)
    y = layer(x)
    y.square().sum().backward()
    xr = x.detach().clone().requires_grad_()
    w = ref_weight([c.detach() for c in layer.cores], [g.detach() for g in layer.gates], 16, 16)
    yr = xr @ w
    yr.square().sum().backward()
    assert rel(y, yr) < 1e-5 and rel(x.grad, xr.grad) < 1e-5
    assert layer.cores[0].grad is None and layer.cores[1].grad is not None


def test_input_without_grad_and_empty_batch():
    layer = ct.TTLinear([4, 4], [2, 8], 3)
    x = torch.randn(3, 16)  # no grad wanted for x
    layer(x).sum().backward()
    assert all(c.grad is not None for c in layer.cores)
    y = layer(torch.randn(0, 16))
    assert y.shape == (0, 16)


@pytest.mark.parametrize("rows", [5, 30, 1024])
def test_two_forwards_before_a_backward_recompute(rows):
    """The workspace for a row count holds the last forward's intermediates; a backward of an
    earlier forward must recompute its own."""
    torch.manual_seed(2)
    layer = ct.TTLinear([4, 4], [2, 8], 3)
    randomise(layer, 4)
    x1 = torch.randn(rows, 16, requires_grad=True)
    x2 = 3.0 * torch.randn(rows, 16, requires_grad=True)
    y1, y2 = layer(x1), layer(x2)
    dy = torch.randn(rows, 16)
    (y1 * dy).sum().backward()
    g1 = [c.grad.clone() for c in layer.cores]
    layer.zero_grad()
    y1b = layer(x1)
    (y1b * dy).sum().backward()
    for a, b in zip(g1, layer.cores):
        assert rel(a, b.grad) < 1e-6
    # And y2's graph is still usable after; retain_graph gives the same grads twice.
    layer.zero_grad()
    y2.sum().backward(retain_graph=True)
    first = layer.cores[1].grad.clone()
    y2.sum().backward()
    assert rel(layer.cores[1].grad, 2 * first) < 1e-6


# ---------------------------------------------------------------------------------------------
# TTLinear trains like the same layer written in plain PyTorch.


class RefTT(torch.nn.Module):
    def __init__(self, tt):
        super().__init__()
        self.cores = torch.nn.ParameterList([torch.nn.Parameter(c.detach().clone()) for c in tt.cores])
        self.gates = torch.nn.ParameterList([torch.nn.Parameter(g.detach().clone()) for g in tt.gates])
        self.bias = torch.nn.Parameter(tt.bias.detach().clone())
        self.n, self.m = tt.in_features, tt.out_features
        self.out_features = tt.out_features

    def forward(self, x):
        return x @ ref_weight(list(self.cores), list(self.gates), self.n, self.m) + self.bias


class Net(torch.nn.Module):
    def __init__(self, tt):
        super().__init__()
        self.tt = tt
        self.head = torch.nn.Linear(tt.out_features, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.tt(x)))


def test_adamw_training_matches_plain_pytorch():
    torch.manual_seed(5)
    tt = ct.TTLinear([4, 2, 2], [4, 4], 4)
    randomise(tt, 5, prune=False)
    net = Net(tt)
    ref = Net(RefTT(tt))
    ref.head.load_state_dict(net.head.state_dict())
    x = torch.randn(4, 8, 16)
    labels = torch.randint(0, 3, (4, 8))
    opts = [torch.optim.AdamW(mod.parameters(), lr=1e-2, weight_decay=0.01) for mod in (net, ref)]
    losses = [[], []]
    for _ in range(50):
        for i, (mod, opt) in enumerate(zip((net, ref), opts)):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(mod(x).reshape(-1, 3), labels.reshape(-1))
            loss.backward()
            opt.step()
            losses[i].append(loss.item())
    assert losses[0][-1] < 0.7 * losses[0][0]  # it did train
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-4 * abs(b)


# ---------------------------------------------------------------------------------------------
# TTMEmbedding.

TTM = ([4, 5, 3], [2, 3, 2], 3, 50)


@pytest.mark.parametrize(
    "ids",
    [
        [[3, 17, 3, 0, 49, 17, 17], [5, 5, 5, 48, 0, 1, 2]],  # repeated ids
        list(range(50)),  # every id once
        [[[7]]],
    ],
)
def test_ttm_matches_autograd_through_dense_table(ids):
    vocab, dim, rank, rows = TTM
    torch.manual_seed(6)
    table = ct.TTMEmbedding(vocab, dim, rank, num_embeddings=rows)
    randomise(table, 6)
    ids = torch.tensor(ids)
    y = table(ids)
    assert y.shape == (*ids.shape, 12)
    dy = torch.randn_like(y)
    (y * dy).sum().backward()

    cores = [c.detach().double().requires_grad_() for c in table.cores]
    gates = [g.detach().double().requires_grad_() for g in table.gates]
    yr = ref_table(cores, gates, vocab, dim, rows)[ids]
    (yr * dy.double()).sum().backward()
    assert rel(y, yr) < 1e-5
    for c, cr in zip(table.cores, cores):
        assert rel(c.grad, cr.grad) < 1e-5
    for g, gr in zip(table.gates, gates):
        assert rel(g.grad, gr.grad) < 1e-5
    assert rel(table.dense_table(), ref_table(cores, gates, vocab, dim, rows)) < 1e-6


def test_ttm_two_forwards_before_backward_and_int32_ids():
    vocab, dim, rank, rows = TTM
    torch.manual_seed(7)
    table = ct.TTMEmbedding(vocab, dim, rank, num_embeddings=rows)
    a = torch.tensor([1, 2, 3, 1], dtype=torch.int32)
    b = torch.tensor([40, 41, 42, 43])
    ya, _ = table(a), table(b)
    ya.sum().backward()
    got = [c.grad.clone() for c in table.cores]
    table.zero_grad()
    table(a.long()).sum().backward()
    for x, c in zip(got, table.cores):
        assert rel(x, c.grad) < 1e-6


# ---------------------------------------------------------------------------------------------
# TT-SVD.


def test_from_linear_full_rank_reproduces_the_linear():
    torch.manual_seed(8)
    lin = torch.nn.Linear(16, 24)
    tt = ct.TTLinear.from_linear(lin, None, in_modes=[4, 4], out_modes=[4, 6])
    assert tt.ranks == (1, 4, 16, 6, 1)  # exact TT ranks of a generic 16 × 24 matrix
    x = torch.randn(3, 5, 16)
    assert rel(tt(x), lin(x)) < 1e-5
    assert rel(tt.to_linear().weight, lin.weight) < 1e-5
    assert tt.svd_rel_error < 1e-6


def test_from_linear_truncated_and_default_modes():
    torch.manual_seed(9)
    lin = torch.nn.Linear(64, 32, bias=False)
    tt = ct.TTLinear.from_linear(lin, 4)
    assert tt.in_modes == (4, 4, 4) and tt.out_modes == (4, 4, 2) and tt.bias is None
    assert max(tt.ranks) == 4
    err = rel(tt.dense_weight().t(), lin.weight)
    assert 0.1 < err < 1.0 and abs(err - tt.svd_rel_error) < 1e-3
    assert ct.balanced_modes(768) == [12, 8, 8]


def test_from_embedding_full_rank_reproduces_the_table():
    torch.manual_seed(10)
    emb = torch.nn.Embedding(50, 12)
    table = ct.TTMEmbedding.from_embedding(emb, [4, 5, 3], [2, 3, 2])
    ids = torch.tensor([[0, 49, 7, 7], [13, 2, 49, 31]])
    assert rel(table(ids), emb(ids)) < 1e-5


# ---------------------------------------------------------------------------------------------
# Errors: ValueError / TypeError with a message, never a crash.


def test_bad_inputs_raise():
    layer = ct.TTLinear([4, 4], [2, 8], 3)
    with pytest.raises(TypeError, match="float32"):
        layer(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="in_features = 16"):
        layer(torch.randn(2, 15))
    with pytest.raises(ValueError, match="in_features = 16"):
        layer(torch.tensor(1.0))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer([[0.0] * 16])
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer(torch.randn(2, 16).numpy())
    with pytest.raises(ValueError, match="CPU"):
        layer(torch.empty(2, 16, device="meta"))
    with pytest.raises(TypeError, match="float32"):
        copy.deepcopy(layer).double()(torch.randn(2, 16, dtype=torch.float64).float())
    with pytest.raises(ValueError):
        ct.TTLinear([4, 0], [4], 3)
    with pytest.raises(ValueError):
        ct.TTLinear([4, 4], [4], 0)
    with pytest.raises(ValueError):
        ct.TTLinear([4, 4], [4], [2, 2, 2])
    with pytest.raises(ValueError):
        ct.TTLinear([4], [4], 3, threshold=-1.0)
    with pytest.raises(TypeError):
        ct.TTLinear.from_linear(torch.nn.Conv1d(4, 4, 1), 2)
    with pytest.raises(ValueError, match="multiply"):
        ct.TTLinear.from_linear(torch.nn.Linear(16, 16), 2, in_modes=[4, 3])

    table = ct.TTMEmbedding([4, 5], [2, 3], 2, num_embeddings=18)
    with pytest.raises(TypeError, match="integer"):
        table(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="out of range"):
        table(torch.tensor([1, 18]))
    with pytest.raises(ValueError, match="out of range"):
        table(torch.tensor([-1, 2]))
    with pytest.raises(ValueError):
        ct.TTMEmbedding([4, 5], [2], 2)
    with pytest.raises(ValueError):
        ct.TTMEmbedding([4, 5], [2, 3], 2, num_embeddings=21)

    kernel = layer._kernel  # the raw kernel checks shapes too
    with pytest.raises(ValueError, match="shape"):
        kernel.forward(
            torch.zeros(2, 15).numpy(),
            [c.detach().numpy() for c in layer.cores],
            [g.detach().numpy() for g in layer.gates],
            None,
            torch.zeros(2, 16).numpy(),
        )
    with pytest.raises(ValueError, match="expected 4 arrays"):
        kernel.forward(
            torch.zeros(2, 16).numpy(), [], [], None, torch.zeros(2, 16).numpy()
        )


def test_copies_pickles_and_docs():
    torch.manual_seed(11)
    layer = ct.TTLinear([4, 4], [2, 8], 3)
    twin = pickle.loads(pickle.dumps(layer))
    clone = copy.deepcopy(layer)
    x = torch.randn(4, 16)
    assert torch.equal(twin(x), layer(x)) and torch.equal(clone(x), layer(x))
    layer.threshold = 2.0  # every gate (at 1) pruned: W = 0, y = bias
    assert torch.equal(layer(x), layer.bias.detach().expand(4, 16))
    assert layer.active_ranks() == [1, 0, 0, 0, 1]
    for obj in (ct.TTLinear, ct.TTLinear.forward, ct.TTLinear.from_linear, ct.TTMEmbedding,
                ct.TTMEmbedding.from_embedding, ct.TTLinear.dense_weight):
        assert obj.__doc__ and len(obj.__doc__) > 40


def test_concurrent_calls_from_threads():
    """The GIL is released during kernels and each kernel serialises its own state: calls on
    one layer from several threads give the single-threaded results."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(12)
    layer = ct.TTLinear([4, 4], [2, 8], 3)
    xs = [torch.randn(30, 16, requires_grad=True) for _ in range(8)]

    def run(x):
        y = layer(x)
        (dx,) = torch.autograd.grad(y.square().sum(), [x])
        return y.detach(), dx

    want = [run(x) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(run, xs))
    for (y, dx), (yw, dxw) in zip(got, want):
        assert torch.equal(y, yw) and torch.equal(dx, dxw)


def test_kernels_run_on_the_threads_set_with_the_same_bits():
    """set_num_threads gives the kernels a pool of that many threads; on the merged path the
    outputs and gradients are the same bits on any thread count (the row lanes of 300 rows)."""
    before = ct.get_num_threads()
    torch.manual_seed(13)
    layer = ct.TTLinear([12, 8, 8], [8, 8, 12], 6)
    randomise(layer, 14)
    x = torch.randn(300, 768, requires_grad=True)
    assert layer.contraction_path(300) == "merged"

    def run():
        x.grad = None
        layer.zero_grad()
        y = layer(x)
        y.backward(torch.ones_like(y))
        return [y.detach(), x.grad, *[p.grad for p in layer.parameters()]]

    try:
        results = []
        for threads in [1, 3]:
            ct.set_num_threads(threads)
            assert ct.get_num_threads() == threads
            results.append(run())
        for a, b in zip(*results):
            assert torch.equal(a, b)
        for bad, err in [(0, ValueError), (-2, ValueError), (True, TypeError), (1.5, TypeError)]:
            with pytest.raises(err):
                ct.set_num_threads(bad)
        assert ct.get_num_threads() == 3
    finally:
        ct.set_num_threads(before)


def test_size_measures():
    layer = ct.TTLinear([4, 3], [5], [1, 3, 2, 1])
    assert layer.size_l0() == sum(c.numel() for c in layer.cores) == 4 * 3 + 3 * 3 * 2 + 2 * 5
    with torch.no_grad():
        layer.gates[0].copy_(torch.tensor([1.0, 0.5, 0.0]))
        layer.gates[1].copy_(torch.tensor([0.2, 0.005]))
    # a = [1, 2, 1, 1] (ℓ0) and [1, 1.5, 0.2, 1] (ℓ1), as in comera's gates.rs test.
    assert layer.size_l0() == 4 * 2 + 3 * 2 + 5
    l1 = layer.size_l1()
    assert abs(l1.item() - (4 * 1.5 + 3 * 1.5 * 0.2 + 5 * 0.2)) < 1e-6
    l1.backward()
    assert abs(float(layer.gates[0].grad[0]) - (4 + 3 * 0.2)) < 1e-6
    assert float(layer.gates[0].grad[2]) == 0.0 and float(layer.gates[1].grad[1]) == 0.0
    table = ct.TTMEmbedding([4, 5], [2, 3], 2)
    assert table.size_l0() == sum(c.numel() for c in table.cores)


def test_activations_are_not_copied():
    """A contiguous input is used in place: the tensor saved for the backward is x's memory."""
    layer = ct.TTLinear([4, 4], [2, 8], 3)
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = layer(x)
    saved_x = y.grad_fn.saved_tensors[0]
    assert saved_x.data_ptr() == x.data_ptr()
    table = ct.TTMEmbedding([4, 5], [2, 3], 2)
    ids = torch.tensor([[1, 2], [3, 1]])
    e = table(ids)
    assert e.grad_fn.saved_tensors[0].data_ptr() == ids.data_ptr()


def test_outputs_reuse_freed_buffers_and_never_one_in_use():
    """Outputs (y, dx) come from a cache of freed buffers: a freed output's memory is reused by
    the next call of that size, an output still referenced is never handed out again, values
    are right after reuse, and the limit and `empty_cache` govern what is kept."""
    torch.manual_seed(0)
    layer = ct.TTLinear([4, 4], [2, 8], 3)
    ct.empty_cache()
    old_limit = ct.set_cache_limit(1 << 30)
    try:
        x1, x2 = torch.randn(6, 16), torch.randn(6, 16)
        y1 = layer(x1)
        want1 = y1.clone()
        p1 = y1.data_ptr()
        y2 = layer(x2)  # y1 is alive: y2 must have other memory
        assert y2.data_ptr() != p1
        assert torch.equal(y1, want1)
        del y1
        assert ct.cached_bytes() == 6 * 16 * 4
        y3 = layer(x1)  # reuses y1's buffer, stale values overwritten
        assert y3.data_ptr() == p1 and ct.cached_bytes() == 0
        assert torch.equal(y3, want1)
        # Views keep the buffer alive too.
        v = y3[2:4]
        del y3
        assert ct.cached_bytes() == 0
        assert torch.equal(v, want1[2:4])
        del v
        assert ct.cached_bytes() == 6 * 16 * 4
        # dx comes from the cache as well and is the input's gradient.
        x = x1.clone().requires_grad_(True)
        layer(x).sum().backward()  # y is freed after the statement; dx lives on as x.grad
        g = x.grad.clone()
        held = ct.cached_bytes()
        x.grad = None
        assert ct.cached_bytes() == held + 6 * 16 * 4
        xr = x1.clone().requires_grad_(True)
        (xr @ layer.dense_weight() + layer.bias).sum().backward()
        assert torch.allclose(g, xr.grad, rtol=1e-5, atol=1e-6)
        assert ct.empty_cache() > 0 and ct.cached_bytes() == 0
        # Limit 0: nothing is kept.
        assert ct.set_cache_limit(0) == 1 << 30
        del y2
        assert ct.cached_bytes() == 0
        with pytest.raises(ValueError):
            ct.set_cache_limit(-1)
    finally:
        ct.set_cache_limit(old_limit)
        ct.empty_cache()


# --- ranks and shapes in the state dict ------------------------------------------------------


def _pruned_compressed_model(seed=0):
    """Two TTLinear from TT-SVD of random Linears (non-uniform ranks), a gate entry pruned and
    truncated away in the first, a TTMEmbedding in front."""
    torch.manual_seed(seed)
    emb = ct.TTMEmbedding.from_embedding(torch.nn.Embedding(60, 64), [4, 4, 4], [4, 4, 4], rank=6)
    first = ct.TTLinear.from_linear(torch.nn.Linear(64, 128), rank=6)
    second = ct.TTLinear.from_linear(torch.nn.Linear(128, 64), rank=5, in_modes=[8, 4, 4], out_modes=[4, 4, 4])
    with torch.no_grad():
        first.gates[1][0] = 0.0  # pruned
        first.gates[1][2] = 0.5
        emb.gates[0][1] = -1.0
    return torch.nn.Sequential(emb, first, torch.nn.GELU(), second)


def test_state_dict_carries_the_ranks_after_from_linear_pruning_and_truncation():
    model = _pruned_compressed_model()
    ids = torch.randint(0, 60, (3, 7))
    before = model(ids)
    first_ranks, emb_ranks = list(model[1].ranks), list(model[0].ranks)
    assert model[1].truncate() == first_ranks[:2] + [first_ranks[2] - 1] + first_ranks[3:]
    assert model[0].truncate() == [1, emb_ranks[1] - 1] + emb_ranks[2:]
    after = model(ids)
    assert torch.allclose(before, after, atol=1e-5), (before - after).abs().max()
    assert model[1].gates[1].numel() == first_ranks[2] - 1

    fresh = torch.nn.Sequential(
        ct.TTMEmbedding([4, 4, 4], [4, 4, 4], rank=8, num_embeddings=60),
        ct.TTLinear([4, 4, 4], [8, 4, 4], rank=8),
        torch.nn.GELU(),
        ct.TTLinear([8, 4, 4], [4, 4, 4], rank=8),
    )
    assert fresh[1].ranks != model[1].ranks
    fresh.load_state_dict(model.state_dict())
    for a, b in zip(model, fresh):
        if hasattr(a, "ranks"):
            assert a.ranks == b.ranks and a.threshold == b.threshold
    assert torch.equal(fresh(ids), after)
    # The new parameters train: gradients reach them.
    fresh(ids).sum().backward()
    assert all(p.grad is not None for p in fresh[1].cores)


def test_a_whole_state_survives_torch_save_and_load_with_weights_only(tmp_path):
    model = _pruned_compressed_model(1)
    model[1].truncate()
    ids = torch.randint(0, 60, (2, 5))
    torch.save(model.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    fresh = _pruned_compressed_model(2)  # other values, and the first layer's untruncated ranks
    assert fresh[1].ranks != model[1].ranks
    fresh.load_state_dict(state)
    assert torch.equal(fresh(ids), model(ids))
    # The whole module pickled (the kernels are rebuilt on load).
    torch.save(model, tmp_path / "model.pt")
    again = torch.load(tmp_path / "model.pt", weights_only=False)
    assert torch.equal(again(ids), model(ids))


def test_a_mismatching_checkpoint_is_an_error():
    source = ct.TTLinear([4, 4, 4], [4, 4, 4], rank=3)
    with pytest.raises(RuntimeError, match=r"in_modes \[4, 4, 4\] and out_modes \[4, 4, 4\], this one \[8, 8\]"):
        ct.TTLinear([8, 8], [4, 4, 4], rank=3).load_state_dict(source.state_dict())
    with pytest.raises(RuntimeError, match="has bias, this one has no bias"):
        ct.TTLinear([4, 4, 4], [4, 4, 4], rank=3, bias=False).load_state_dict(source.state_dict())
    table = ct.TTMEmbedding([4, 4], [4, 4], rank=2, num_embeddings=10)
    with pytest.raises(RuntimeError, match="10 rows, this one"):
        ct.TTMEmbedding([4, 4], [4, 4], rank=2).load_state_dict(table.state_dict())
    bad = source.state_dict()
    bad["_extra_state"] = torch.tensor([9.0, 1.0])
    with pytest.raises(RuntimeError, match="layout version 9"):
        ct.TTLinear([4, 4, 4], [4, 4, 4], rank=3).load_state_dict(bad)
    # A dense layer's weights are not a TT layer's.
    with pytest.raises(RuntimeError, match="Missing key"):
        ct.TTLinear([4, 4, 4], [4, 4, 4], rank=3).load_state_dict(torch.nn.Linear(64, 64).state_dict())


def test_a_state_without_layouts_loads_as_before():
    """A checkpoint of a layer saved before layouts were saved: same ranks load strictly."""
    source = ct.TTLinear([4, 4], [4, 4], rank=3)
    old = {k: v for k, v in source.state_dict().items() if not k.endswith("_extra_state")}
    target = ct.TTLinear([4, 4], [4, 4], rank=3)
    target.load_state_dict(old)
    x = torch.randn(5, 16)
    assert torch.equal(target(x), source(x))
    with pytest.raises(RuntimeError, match="size mismatch"):
        ct.TTLinear([4, 4], [4, 4], rank=2).load_state_dict(old)
