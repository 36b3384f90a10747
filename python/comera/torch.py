"""Tensor-train layers for PyTorch whose forward and backward are comera's kernels.

``TTLinear`` is a linear layer ``y = x @ W + b`` whose weight W (in_features x out_features)
lives as tensor-train (TT) cores with rank gates; ``TTMEmbedding`` is an embedding table held
as tensor-train-matrix (TTM) cores with rank gates. Both are ordinary ``torch.nn.Module``\\ s:
their cores, gates and bias are ``torch.nn.Parameter``\\ s that any torch optimiser trains,
and their forward and backward run comera's Rust kernels (the contraction order chosen by
comera's planner for the batch, a hand-derived backward, the rank gates) through a
``torch.autograd.Function``.

Rank gates (CoMERA, arXiv 2405.14377). Between cores c and c+1 sits a gate vector d of
length r_{c+1}. The layer computes with the gated cores

    H_c = G_c · diag(g(d)),   g(d) = d if d > threshold else 0,

(the last core is not gated), so a gate entry scales one rank slice of the chain and an entry
at or below ``threshold`` prunes that slice: it contributes nothing and receives no
gradient. Gates start at 1 (the layer is then the plain TT product). Training them with a size
penalty (CoMERA's early stage) shrinks the ranks; see ``active_ranks``.

Constraints: CPU, float32 tensors, any leading batch shape. Activations are not copied:
contiguous CPU float32 inputs are read in place through numpy views (a non-contiguous input
is made contiguous first), and outputs (y, and dx in the backward) are written by the kernel
into buffers that comera reuses: when the last tensor viewing an output is freed, its memory
goes back to a cache for the next call of that size, instead of being returned to the
system and faulted in again (as torch's CUDA allocator caches device memory). The cache
keeps at most 1 GiB; see ``cached_bytes``, ``empty_cache`` and ``set_cache_limit``. The
parameters' values (kilobytes) are copied into the Rust layer on every call. The GIL is
released while a kernel runs, on comera's own threads: ``set_num_threads`` and
``get_num_threads`` (torch's do not govern them).

torch is imported by this submodule only; ``import comera`` does not need it.
"""

from __future__ import annotations

import json
import math
import operator
import os
import shutil
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import _comera

__all__ = [
    "TTLinear",
    "TTMEmbedding",
    "balanced_modes",
    "cached_bytes",
    "empty_cache",
    "set_cache_limit",
    "get_num_threads",
    "set_num_threads",
    "save_pretrained",
    "from_pretrained",
]

Rank = Union[int, Sequence[int]]


def balanced_modes(n: int, parts: int = 3) -> List[int]:
    """The most balanced factorisation of ``n`` into ``parts`` factors, largest first
    (comera's default TT layout of a width), e.g. ``balanced_modes(768) == [12, 8, 8]``."""
    return list(_comera.balanced_modes(int(n), int(parts)))


def cached_bytes() -> int:
    """Bytes of freed layer outputs that comera keeps for reuse (see the module doc)."""
    return int(_comera.cached_bytes())


def empty_cache() -> int:
    """Frees the cached output buffers; returns how many bytes were freed. Outputs still in
    use are not affected (their memory is freed, or cached, when they are)."""
    return int(_comera.empty_cache())


def set_cache_limit(nbytes: int) -> int:
    """Sets the most bytes of freed outputs kept for reuse (0: keep none, every output is a
    fresh allocation); frees what is beyond it. Returns the previous limit (1 GiB at start)."""
    if isinstance(nbytes, bool) or operator.index(nbytes) < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    return int(_comera.set_cache_limit(operator.index(nbytes)))


def set_num_threads(threads: int) -> None:
    """Runs comera's kernels on ``threads`` threads from now on (like ``torch.set_num_threads``,
    which does not govern them). Until it is called they run on ``RAYON_NUM_THREADS`` threads
    if that is set when they first run, else on every core. On the merged contraction path
    (``TTLinear.contraction_path(rows) == "merged"``, the planner's pick for large batches) a
    layer's outputs and gradients are the same bits on any thread count.

    Each call then hands its work to that pool and waits: measured on 2 Zen 4 cores, a
    768×768 layer's forward + backward took the same time at 4,096 rows (7.5-7.7 ms) and
    0.17-0.26 ms more at 1 row (0.48-0.57 against 0.31 ms) than on the default threads. For
    small batches, prefer ``RAYON_NUM_THREADS``."""
    if isinstance(threads, bool):
        raise TypeError(f"threads must be an int, got {threads!r}")
    n = operator.index(threads)
    if n < 1:
        raise ValueError(f"threads must be at least 1, got {n}")
    _comera.set_num_threads(n)


def get_num_threads() -> int:
    """The number of threads comera's kernels run on (see ``set_num_threads``)."""
    return int(_comera.get_num_threads())


def _output(rows: int, cols: int) -> Tensor:
    """A rows × cols float32 tensor with undefined values, over a reused buffer when one of
    that size is cached: only for outputs the kernel overwrites entirely."""
    return torch.from_numpy(_comera.empty(rows, cols))


# ---------------------------------------------------------------------------------------------
# Argument checks (every user error is a ValueError or TypeError with what was expected).


def _modes(modes: Sequence[int], what: str) -> List[int]:
    if isinstance(modes, (int, Tensor)) or not isinstance(modes, Sequence):
        raise TypeError(f"{what} must be a sequence of positive ints, got {modes!r}")
    out = []
    for m in modes:
        try:
            v = operator.index(m)
        except TypeError:
            raise TypeError(f"{what} must be a sequence of ints, got {list(modes)!r}") from None
        if isinstance(m, bool) or v < 1:
            raise ValueError(f"{what} must be a sequence of positive ints, got {list(modes)!r}")
        out.append(v)
    if not out:
        raise ValueError(f"{what} is empty: need at least one mode")
    return out


def _int(v: Any, what: str) -> int:
    """``v`` as a positive int (Python or numpy integer; bool rejected)."""
    if isinstance(v, bool):
        raise TypeError(f"{what} must be an int, got {v!r}")
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {v!r}") from None
    if i < 1:
        raise ValueError(f"{what} must be at least 1, got {i}")
    return i


def _ranks(rank: Rank, cores: int) -> List[int]:
    """``[1, r_1, …, r_{K-1}, 1]`` from a uniform rank, the K-1 inner ranks or the full list."""
    if not isinstance(rank, Sequence):
        r = _int(rank, "rank")
        return [1] + [r] * (cores - 1) + [1]
    rs = [_int(v, "every rank") for v in rank]
    if len(rs) == cores - 1:
        return [1] + rs + [1]
    if len(rs) == cores + 1 and rs[0] == 1 and rs[-1] == 1:
        return rs
    raise ValueError(
        f"rank: expected an int, {cores - 1} inner ranks or {cores + 1} ranks [1, …, 1] "
        f"for {cores} cores, got {rs!r}"
    )


