"""How the experts' feed-forward networks run on a buffer of rows sorted by expert: the grouped expert kernels.

The MoE layer (:mod:`podscale.parallel.moe.layer`) hands an :class:`ExpertKernel` one buffer of rows at a
time, laid out as consecutive segments, one per (local expert, source): ``bounds`` lists them as
``(local expert, first row, end row)``.  Every expert computes ``gelu(x w_fc + b_fc) w_proj + b_proj``
(tanh GELU, Hendrycks & Gimpel 2016) on its segments; the kernel writes the outputs, keeps what its
backward needs, and in the backward writes the input gradient and adds the weight gradients to a
:class:`WeightGrads`.  Both kernels run one matmul per expert segment, never a padded or S×E×C tensor;
they differ in how they meet their device's cost model:

* :class:`CacheTiledKernel` (CPUs): the buffer in tiles of a few hundred rows whose pre-activation,
  activation and GELU derivative stay in the L2 cache between the two matmuls; the GELU and its derivative
  from one sigmoid in element-wise passes over the tile (PyTorch's ``gelu`` and ``gelu_backward`` each
  evaluate the tanh, several plain passes' worth of work per element on a CPU core).
* :class:`SegmentKernel` (GPUs and other accelerators): each matmul over the expert's whole segment and the
  GELU and its backward as PyTorch's fused kernels over the whole buffer, one launch each: on a GPU the
  element-wise work is memory-bound and a launch costs microseconds, so tiles (more launches) and nine
  separate passes (nine trips through memory) would both cost more than they save.

:func:`kernel_for` picks by device; a layer can be given either explicitly.  Both keep two (rows × hidden)
tensors for the backward, as many bytes as autograd keeps for two linears and a GELU beside the input; built
with ``recompute`` they keep one, the pre-activation, and evaluate the GELU again in the backward.
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from podscale.runtime import hostmem

Bounds = Sequence[tuple[int, int, int]]


def segment_bounds(segments, start: int = 0) -> list[tuple[int, int, int]]:
    """Segments ``(local expert, rows)`` laid end to end from row ``start`` -> the non-empty ones as
    ``(local expert, first row, end row)``."""
    out = []
    for j, n in segments:
        if n:
            out.append((j, start, start + n))
        start += n
    return out


def _linear_into(out: torch.Tensor, inp: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """``out = inp w + b`` (``b`` None: no bias) written into ``out``; the bias folded into ``addmm``."""
    if b is None:
        torch.mm(inp, w, out=out)
    else:
        torch.addmm(b, inp, w, out=out)


def _split_weights(weights, El: int, bias: bool):
    """``(w_fc, w_proj, b_fc, b_proj)``, each a list of El (biases: None without ``bias``)."""
    none = [None] * El
    return (weights[:El], weights[El:2 * El], weights[2 * El:3 * El] if bias else none,
            weights[3 * El:] if bias else none)


def cast_weights(ws, dt):
    """The weights in the compute dtype, converted once per call rather than once per matmul."""
    return ws if all(w.dtype == dt for w in ws) else tuple(w.to(dt) for w in ws)


class WeightGrads:
    """The experts' weight and bias gradients, summed over every piece of rows the backward visits (an
    expert's rows may come in several pieces: segments from several ranks, the parts of an overlapped
    exchange)."""

    def __init__(self, El: int, bias: bool):
        self.El, self.bias = El, bias
        self.fc, self.proj, self.b_fc, self.b_proj = [None] * El, [None] * El, [None] * El, [None] * El

    def add_proj(self, j: int, act: torch.Tensor, grad: torch.Tensor) -> None:
        """Expert ``j``'s second linear: ``d w_proj += act^T grad``, ``d b_proj += sum(grad)``."""
        self._add(self.proj, self.b_proj, j, act, grad)

    def add_fc(self, j: int, x: torch.Tensor, d_pre: torch.Tensor) -> None:
        """Expert ``j``'s first linear: ``d w_fc += x^T d_pre``, ``d b_fc += sum(d_pre)``."""
        self._add(self.fc, self.b_fc, j, x, d_pre)

    def _add(self, w: list, b: list, j: int, inp: torch.Tensor, grad_out: torch.Tensor) -> None:
        if w[j] is None:
            w[j] = torch.mm(inp.t(), grad_out)
            if self.bias:
                b[j] = grad_out.sum(0)
        else:
            w[j].addmm_(inp.t(), grad_out)
            if self.bias:
                b[j].add_(grad_out.sum(0))

    def result(self, params, like: torch.Tensor) -> list[torch.Tensor]:
        """The gradients in ``params``' order and dtype (w_fc..., w_proj..., then b_fc..., b_proj...); an
        expert without rows gets a zero gradient, never a missing one."""
        weights = params[:2 * self.El]
        out = [g if g is not None else like.new_zeros(w.shape) for g, w in zip(self.fc + self.proj, weights)]
        if self.bias:
            out += [g if g is not None else like.new_zeros(b.shape)
                    for g, b in zip(self.b_fc + self.b_proj, params[2 * self.El:])]
        return [g if g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(out, params)]


class ExpertKernel(Protocol):
    """The grouped expert feed-forward on one buffer of rows.

    ``weights``: the El local experts' ``w_fc`` (d, h) ..., ``w_proj`` (h, d) ..., then (with ``bias``)
    ``b_fc`` ..., ``b_proj`` ..., in the compute dtype.  Every row of ``x`` lies in one of ``bounds``."""

    def forward(self, x: torch.Tensor, bounds: Bounds, weights, El: int, bias: bool,
                out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Outputs into ``out`` (``x``'s rows); returns the tensors the backward needs beside ``x`` (as many
        for every call of one kernel)."""

    def backward(self, grad: torch.Tensor, x: torch.Tensor, saved: tuple[torch.Tensor, ...],
                 bounds: Bounds, weights, El: int, acc: WeightGrads, g_x: torch.Tensor | None) -> None:
        """``d x`` into ``g_x`` (None: the input wants no gradient, skip it), the weight gradients added to
        ``acc``.  May overwrite ``saved`` (a second backward through one forward is refused upstream)."""


# ---------------------------------------------------------------------------------------------------
# CPUs: cache-resident tiles, the GELU and its derivative from one sigmoid

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715
_TWO_C: dict = {}


def _two_c(like: torch.Tensor) -> torch.Tensor:
    """The 0-dim constant ``2c`` in ``like``'s dtype and device, made once (a ``torch.tensor`` call per
    tile costs as much as a small element-wise pass)."""
    key = (like.dtype, like.device)
    if key not in _TWO_C:
        _TWO_C[key] = torch.tensor(2 * _GELU_C, dtype=like.dtype, device=like.device)
    return _TWO_C[key]


def _gelu_and_derivative(h: torch.Tensor, act: torch.Tensor, deriv: torch.Tensor, tmp: torch.Tensor) -> None:
    """The tanh GELU of ``h`` into ``act`` and its derivative into ``deriv`` (``tmp``: scratch of h's shape;
    ``h`` is left unchanged), from one transcendental per element.

    ``gelu(h) = 0.5 h (1 + tanh(u)) = h s`` with ``u = c (h + a h^3)``, ``c = sqrt(2/pi)``, ``a = 0.044715``
    (Hendrycks & Gimpel 2016) and ``s = sigmoid(2u)``, since ``0.5 (1 + tanh(u)) = sigmoid(2u)``; its
    derivative is ``s + h s (1 - s) (2c + 6ca h^2)``.  PyTorch's ``gelu`` and ``gelu_backward`` each
    evaluate the tanh; here the forward computes ``s`` once, the activation and the derivative from it in
    nine in-place passes over cache-resident tiles, and the backward is one multiplication."""
    two_c = _two_c(h)
    torch.mul(h, h, out=tmp)                                          # h^2
    torch.add(two_c, tmp, alpha=2 * _GELU_C * _GELU_A, out=deriv)
    deriv.mul_(h).sigmoid_()                                          # s = sigmoid(2u)
    torch.mul(h, deriv, out=act)                                      # gelu = h s
    torch.add(two_c, tmp, alpha=6 * _GELU_C * _GELU_A, out=tmp)
    tmp.mul_(h)                                                       # r = h (2c + 6ca h^2)
    torch.addcmul(tmp, tmp, deriv, value=-1.0, out=tmp)               # r (1 - s)
    torch.addcmul(deriv, tmp, deriv, out=deriv)                       # s + s r (1 - s)


def _tiles(bounds: Bounds, tile: int):
    """The row buffer in tiles of at most ``tile`` rows: ``(first row, end row, pieces)`` with ``pieces``
    the ``(local expert, first row, end row)`` parts of the segments ``bounds`` inside the tile.  A segment
    longer than a tile is cut into full tiles (its remainder may share the next tile); shorter segments
    are packed whole into shared tiles, never cut, so with many small segments (many experts) the
    element-wise GELU passes run once per tile rather than once per expert, while every expert still runs
    one matmul per piece of its rows."""
    pieces = []
    for j, a, b in bounds:
        if pieces and b - pieces[0][1] > tile:                # does not fit the open tile: close it
            yield pieces[0][1], pieces[-1][2], pieces
            pieces = []
        while b - a > tile:
            yield a, a + tile, [(j, a, a + tile)]
            a += tile
        pieces.append((j, a, b))
    if pieces:
        yield pieces[0][1], pieces[-1][2], pieces


def _gelu_scratch(x: torch.Tensor, rows: int, hidden: int) -> torch.Tensor:
    """Scratch for :func:`_gelu_tile`: ``x``'s dtype when it is fp32 or fp64, else fp32."""
    wide = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    return x.new_empty(rows, hidden, dtype=wide)