def _check_tensor(x: Any, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(
            f"{what} is on device {x.device}; comera.torch runs on CPU only (use .cpu())"
        )
    if x.layout != torch.strided:
        raise TypeError(f"{what} must be a dense (strided) tensor, got layout {x.layout}")
    return x


def _check_float(x: Any, what: str) -> Tensor:
    _check_tensor(x, what)
    if x.dtype != torch.float32:
        raise TypeError(
            f"{what} must be float32, got {x.dtype}; comera's kernels run in float32 "
            f"(convert with .float())"
        )
    return x


_F32 = torch.float32
_STRIDED = torch.strided


def _check_params(params: Sequence[Optional[Tensor]], owner: str) -> None:
    for i, p in enumerate(params):
        # The common case in three attribute reads (this runs on every call); anything else
        # goes through the full check for its message.
        if p is not None and not (
            isinstance(p, Tensor) and p.dtype is _F32 and p.is_cpu and p.layout is _STRIDED
        ):
            _check_float(p, f"{owner} parameter {i}")


def _view(t: Tensor):
    """A numpy view of a CPU float32 tensor's memory (made contiguous first if it is not)."""
    return t.detach().contiguous().numpy()


def _param_views(params: Sequence[Tensor], cores: int) -> Tuple[List[Any], List[Any]]:
    """Numpy views of the cores (the first ``cores`` params) and of the gates (the rest), made
    once in the forward and kept for the backward: the parameters are saved for backward too,
    so an in-place change between the two is caught by autograd's version check."""
    views = [_view(p) for p in params]
    return views[:cores], views[cores:]


def _module_params(*lists: nn.ParameterList) -> List[Tensor]:
    """The parameters of ParameterLists in order (their registered parameters, read directly:
    iterating a ParameterList looks each one up by name)."""
    return [p for lst in lists for p in lst._parameters.values()]


# ---------------------------------------------------------------------------------------------
# Layouts in the state dict: a layer's ranks (and modes, threshold) travel with its weights as
# its "extra state", a float64 tensor (so that safetensors, Hugging Face's save_pretrained and
# ``torch.load(weights_only=True)`` carry it), and loading resizes the cores to them.

#: The version of the extra-state encoding (its first entry).
_STATE_VERSION = 1


def _decode_ints(values: List[float], what: str) -> List[int]:
    out = []
    for v in values:
        if not (math.isfinite(v) and v == int(v) and v >= 1):
            raise ValueError(f"{what}: {values!r} are not positive integers")
        out.append(int(v))
    return out


def _state_entries(state: Any, kind: str) -> List[float]:
    """The entries of a layer's extra state, its version checked."""
    if not isinstance(state, Tensor) or state.dim() != 1 or state.numel() < 2:
        raise ValueError(f"not a comera {kind} layout (expected a 1-D float64 tensor, got {state!r})")
    entries = [float(v) for v in state.detach().cpu().to(torch.float64).tolist()]
    if entries[0] != _STATE_VERSION:
        raise ValueError(
            f"layout version {entries[0]:g}; this comera reads version {_STATE_VERSION} "
            f"(saved by another comera version?)"
        )
    return entries


def _take(entries: List[float], at: int, n: int, what: str) -> Tuple[List[float], int]:
    if n < 0 or at + n > len(entries):
        raise ValueError(f"a truncated layout (no room for {what})")
    return entries[at : at + n], at + n


def _truncated(
    cores: Sequence[Tensor], gates: Sequence[Tensor], tau: float, out_axis: int
) -> Tuple[List[Tensor], List[Tensor], List[int]]:
    """Cores and gates without the rank slices the gates prune (entries ≤ ``tau``): gate b
    scales the last axis of core b and the first axis of core b + 1. A bond whose every slice
    is pruned keeps one, with its gate at 0 (still pruned: the layer stays zero)."""
    keep = []
    new_gates = []
    for g in gates:
        g = g.detach()
        idx = torch.nonzero(g > tau).flatten()
        if idx.numel() == 0:
            idx = torch.zeros(1, dtype=torch.long)
            new_gates.append(torch.zeros(1, dtype=g.dtype))
        else:
            new_gates.append(g.index_select(0, idx).clone())
        keep.append(idx)
    new_cores = []
    for c, core in enumerate(cores):
        t = core.detach()
        if c > 0:
            t = t.index_select(0, keep[c - 1])
        if c < len(keep):
            t = t.index_select(out_axis, keep[c])
        new_cores.append(t.contiguous().clone())
    ranks = [1] + [int(i.numel()) for i in keep] + [1]
    return new_cores, new_gates, ranks


def _new_params(shapes: Sequence[Sequence[int]], like: Sequence[Tensor]) -> nn.ParameterList:
    """Fresh (uninitialised) float32 parameters of ``shapes``, trainable as the ones in
    ``like`` are."""
    grad = all(p.requires_grad for p in like) if like else True
    return nn.ParameterList(
        [nn.Parameter(torch.empty(tuple(s), dtype=torch.float32), requires_grad=grad) for s in shapes]
    )


class _LayoutInState:
    """The state-dict side shared by TTLinear and TTMEmbedding: ``get_extra_state`` /
    ``set_extra_state`` carry the layout, and ``_load_from_state_dict`` adopts it before the
    cores are copied, so that checkpoints of other ranks load (a mismatch of modes or bias is
    an error). A checkpoint written before layouts were saved loads as before."""

    def set_extra_state(self, state: Any) -> None:
        self._adopt_layout(state)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        key = prefix + "_extra_state"
        if key in state_dict:
            try:
                self._adopt_layout(state_dict[key])
            except ValueError as e:
                where = prefix.rstrip(".") or "the layer"
                error_msgs.append(f"{type(self).__name__} {where}: {e}")
                return
        super()._load_from_state_dict(  # type: ignore[misc]
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if key not in state_dict and key in missing_keys:
            missing_keys.remove(key)  # an older checkpoint: sizes are checked as before


# ---------------------------------------------------------------------------------------------
# TT linear layer.


class _TTLinearFunction(torch.autograd.Function):
    """y = x·W + b with W the TT product of the gated cores; forward and backward in comera."""

    @staticmethod
    def forward(ctx, x: Tensor, kernel: Any, bias: Optional[Tensor], *params: Tensor) -> Tensor:  # type: ignore[override]
        # params: K cores, then K - 1 gates.
        n, m = kernel.in_features, kernel.out_features
        lead = tuple(x.shape[:-1])
        x2 = x.detach().reshape(-1, n).contiguous()
        y = _output(x2.shape[0], m)
        cores, gates = _param_views(params, (len(params) + 1) // 2)
        bias_view = None if bias is None else _view(bias)
        fid = kernel.forward(x2.numpy(), cores, gates, bias_view, y.numpy())
        ctx.kernel, ctx.fid, ctx.lead = kernel, fid, lead
        ctx.views = cores, gates, bias_view
        ctx.save_for_backward(x2, bias, *params)
        return y.view(*lead, m)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        x2, bias, *params = ctx.saved_tensors
        kernel = ctx.kernel
        k = (len(params) + 1) // 2
        n, m = kernel.in_features, kernel.out_features
        dy2 = dy.reshape(-1, m).to(dtype=torch.float32).contiguous()
        dx = _output(x2.shape[0], n) if ctx.needs_input_grad[0] else None
        grads = [torch.empty(p.shape, dtype=torch.float32) for p in params]
        db = torch.empty(m, dtype=torch.float32) if bias is not None else None
        cores, gates, bias_view = ctx.views
        kernel.backward(
            ctx.fid,
            x2.numpy(),
            cores,
            gates,
            bias_view,
            dy2.numpy(),
            None if dx is None else dx.numpy(),
            [g.numpy() for g in grads[:k]],
            [g.numpy() for g in grads[k:]],
            None if db is None else db.numpy(),
        )
        needs = ctx.needs_input_grad
        grads = [g if needs[3 + i] else None for i, g in enumerate(grads)]
        return (
            None if dx is None else dx.view(*ctx.lead, n),
            None,
            db if needs[2] else None,
            *grads,
        )


class TTLinear(_LayoutInState, nn.Module):
    """A linear layer ``y = x @ W + b`` whose weight is a tensor train, run by comera.

    W (``in_features`` × ``out_features``; note: the transpose of ``nn.Linear.weight``) is
    the product of K = p + q cores over ``in_modes`` (n_1..n_p, ∏ = in_features) and
    ``out_modes`` (m_1..m_q, ∏ = out_features): core c has shape (r_c, s_c, r_{c+1}) with
    s = in_modes + out_modes and r_0 = r_K = 1, and

        W[(i_1..i_p), (j_1..j_q)] = H_1[0, i_1, :] · H_2[:, i_2, :] ⋯ H_K[:, j_q, 0]

    where the row index has digits i over in_modes and the column index digits j over
    out_modes (first digit slowest, i.e. ``W.reshape(*in_modes, *out_modes)``), and
    H_c = G_c · diag(g(gates[c])) are the gated cores (``g(d) = d if d > threshold else 0``;
    the last core is not gated). The forward picks, for each batch-row count, the cheapest
    contraction order (through the dense W, merged input/output halves, or core by core);
    the backward is comera's hand-derived one.

    Args:
        in_modes: factors of in_features (e.g. ``[12, 8, 8]`` for 768).
        out_modes: factors of out_features.
        rank: one rank for every inner bond, the K-1 inner ranks, or the full list
            ``[1, r_1, …, r_{K-1}, 1]``.
        bias: whether the layer has a bias (initialised to 0, as comera does).
        threshold: gate entries at or below it are pruned (default 0.01, the authors' τ).

    Parameters (``torch.nn.Parameter``, float32): ``cores`` (a ParameterList of K cores),
    ``gates`` (K-1 gate vectors, initialised to 1), ``bias`` (or None). Cores are initialised
    as in comera: N(0, 1)/sqrt(r_{c+1}) · σ^(1/K) with σ = sqrt(1/(in + out)), so that
    Var(W_ij) = 1/(in + out); seed with ``torch.manual_seed``.

    Input: a CPU float32 tensor ``(*, in_features)``; output ``(*, out_features)``. The core,
    gate and bias values are copied into comera on each call (they are small); activations
    are not copied.
    """

    def __init__(
        self,
        in_modes: Sequence[int],
        out_modes: Sequence[int],
        rank: Rank,
        bias: bool = True,
        threshold: float = 0.01,
    ) -> None:
        super().__init__()
        self.in_modes: Tuple[int, ...] = tuple(_modes(in_modes, "in_modes"))
        self.out_modes: Tuple[int, ...] = tuple(_modes(out_modes, "out_modes"))
        k = len(self.in_modes) + len(self.out_modes)
        self.ranks: Tuple[int, ...] = tuple(_ranks(rank, k))
        self._threshold = _threshold(threshold)
        self._kernel = self._make_kernel()
        self.in_features: int = self._kernel.in_features
        self.out_features: int = self._kernel.out_features
        self.cores = nn.ParameterList(
            [nn.Parameter(torch.empty(tuple(s), dtype=torch.float32)) for s in self._kernel.core_shapes]
        )
        self.gates = nn.ParameterList(
            [nn.Parameter(torch.ones(r, dtype=torch.float32)) for r in self.ranks[1:-1]]
        )
        if bias:
            self.bias: Optional[nn.Parameter] = nn.Parameter(
                torch.zeros(self.out_features, dtype=torch.float32)
            )
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def _make_kernel(self) -> Any:
        return _comera.TtLinearKernel(
            list(self.in_modes), list(self.out_modes), list(self.ranks), self._threshold
        )

    def reset_parameters(self) -> None:
        """Re-initialises the cores as comera does (see the class docs), gates to 1, bias to 0."""
        k = len(self.cores)
        sigma = math.sqrt(1.0 / (self.in_features + self.out_features))
        scale = sigma ** (1.0 / k)
        with torch.no_grad():
            for core in self.cores:
                core.normal_(0.0, scale / math.sqrt(core.shape[2]))
            for gate in self.gates:
                gate.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    @property
    def threshold(self) -> float:
        """The gate threshold τ: entries d ≤ τ are pruned (g(d) = 0). Settable."""
        return self._threshold

    @threshold.setter
    def threshold(self, value: float) -> None:
        self._threshold = _threshold(value)
        self._kernel = self._make_kernel()

    def forward(self, x: Tensor) -> Tensor:
        """``x @ W + b`` for a CPU float32 ``x`` of shape ``(*, in_features)``."""
        _check_float(x, "TTLinear input")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"TTLinear input: last dimension must be in_features = {self.in_features}, "
                f"got shape {tuple(x.shape)}"
            )
        params = _module_params(self.cores, self.gates)
        _check_params([*params, self.bias], "TTLinear")
        return _TTLinearFunction.apply(x, self._kernel, self.bias, *params)

    def gated_cores(self) -> List[Tensor]:
        """H_c = G_c · diag(g(d_c)) in plain PyTorch (differentiable); the last core as is."""
        t = self._threshold
        h = [c * torch.where(g > t, g, torch.zeros_like(g)) for c, g in zip(self.cores, self.gates)]
        return h + [self.cores[-1]]

    def dense_weight(self) -> Tensor:
        """The dense W (in_features × out_features) the gated cores represent, computed in
        plain PyTorch (differentiable; for tests, inspection and export)."""
        w = self.gated_cores()[0]
        for h in self.gated_cores()[1:]:
            w = torch.tensordot(w, h, dims=([-1], [0]))
        return w.reshape(self.in_features, self.out_features)

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` with the same function (weight = Wᵀ)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(self.dense_weight().t())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    def active_ranks(self) -> List[int]:
        """``[1, a_1, …, a_{K-1}, 1]``: the gate entries above the threshold on every bond."""
        return [1] + [int((g > self._threshold).sum()) for g in self.gates] + [1]

    def size_l0(self) -> int:
        """S: the number of core parameters that survive the gates,
        Σ_k s_k·a_{k-1}·a_k with a the active ranks and s = in_modes + out_modes."""
        return _sizes(list(self.gates), self.in_modes + self.out_modes, self._threshold)[1]

    def size_l1(self) -> Tensor:
        """Ŝ: CoMERA's differentiable surrogate of S (a_k = Σ g(d) over bond k). Adding
        γ·Ŝ to the loss is CoMERA's early-stage rank objective: it pushes gate entries below
        the threshold, pruning rank slices."""
        return _sizes(list(self.gates), self.in_modes + self.out_modes, self._threshold)[0]

    def contraction_path(self, rows: int) -> str:
        """The contraction path comera's planner picks for ``rows`` batch rows:
        ``"merged"``, ``"sequential"`` or ``"dense"``."""
        return self._kernel.path(int(rows))

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        rank: Optional[int] = None,
        in_modes: Optional[Sequence[int]] = None,
        out_modes: Optional[Sequence[int]] = None,
        rel_tol: Optional[float] = None,
        threshold: float = 0.01,
    ) -> "TTLinear":
        """A TTLinear approximating ``linear`` by TT-SVD of its weight (comera's
        ``tt_matrix_svd``: sequential truncated SVDs, singular values balanced over the cores).

        Args:
            linear: the ``nn.Linear`` to compress (its weight may be on any device and of any
                floating dtype; it is decomposed on the CPU in float32).
            rank: the largest rank on any bond (``None``: no cap; with no ``rel_tol`` either the
                decomposition is exact up to rounding).
            in_modes, out_modes: factors of in_features / out_features (default:
                ``balanced_modes(n, 3)``).
            rel_tol: a relative Frobenius error target for W.
            threshold: the gate threshold of the new layer.

        The new layer has the ranks TT-SVD chose (at most ``rank``; outer bonds are often
        smaller, e.g. r_1 ≤ n_1), gates at 1 and the Linear's bias; ``layer.svd_rel_error``
        holds the relative error ‖W_TT − W‖_F/‖W‖_F predicted by the discarded singular values.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects a torch.nn.Linear, got {type(linear).__name__}")
        n, m = linear.in_features, linear.out_features
        in_modes = _modes(in_modes, "in_modes") if in_modes is not None else balanced_modes(n)
        out_modes = _modes(out_modes, "out_modes") if out_modes is not None else balanced_modes(m)
        if rank is not None:
            rank = _int(rank, "rank")
        if math.prod(in_modes) != n or math.prod(out_modes) != m:
            raise ValueError(
                f"in_modes {in_modes} and out_modes {out_modes} must multiply to the Linear's "
                f"in_features = {n} and out_features = {m}"
            )
        w = linear.weight.detach().to(device="cpu", dtype=torch.float32).t().contiguous()
        cores, ranks, err = _comera.tt_matrix_svd(w.numpy(), in_modes, out_modes, rank, rel_tol)
        layer = cls(in_modes, out_modes, list(ranks), bias=linear.bias is not None, threshold=threshold)
        with torch.no_grad():
            for p, c in zip(layer.cores, cores):
                p.copy_(torch.from_numpy(c))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach().to(device="cpu", dtype=torch.float32))
        layer.svd_rel_error = float(err)
        return layer

    # --- the layout in the state dict (see _LayoutInState) ---

    def get_extra_state(self) -> Tensor:
        """The layout as a float64 tensor: version, number of in/out modes, the modes, the
        ranks, whether there is a bias, the threshold."""
        return torch.tensor(
            [_STATE_VERSION, len(self.in_modes), len(self.out_modes), *self.in_modes,
             *self.out_modes, *self.ranks, float(self.bias is not None), self._threshold],
            dtype=torch.float64,
        )

    def _adopt_layout(self, state: Any) -> None:
        e = _state_entries(state, "TTLinear")
        p, q = _decode_ints(e[1:3], "mode counts")
        in_modes, at = _take(e, 3, p, "in_modes")
        out_modes, at = _take(e, at, q, "out_modes")
        ranks, at = _take(e, at, p + q + 1, "ranks")
        rest, at = _take(e, at, 2, "bias and threshold")
        in_modes = _decode_ints(in_modes, "in_modes")
        out_modes = _decode_ints(out_modes, "out_modes")
        ranks = _decode_ints(ranks, "ranks")
        if (tuple(in_modes), tuple(out_modes)) != (self.in_modes, self.out_modes):
            raise ValueError(
                f"the checkpoint's layer has in_modes {in_modes} and out_modes {out_modes}, "
                f"this one {list(self.in_modes)} and {list(self.out_modes)}"
            )
        if bool(rest[0]) != (self.bias is not None):
            has = "has" if rest[0] else "has no"
            raise ValueError(f"the checkpoint's layer {has} bias, this one {'has' if self.bias is not None else 'has no'} bias")
        threshold = _threshold(rest[1])
        if tuple(ranks) != self.ranks or threshold != self._threshold:
            self._threshold = threshold
            self._set_ranks(ranks)

    def _set_ranks(self, ranks: Sequence[int]) -> None:
        """Takes ``ranks`` ([1, …, 1]): new (uninitialised) cores and gates when they change."""
        ranks = tuple(_ranks(list(ranks), len(self.in_modes) + len(self.out_modes)))
        self.ranks = ranks
        self._kernel = self._make_kernel()
        if [tuple(c.shape) for c in self.cores] != [tuple(s) for s in self._kernel.core_shapes]:
            self.cores = _new_params(self._kernel.core_shapes, list(self.cores))
            self.gates = _new_params([(r,) for r in self.ranks[1:-1]], list(self.gates))
            with torch.no_grad():
                for g in self.gates:
                    g.fill_(1.0)

    def truncate(self) -> List[int]:
        """Removes the rank slices the gates prune (CoMERA's truncation): the cores shrink to
        the active ranks, the function stays the same (pruned slices contributed nothing).
        Returns the new ranks. The parameters are new tensors: make the optimiser after."""
        cores, gates, ranks = _truncated(list(self.cores), list(self.gates), self._threshold, 2)
        self._set_ranks(ranks)
        with torch.no_grad():
            for p, v in zip(self.cores, cores):
                p.copy_(v)
            for p, v in zip(self.gates, gates):
                p.copy_(v)
        return list(self.ranks)

    def extra_repr(self) -> str:
        return (
            f"in_modes={list(self.in_modes)}, out_modes={list(self.out_modes)}, "
            f"ranks={list(self.ranks)}, bias={self.bias is not None}, threshold={self._threshold}"
        )

    # The Rust kernel is not picklable: copies (deepcopy, pickle, torch.save of the module)
    # make a fresh one.
    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__().copy()
        state.pop("_kernel", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._kernel = self._make_kernel()


def _sizes(gates: Sequence[Tensor], modes: Sequence[int], tau: float) -> Tuple[Tensor, int]:
    """(Ŝ, S) of a gated chain: S = Σ_k s_k·a_{k-1}·a_k with a_k the active entries of bond k
    (a_0 = a_K = 1), Ŝ the same with a_k = Σ g(d) over bond k (differentiable in the gates)."""
    soft: List[Any] = [1.0] + [torch.where(g > tau, g, torch.zeros_like(g)).sum() for g in gates] + [1.0]
    hard = [1] + [int((g > tau).sum()) for g in gates] + [1]
    l1 = sum(s * soft[k] * soft[k + 1] for k, s in enumerate(modes))
    l0 = sum(s * hard[k] * hard[k + 1] for k, s in enumerate(modes))
    return torch.as_tensor(l1), l0


def _threshold(t: float) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise ValueError(f"threshold must be a finite number >= 0, got {t!r}")
    return float(t)


# ---------------------------------------------------------------------------------------------
# TTM embedding.


class _TTMFunction(torch.autograd.Function):
    """Rows of the TTM table for int64 ids; forward and backward in comera."""

    @staticmethod
    def forward(ctx, ids: Tensor, kernel: Any, *params: Tensor) -> Tensor:  # type: ignore[override]
        # params: p cores, then p - 1 gates.
        d = kernel.embedding_dim
        shape = tuple(ids.shape)
        ids1 = ids.reshape(-1).contiguous()
        y = _output(ids1.shape[0], d)
        cores, gates = _param_views(params, (len(params) + 1) // 2)
        fid = kernel.forward(ids1.numpy(), cores, gates, y.numpy())
        ctx.kernel, ctx.fid, ctx.views = kernel, fid, (cores, gates)
        ctx.save_for_backward(ids1, *params)
        return y.view(*shape, d)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        ids1, *params = ctx.saved_tensors
        kernel = ctx.kernel
        p = (len(params) + 1) // 2
        dy2 = dy.reshape(-1, kernel.embedding_dim).to(dtype=torch.float32).contiguous()
        grads = [torch.empty(q.shape, dtype=torch.float32) for q in params]
        cores, gates = ctx.views
        kernel.backward(
            ctx.fid,
            ids1.numpy(),
            cores,
            gates,
            dy2.numpy(),
            [g.numpy() for g in grads[:p]],
            [g.numpy() for g in grads[p:]],
        )
        needs = ctx.needs_input_grad
        return (None, None, *[g if needs[2 + i] else None for i, g in enumerate(grads)])


class TTMEmbedding(_LayoutInState, nn.Module):
    """An embedding table held as tensor-train-matrix (TTM) cores with rank gates, run by comera.

    The table E (``num_embeddings`` × ``embedding_dim``) is the product of p cores over
    ``vocab_modes`` (v_1..v_p, ∏ ≥ num_embeddings) and ``dim_modes`` (e_1..e_p, ∏ =
    embedding_dim): core k has shape (r_k, v_k, e_k, r_{k+1}) with r_0 = r_p = 1, and

        E[(i_1..i_p), (c_1..c_p)] = H_1[0, i_1, c_1, :] · H_2[:, i_2, c_2, :] ⋯ H_p[:, i_p, c_p, 0]

    (row digits over vocab_modes, column digits over dim_modes, first digit slowest), with the
    gated cores H_k = F_k · diag(g(gates[k])) (``g(d) = d if d > threshold else 0``; the last
    core is not gated). A lookup deduplicates the batch's ids and, when cheaper, computes the
    shared left and right half-chains once (comera's optimised lookup); the backward
    accumulates repeated ids' gradients.

    Args:
        vocab_modes: factors whose product is at least ``num_embeddings``.
        dim_modes: factors of the embedding dimension (as many as vocab_modes).
        rank: one rank for every inner bond, the p-1 inner ranks, or ``[1, …, 1]`` in full.
        num_embeddings: the number of rows V (default: ∏ vocab_modes).
        threshold: gate entries at or below it are pruned (default 0.01).
        std: the initial entries' standard deviation (cores N(0, 1)·sqrt(std^(2/p)/r_{k+1}),
            as comera initialises them; 1 matches a fresh ``nn.Embedding``).

    Parameters: ``cores`` (p cores), ``gates`` (p-1 gate vectors at 1). Input: a CPU integer
    tensor of ids of any shape (int64 is read in place; other integer dtypes are converted);
    output ``(*ids.shape, embedding_dim)`` float32. Ids out of range raise ValueError.
    """

    def __init__(
        self,
        vocab_modes: Sequence[int],
        dim_modes: Sequence[int],
        rank: Rank,
        num_embeddings: Optional[int] = None,
        threshold: float = 0.01,
        std: float = 1.0,
    ) -> None:
        super().__init__()
        self.vocab_modes: Tuple[int, ...] = tuple(_modes(vocab_modes, "vocab_modes"))
        self.dim_modes: Tuple[int, ...] = tuple(_modes(dim_modes, "dim_modes"))
        if len(self.vocab_modes) != len(self.dim_modes):
            raise ValueError(
                f"vocab_modes {list(self.vocab_modes)} and dim_modes {list(self.dim_modes)} "
                f"must have the same length (one of each per core)"
            )
        p = len(self.vocab_modes)
        self.ranks: Tuple[int, ...] = tuple(_ranks(rank, p))
        capacity = math.prod(self.vocab_modes)
        if num_embeddings is None:
            num_embeddings = capacity
        if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int):
            raise TypeError(f"num_embeddings must be an int, got {num_embeddings!r}")
        if not 1 <= num_embeddings <= capacity:
            raise ValueError(
                f"num_embeddings = {num_embeddings} must be between 1 and the product of "
                f"vocab_modes {list(self.vocab_modes)} = {capacity}"
            )
        self.num_embeddings: int = num_embeddings
        self.embedding_dim: int = math.prod(self.dim_modes)
        self._threshold = _threshold(threshold)
        self.std = float(std)
        self._kernel = self._make_kernel()
        self.cores = nn.ParameterList(
            [nn.Parameter(torch.empty(tuple(s), dtype=torch.float32)) for s in self._kernel.core_shapes]
        )
        self.gates = nn.ParameterList(
            [nn.Parameter(torch.ones(r, dtype=torch.float32)) for r in self.ranks[1:-1]]
        )
        self.reset_parameters()

    def _make_kernel(self) -> Any:
        return _comera.TtmKernel(
            list(self.vocab_modes),
            list(self.dim_modes),
            list(self.ranks),
            self.num_embeddings,
            self._threshold,
        )

    def reset_parameters(self) -> None:
        """Re-initialises the cores as comera does (see the class docs) and the gates to 1."""
        p = len(self.cores)
        var_k = self.std ** (2.0 / p)
        with torch.no_grad():
            for core in self.cores:
                core.normal_(0.0, math.sqrt(var_k / core.shape[3]))
            for gate in self.gates:
                gate.fill_(1.0)

    @property
    def threshold(self) -> float:
        """The gate threshold τ: entries d ≤ τ are pruned (g(d) = 0). Settable."""
        return self._threshold

    @threshold.setter
    def threshold(self, value: float) -> None:
        self._threshold = _threshold(value)
        self._kernel = self._make_kernel()

    def forward(self, ids: Tensor) -> Tensor:
        """The rows ``E[ids]``: ``(*ids.shape, embedding_dim)`` float32."""
        _check_tensor(ids, "TTMEmbedding ids")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"TTMEmbedding ids must be an integer tensor, got {ids.dtype}")
        if ids.dtype != torch.int64:
            ids = ids.to(torch.int64)
        params = _module_params(self.cores, self.gates)
        _check_params(params, "TTMEmbedding")
        return _TTMFunction.apply(ids, self._kernel, *params)

    def gated_cores(self) -> List[Tensor]:
        """H_k = F_k · diag(g(d_k)) in plain PyTorch (differentiable); the last core as is."""
        t = self._threshold
        h = [c * torch.where(g > t, g, torch.zeros_like(g)) for c, g in zip(self.cores, self.gates)]
        return h + [self.cores[-1]]

    def dense_table(self) -> Tensor:
        """The dense table (num_embeddings × embedding_dim) the gated cores represent, in plain
        PyTorch (differentiable; for tests, inspection and export)."""
        h = self.gated_cores()
        t = h[0]  # (1, v1, e1, r1)
        for c in h[1:]:
            t = torch.tensordot(t, c, dims=([-1], [0]))  # (1, v1, e1, …, vk, ek, r)
        p = len(h)
        t = t.reshape(*[x for pair in zip(self.vocab_modes, self.dim_modes) for x in pair])
        t = t.permute(*range(0, 2 * p, 2), *range(1, 2 * p, 2))
        return t.reshape(-1, self.embedding_dim)[: self.num_embeddings]

    def active_ranks(self) -> List[int]:
        """``[1, a_1, …, a_{p-1}, 1]``: the gate entries above the threshold on every bond."""
        return [1] + [int((g > self._threshold).sum()) for g in self.gates] + [1]

    def size_l0(self) -> int:
        """S: the number of core parameters that survive the gates,
        Σ_k v_k·e_k·a_{k-1}·a_k with a the active ranks."""
        modes = [v * e for v, e in zip(self.vocab_modes, self.dim_modes)]
        return _sizes(list(self.gates), modes, self._threshold)[1]

    def size_l1(self) -> Tensor:
        """Ŝ: CoMERA's differentiable surrogate of S (a_k = Σ g(d) over bond k); see
        ``TTLinear.size_l1``."""
        modes = [v * e for v, e in zip(self.vocab_modes, self.dim_modes)]
        return _sizes(list(self.gates), modes, self._threshold)[0]

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        vocab_modes: Sequence[int],
        dim_modes: Sequence[int],
        rank: Optional[int] = None,
        rel_tol: Optional[float] = None,
        threshold: float = 0.01,
    ) -> "TTMEmbedding":
        """A TTMEmbedding approximating ``embedding``'s table by TT-SVD (comera's ``ttm_svd``;
        rows past num_embeddings up to ∏ vocab_modes are taken as zeros).

        ``rank`` caps every bond (``None``: no cap), ``rel_tol`` is a relative Frobenius error
        target. The new table has the ranks TT-SVD chose and gates at 1;
        ``table.svd_rel_error`` holds the predicted relative error. Options of the
        ``nn.Embedding`` such as ``padding_idx`` or ``max_norm`` are not carried over.
        """
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(
                f"from_embedding expects a torch.nn.Embedding, got {type(embedding).__name__}"
            )
        vocab_modes = _modes(vocab_modes, "vocab_modes")
        dim_modes = _modes(dim_modes, "dim_modes")
        if rank is not None:
            rank = _int(rank, "rank")
        table = embedding.weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
        cores, ranks, err = _comera.ttm_svd(table.numpy(), vocab_modes, dim_modes, rank, rel_tol)
        layer = cls(
            vocab_modes,
            dim_modes,
            list(ranks),
            num_embeddings=embedding.num_embeddings,
            threshold=threshold,
        )
        with torch.no_grad():
            for p, c in zip(layer.cores, cores):
                p.copy_(torch.from_numpy(c))
        layer.svd_rel_error = float(err)
        return layer

    # --- the layout in the state dict (see _LayoutInState) ---

    def get_extra_state(self) -> Tensor:
        """The layout as a float64 tensor: version, number of cores, vocab and dim modes, the
        ranks, num_embeddings, the threshold."""
        return torch.tensor(
            [_STATE_VERSION, len(self.vocab_modes), *self.vocab_modes, *self.dim_modes,
             *self.ranks, self.num_embeddings, self._threshold],
            dtype=torch.float64,
        )

    def _adopt_layout(self, state: Any) -> None:
        e = _state_entries(state, "TTMEmbedding")
        (p,) = _decode_ints(e[1:2], "core count")
        vocab, at = _take(e, 2, p, "vocab_modes")
        dim, at = _take(e, at, p, "dim_modes")
        ranks, at = _take(e, at, p + 1, "ranks")
        rest, at = _take(e, at, 2, "num_embeddings and threshold")
        vocab = _decode_ints(vocab, "vocab_modes")
        dim = _decode_ints(dim, "dim_modes")
        ranks = _decode_ints(ranks, "ranks")
        (rows,) = _decode_ints(rest[:1], "num_embeddings")
        if (tuple(vocab), tuple(dim), rows) != (self.vocab_modes, self.dim_modes, self.num_embeddings):
            raise ValueError(
                f"the checkpoint's table has vocab_modes {vocab}, dim_modes {dim} and "
                f"{rows} rows, this one {list(self.vocab_modes)}, {list(self.dim_modes)} and "
                f"{self.num_embeddings}"
            )
        threshold = _threshold(rest[1])
        if tuple(ranks) != self.ranks or threshold != self._threshold:
            self._threshold = threshold
            self._set_ranks(ranks)

    def _set_ranks(self, ranks: Sequence[int]) -> None:
        """Takes ``ranks`` ([1, …, 1]): new (uninitialised) cores and gates when they change."""
        ranks = tuple(_ranks(list(ranks), len(self.vocab_modes)))
        self.ranks = ranks
        self._kernel = self._make_kernel()
        if [tuple(c.shape) for c in self.cores] != [tuple(s) for s in self._kernel.core_shapes]:
            self.cores = _new_params(self._kernel.core_shapes, list(self.cores))
            self.gates = _new_params([(r,) for r in self.ranks[1:-1]], list(self.gates))
            with torch.no_grad():
                for g in self.gates:
                    g.fill_(1.0)

    def truncate(self) -> List[int]:
        """Removes the rank slices the gates prune (see ``TTLinear.truncate``); returns the
        new ranks. The parameters are new tensors: make the optimiser after."""
        cores, gates, ranks = _truncated(list(self.cores), list(self.gates), self._threshold, 3)
        self._set_ranks(ranks)
        with torch.no_grad():
            for p, v in zip(self.cores, cores):
                p.copy_(v)
            for p, v in zip(self.gates, gates):
                p.copy_(v)
        return list(self.ranks)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"vocab_modes={list(self.vocab_modes)}, dim_modes={list(self.dim_modes)}, "
            f"ranks={list(self.ranks)}, threshold={self._threshold}"
        )

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__().copy()
        state.pop("_kernel", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._kernel = self._make_kernel()


# ---------------------------------------------------------------------------------------------
# Hugging Face models with comera layers.

#: The weights of a model saved by ``save_pretrained`` (not ``model.safetensors``: a loader
#: that does not know comera's layers finds no weights and stops, rather than loading random
#: dense layers in their place).
WEIGHTS_FILE = "comera_model.safetensors"
#: The loader written beside them, for ``trust_remote_code=True``.
MODELING_FILE = "modeling_comera.py"
#: Files of a plain ``save_pretrained`` that would load without the comera layers.
_DENSE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                       "pytorch_model.bin.index.json")
_SAVE_VERSION = 1
_LAYER_KINDS = {"TTLinear": TTLinear, "TTMEmbedding": TTMEmbedding}


def _comera_layers(model: nn.Module) -> Dict[str, Dict[str, Any]]:
    return {
        name: {"kind": type(m).__name__, "layout": m.get_extra_state().tolist()}
        for name, m in model.named_modules()
        if type(m) in (TTLinear, TTMEmbedding)
    }


def save_pretrained(model: nn.Module, save_directory: Union[str, "os.PathLike[str]"]) -> None:
    """Saves a transformers model whose modules include comera layers (``TTLinear``, e.g.
    from ``TTLinear.from_linear``, and ``TTMEmbedding``) so that loading gives it back with
    its cores: ``from_pretrained(dir)`` here, or transformers'
    ``AutoModel….from_pretrained(dir, trust_remote_code=True)``.

    Writes ``config.json`` (the model's config inside comera's, with the layers' layouts),
    ``comera_model.safetensors`` (every weight, the TT cores and gates among them) and
    ``modeling_comera.py`` (the loader transformers runs). Use it instead of the model's own
    ``save_pretrained``, which writes the cores where a plain ``from_pretrained`` would drop
    them and load random dense layers; after training under the ``Trainer``, call
    ``save_pretrained(trainer.model, dir)``. A directory that holds a plain save's weights is
    refused (they would load without the comera layers); tokenizer files may be there.
    """
    from safetensors.torch import save_model

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(
            f"save_pretrained expects a transformers model (with a .config), got {type(model).__name__}; "
            f"for a plain torch module, torch.save(module.state_dict(), path) keeps the layouts"
        )
    layers = _comera_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no comera layers; save it with its own save_pretrained"
        )
    os.makedirs(save_directory, exist_ok=True)
    stale = [f for f in _DENSE_WEIGHT_FILES if os.path.exists(os.path.join(save_directory, f))]
    if stale:
        raise ValueError(
            f"{os.fspath(save_directory)} holds {', '.join(stale)} of another save, which "
            f"transformers would load without the comera layers; save into another directory "
            f"or remove them"
        )
    base = config.to_dict()
    save_model(model, os.path.join(save_directory, WEIGHTS_FILE), metadata={"format": "pt"})
    shutil.copyfile(
        os.path.join(os.path.dirname(__file__), "_hf_remote.py"),
        os.path.join(save_directory, MODELING_FILE),
    )
    wrapper = {
        "model_type": "comera",
        "architectures": [type(model).__name__],
        "auto_map": {
            auto: "modeling_comera.ComeraModel"
            for auto in ("AutoModel", "AutoModelForSequenceClassification", "AutoModelForMaskedLM",
                         "AutoModelForTokenClassification", "AutoModelForQuestionAnswering",
                         "AutoModelForCausalLM", "AutoModelForPreTraining")
        },
        "comera": {
            "version": _SAVE_VERSION,
            "architecture": type(model).__name__,
            "base_config": base,
            "layers": layers,
        },
    }
    wrapper["auto_map"]["AutoConfig"] = "modeling_comera.ComeraConfig"
    with open(os.path.join(save_directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(wrapper, f, indent=2, sort_keys=True)
        f.write("\n")


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if not hasattr(parent, leaf):
        raise ValueError(f"the model has no module {name!r} to hold a comera layer")
    setattr(parent, leaf, module)


def _layer_from_layout(kind: str, layout: Sequence[float]) -> nn.Module:
    """A TTLinear or TTMEmbedding of the layout ``get_extra_state`` gives (values unset)."""
    if kind not in _LAYER_KINDS:
        raise ValueError(f"unknown comera layer kind {kind!r} (expected one of {sorted(_LAYER_KINDS)})")
    e = _state_entries(torch.tensor(layout, dtype=torch.float64), kind)
    if kind == "TTLinear":
        p, q = _decode_ints(e[1:3], "mode counts")
        in_modes, at = _take(e, 3, p, "in_modes")
        out_modes, at = _take(e, at, q, "out_modes")
        ranks, at = _take(e, at, p + q + 1, "ranks")
        rest, _ = _take(e, at, 2, "bias and threshold")
        return TTLinear(_decode_ints(in_modes, "in_modes"), _decode_ints(out_modes, "out_modes"),
                        _decode_ints(ranks, "ranks"), bias=bool(rest[0]), threshold=rest[1])
    (p,) = _decode_ints(e[1:2], "core count")
    vocab, at = _take(e, 2, p, "vocab_modes")
    dim, at = _take(e, at, p, "dim_modes")
    ranks, at = _take(e, at, p + 1, "ranks")
    rest, _ = _take(e, at, 2, "num_embeddings and threshold")
    return TTMEmbedding(_decode_ints(vocab, "vocab_modes"), _decode_ints(dim, "dim_modes"),
                        _decode_ints(ranks, "ranks"), num_embeddings=_decode_ints(rest[:1], "num_embeddings")[0],
                        threshold=rest[1])


def _plain_save_layers(weights: str) -> Dict[str, Dict[str, Any]]:
    """The comera layers of a plain ``save_pretrained`` (a ``Trainer`` checkpoint) of a model
    with comera layers, found from the layouts its weights file carries (each layer's
    ``<layer>._extra_state``); the kind from the cores' rank (TTMEmbedding cores are 4-D)."""
    from safetensors import safe_open

    layers: Dict[str, Dict[str, Any]] = {}
    with safe_open(weights, framework="pt") as f:
        keys = set(f.keys())
        for key in sorted(keys):
            if not key.endswith("._extra_state") or f"{key[: -len('_extra_state')]}cores.0" not in keys:
                continue
            name = key[: -len("._extra_state")]
            kind = "TTMEmbedding" if len(f.get_slice(f"{name}.cores.0").get_shape()) == 4 else "TTLinear"
            layers[name] = {"kind": kind, "layout": f.get_tensor(key).tolist()}
    return layers


def from_pretrained(directory: Union[str, "os.PathLike[str]"]) -> nn.Module:
    """The model ``save_pretrained`` (or ``Run.export_hf(dir, compressed=True)``) wrote in
    ``directory``: the saved transformers class with its comera layers and every weight, in
    eval mode. Any difference between the file's tensors and the model's (a missing or
    unexpected weight, a shape) is an error; nothing is left at random initialisation.

    A plain ``model.save_pretrained(dir)`` of a model with comera layers (a ``Trainer``
    checkpoint: one ``model.safetensors``) loads too: the layers' layouts are in its weights."""
    import transformers
    from safetensors.torch import load_model

    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            wrapper = json.load(f)
    except OSError as e:
        raise OSError(f"{path}: cannot read the config: {e.strerror or e}") from None
    if wrapper.get("model_type") == "comera":
        saved = wrapper.get("comera")
        if not isinstance(saved, dict) or saved.get("version") != _SAVE_VERSION:
            version = saved.get("version") if isinstance(saved, dict) else None
            raise ValueError(
                f"{path}: saved in comera format version {version!r}; this comera reads "
                f"version {_SAVE_VERSION}"
            )
        base = dict(saved["base_config"])
        architecture = saved["architecture"]
        layers = saved["layers"]
        weights = os.path.join(directory, WEIGHTS_FILE)
    else:
        base = dict(wrapper)
        architectures = base.get("architectures") or [None]
        architecture = architectures[0]
        weights = os.path.join(directory, "model.safetensors")
        if not os.path.exists(weights):
            raise ValueError(
                f"{os.fspath(directory)}: neither a comera save (config.json of model_type "
                f"comera) nor a single model.safetensors of a plain save"
            )
        layers = _plain_save_layers(weights)
        if not layers:
            raise ValueError(
                f"{weights}: no comera layers in it; load it with transformers' from_pretrained"
            )
    model_class = getattr(transformers, architecture or "", None)
    if model_class is None:
        raise ValueError(f"{path}: transformers {transformers.__version__} has no class {architecture}")
    model_type = base.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **base)
    model = model_class(config)
    for name, entry in layers.items():
        _set_module(model, name, _layer_from_layout(entry["kind"], entry["layout"]))
    load_model(model, weights, strict=True)
    return model.eval()


def _compress_hf_export(run: Union[str, "os.PathLike[str]"], directory: Union[str, "os.PathLike[str]"],
                        written: Dict[str, Any]) -> Dict[str, Any]:
    """Turns the dense Hugging Face export of ``run`` in ``directory`` (``written``: what the
    export returned) into its compressed form: the run's TT/TTM layers as comera.torch layers
    with the run's cores, saved by ``save_pretrained``. ``Run.export_hf(dir, compressed=True)``."""
    import transformers

    architecture = written["architecture"]
    model = getattr(transformers, architecture).from_pretrained(os.fspath(directory)).eval()
    layers = _comera.run_tt_modules(os.fspath(run))
    if not layers:
        raise ValueError(f"{os.fspath(run)}: the run's model has no TT/TTM layers; export it dense")
    for entry in layers:
        if entry["kind"] == "linear":
            layer: nn.Module = TTLinear(entry["in_modes"], entry["out_modes"], entry["ranks"],
                                        threshold=float(entry["threshold"]))
        else:
            layer = TTMEmbedding(entry["vocab_modes"], entry["dim_modes"], entry["ranks"],
                                 num_embeddings=entry["num_embeddings"], threshold=float(entry["threshold"]))
        with torch.no_grad():
            for p, v in zip(layer.cores, entry["cores"]):
                p.copy_(torch.from_numpy(v))
            for p, v in zip(layer.gates, entry["gates"]):
                p.copy_(torch.from_numpy(v))
            if "bias" in entry:
                layer.bias.copy_(torch.from_numpy(entry["bias"]))
        _set_module(model, entry["module"], layer)
    os.remove(os.path.join(directory, "model.safetensors"))
    save_pretrained(model, directory)
    out = dict(written)
    out["compressed"] = True
    out["params"] = sum(p.numel() for p in model.parameters())
    out["files"] = sorted(os.listdir(directory))
    out["notes"] = [n for n in written["notes"] if not n.startswith("TT/TTM layers reconstructed")] + [
        f"{len(layers)} TT/TTM layers kept as comera.torch layers ({out['params']} parameters): load with "
        f"from_pretrained(dir, trust_remote_code=True) or comera.torch.from_pretrained(dir)"
    ]
    return out