def _gelu_tile(pre: torch.Tensor, act: torch.Tensor, deriv: torch.Tensor, tmp: torch.Tensor) -> None:
    """:func:`_gelu_and_derivative` of one tile ``pre`` into ``act`` and ``deriv`` (``pre``'s dtype); a
    low-precision tile runs it in fp32 (``tmp``: fp32 scratch then), as PyTorch's own kernel does."""
    if tmp.dtype == pre.dtype:
        _gelu_and_derivative(pre, act, deriv, tmp)
        return
    h, g_act, g_der = pre.to(tmp.dtype), torch.empty_like(tmp), torch.empty_like(tmp)
    _gelu_and_derivative(h, g_act, g_der, tmp)
    act.copy_(g_act)
    deriv.copy_(g_der)


class CacheTiledKernel:
    """The CPU kernel: tiles of ``row_tile`` rows whose pre-activation, activation and GELU derivative (rows
    x hidden floats each, 512 KiB at 256 x 512) stay in the L2 cache across the first matmul, the GELU's
    element-wise passes and the second matmul (in the backward: between ``d act``'s matmul and its product
    with the derivative), so the nine element-wise passes do not go out to memory.

    The tile is the default because tiles of 128-512 rows beat one tile per segment on this project's CPU
    (BENCHMARKS.md, the MoE section, for the ablations).  It saves the activation and the derivative (the
    backward evaluates no transcendental); with ``recompute`` it saves the pre-activation alone and the
    backward re-derives both, tile by tile, from it (Korthikanti et al. 2022's selective recomputation
    applied to the experts' activation, as Megatron-core's ``recompute_modules = ["moe_act"]``): one
    rows x hidden tensor less kept per layer for one more GELU evaluation."""

    #: the default tile (see the ablation above)
    ROW_TILE = 256

    def __init__(self, row_tile: int = ROW_TILE, recompute: bool = False):
        if row_tile < 1:
            raise ValueError(f"row_tile={row_tile} must be >= 1")
        self.row_tile, self.recompute = row_tile, recompute

    def forward(self, x, bounds, weights, El, bias, out):
        """Per tile: every expert piece's first matmul (bias folded in: ``addmm``), the GELU *and its
        derivative* over the whole tile from one sigmoid (:func:`_gelu_and_derivative`), every piece's
        second matmul, while the tile is in cache.  Returns ``(act, deriv)``, or ``(pre,)`` with
        ``recompute``."""
        w_fc, w_proj, b_fc, b_proj = _split_weights(weights, El, bias)
        M, H = x.shape[0], w_fc[0].shape[1]
        T = min(self.row_tile, M)
        saved = x.new_empty(1 if self.recompute else 2, M, H)
        if saved.device.type == "cpu":
            # fresh pages every step (glibc returns large freed blocks to the OS): one fault per 2 MiB
            # instead of one per 4 KiB on first touch
            hostmem.advise_huge_pages(saved)
        tmp_buf = _gelu_scratch(x, T, H)
        if self.recompute:
            # the pre-activation is kept; the activation and derivative live one tile at a time
            (pre_all,), act_buf, deriv_buf = saved.unbind(0), x.new_empty(T, H), x.new_empty(T, H)
        else:
            (act_all, deriv_all), pre_buf = saved.unbind(0), x.new_empty(T, H)   # the reverse
        for a, b, pieces in _tiles(bounds, self.row_tile):
            n = b - a
            if self.recompute:
                pre, act, deriv = pre_all[a:b], act_buf[:n], deriv_buf[:n]
            else:
                pre, act, deriv = pre_buf[:n], act_all[a:b], deriv_all[a:b]
            for j, pa, pb in pieces:
                _linear_into(pre[pa - a:pb - a], x[pa:pb], w_fc[j], b_fc[j])
            _gelu_tile(pre, act, deriv, tmp_buf[:n])
            for j, pa, pb in pieces:
                _linear_into(out[pa:pb], act[pa - a:pb - a], w_proj[j], b_proj[j])
        return tuple(saved.unbind(0))

    def backward(self, grad, x, saved, bounds, weights, El, acc, g_x):
        """Per tile, ``d act = grad w_proj^T`` into a reused cache-resident buffer, multiplied by the
        derivative and written over it (it is read once), so the saved derivative becomes ``d pre`` with
        no new allocation; then per expert segment one matmul each for ``d x``, ``d w_fc``, ``d w_proj``
        over all the segment's rows (the weight gradients want the long reduction dimension), and the bias
        sums.  With ``recompute`` each tile's activation and derivative are re-derived from the saved
        pre-activation first, ``d w_proj`` is taken per tile piece (the activation lives one tile at a time)
        and ``d pre`` is written over the pre-activation."""
        w_fc, w_proj = weights[:El], weights[El:2 * El]
        H = saved[0].shape[1]
        T = min(self.row_tile, x.shape[0])
        gh_buf = x.new_empty(T, H)
        if self.recompute:
            (d_pre,) = saved
            act_buf, deriv_buf, tmp_buf = x.new_empty(T, H), x.new_empty(T, H), _gelu_scratch(x, T, H)
        else:
            act, d_pre = saved
        for a, b, pieces in _tiles(bounds, self.row_tile):
            n = b - a
            g_act = gh_buf[:n]
            for j, pa, pb in pieces:
                torch.mm(grad[pa:pb], w_proj[j].t(), out=g_act[pa - a:pb - a])
            if self.recompute:
                act_t, deriv = act_buf[:n], deriv_buf[:n]
                _gelu_tile(d_pre[a:b], act_t, deriv, tmp_buf[:n])
                for j, pa, pb in pieces:
                    acc.add_proj(j, act_t[pa - a:pb - a], grad[pa:pb])
            else:
                deriv = d_pre[a:b]
            torch.mul(g_act, deriv, out=d_pre[a:b])
        for j, a, b in bounds:
            if g_x is not None:
                torch.mm(d_pre[a:b], w_fc[j].t(), out=g_x[a:b])
            acc.add_fc(j, x[a:b], d_pre[a:b])
            if not self.recompute:
                acc.add_proj(j, act[a:b], grad[a:b])


# ---------------------------------------------------------------------------------------------------
# GPUs: whole segments, fused element-wise kernels


class SegmentKernel:
    """The accelerator kernel: one matmul per expert segment over all its rows into one buffer, then the
    GELU over the whole buffer as one fused kernel (``F.gelu``); in the backward ``gelu_backward`` over the
    whole buffer, one kernel.  It saves the activation and the pre-activation (with ``recompute`` the
    pre-activation alone, the activation evaluated again at the start of the backward: one rows x hidden
    tensor less kept per layer, as Megatron-core's ``recompute_modules = ["moe_act"]``); the backward writes
    ``d act`` over the activation (each segment's ``d w_proj`` is taken first) and ``d pre`` over the
    pre-activation.  Low-precision GELUs compute in fp32 inside PyTorch's kernels."""

    def __init__(self, recompute: bool = False):
        self.recompute = recompute

    def forward(self, x, bounds, weights, El, bias, out):
        w_fc, w_proj, b_fc, b_proj = _split_weights(weights, El, bias)
        pre = x.new_empty(x.shape[0], w_fc[0].shape[1])
        for j, a, b in bounds:
            _linear_into(pre[a:b], x[a:b], w_fc[j], b_fc[j])
        act = F.gelu(pre, approximate="tanh")
        for j, a, b in bounds:
            _linear_into(out[a:b], act[a:b], w_proj[j], b_proj[j])
        return (pre,) if self.recompute else (act, pre)

    def backward(self, grad, x, saved, bounds, weights, El, acc, g_x):
        if self.recompute:
            (pre,) = saved
            act = F.gelu(pre, approximate="tanh")
        else:
            act, pre = saved
        w_fc, w_proj = weights[:El], weights[El:2 * El]
        for j, a, b in bounds:
            acc.add_proj(j, act[a:b], grad[a:b])
            torch.mm(grad[a:b], w_proj[j].t(), out=act[a:b])            # d act, over the spent activation
        d_pre = torch.ops.aten.gelu_backward.grad_input(act, pre, approximate="tanh", grad_input=pre)
        for j, a, b in bounds:
            if g_x is not None:
                torch.mm(d_pre[a:b], w_fc[j].t(), out=g_x[a:b])
            acc.add_fc(j, x[a:b], d_pre[a:b])


_KERNELS = {(cpu, recompute): CacheTiledKernel(recompute=recompute) if cpu else SegmentKernel(recompute=recompute)
            for cpu in (True, False) for recompute in (False, True)}


def kernel_for(device: torch.device, recompute: bool = False) -> ExpertKernel:
    """The kernel for tensors on ``device``: :class:`CacheTiledKernel` on a CPU, :class:`SegmentKernel`
    elsewhere; ``recompute``: the variant that keeps the pre-activation alone for the backward."""
    return _KERNELS[(device.type == "cpu", recompute)]


__all__ = ["ExpertKernel", "CacheTiledKernel", "SegmentKernel", "WeightGrads", "kernel_for", "segment_bounds",
           "cast_weights"]
