"""How the experts' feed-forward networks run on a buffer of rows sorted by expert: the grouped expert kernels.

The MoE layer (:mod:`podscale.parallel.moe.layer`) hands an :class:`ExpertKernel` one buffer of rows at a
time, laid out as consecutive segments, one per (local expert, source): ``bounds`` lists them as
``(local expert, first row, end row)``.  Every expert computes ``gelu(x w_fc + b_fc) w_proj + b_proj``
(tanh GELU, Hendrycks & Gimpel 2016) on its segments; the kernel writes the outputs, keeps what its
backward needs, and in the backward writes the input gradient and adds the weight gradients to a
:class:`WeightGrads`.  Every kernel runs each expert's matmuls on its segments' rows only, never a padded
or S×E×C tensor; they differ in how they meet their device's cost model:

* :class:`CacheTiledKernel` (CPUs): the buffer in tiles of a few hundred rows whose pre-activation,
  activation and GELU derivative stay in the L2 cache between the two matmuls; the GELU and its derivative
  from one sigmoid in element-wise passes over the tile (PyTorch's ``gelu`` and ``gelu_backward`` each
  evaluate the tanh, several plain passes' worth of work per element on a CPU core).
* :class:`SegmentKernel` (GPUs and other accelerators): each matmul over the expert's whole segment and the
  GELU and its backward as PyTorch's fused kernels over the whole buffer, one launch each: on a GPU the
  element-wise work is memory-bound and a launch costs microseconds, so tiles (more launches) and nine
  separate passes (nine trips through memory) would both cost more than they save.
* :class:`GroupedGemmKernel` (GPUs whose PyTorch has a fused grouped GEMM: bf16 on NVIDIA SM90 and SM100): as the
  segment kernel, with each matmul kind over all the segments in one grouped-GEMM launch instead of one
  launch per expert.

:func:`kernel_for` picks by device, dtype and widths; a layer can be given any explicitly.  All keep two
(rows × hidden) tensors for the backward, as many bytes as autograd keeps for two linears and a GELU beside
the input; built with ``recompute`` they keep one, the pre-activation, and evaluate the GELU again in the
backward.
"""
from __future__ import annotations

import functools
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
    exchange).

    Gradients the kernel asks this to compute (:meth:`add_fc`, :meth:`add_proj`, :meth:`add_biases`) are written
    into views of one buffer for all El experts, allocated at the first of them: on a CPU a step's expert
    gradients are fresh memory (the previous step's were freed by ``zero_grad``), and one buffer advised onto
    huge pages (:func:`~podscale.runtime.hostmem.advise_huge_pages`) faults in once per 2 MiB where El x 4
    separate outputs would each be faulted in page by page (32 local experts' 256 KiB matrices: 16 MiB a layer;
    BENCHMARKS.md, the MoE section); every expert's bias gradient is one row of a block, summed over all the
    segments in one ``index_add`` rather than one sum per segment (a small block of its own, fp32 for 16-bit
    rows).  Autograd takes the views as the parameters' ``.grad`` as they are (contiguous, the parameters'
    strides).  Gradients a kernel computes itself (:meth:`put_fc`, :meth:`put_proj`: the grouped-GEMM kernel's)
    are kept as given."""

    #: the gradient kinds in the kernel's parameter order
    KINDS = ("fc", "proj", "b_fc", "b_proj")

    def __init__(self, El: int, bias: bool):
        self.El, self.bias = El, bias
        self.grads: dict[str, list[torch.Tensor | None]] = {kind: [None] * El for kind in self.KINDS}
        #: every expert's gradients of a kind as one (El, ...) block: ``fc``, ``proj`` of the one buffer, ``b_fc``,
        #: ``b_proj`` the bias blocks (each kind from its first add on)
        self._blocks: dict[str, torch.Tensor] = {}

    def add_proj(self, j: int, act: torch.Tensor, grad: torch.Tensor) -> None:
        """Expert ``j``'s second linear: ``d w_proj += act^T grad`` (its bias: :meth:`add_biases`)."""
        self._add("proj", j, act, grad, hidden=act.shape[1], d_model=grad.shape[1])

    def add_fc(self, j: int, x: torch.Tensor, d_pre: torch.Tensor) -> None:
        """Expert ``j``'s first linear: ``d w_fc += x^T d_pre`` (its bias: :meth:`add_biases`)."""
        self._add("fc", j, x, d_pre, hidden=d_pre.shape[1], d_model=x.shape[1])

    def add_biases(self, grad: torch.Tensor, d_pre: torch.Tensor, bounds: Bounds) -> None:
        """Every segment's bias gradients, ``d b_proj += sum(grad)`` and ``d b_fc += sum(d_pre)`` over its
        rows, into its expert's row of the two bias blocks: one ``index_add`` each over all the rows
        (``bounds`` lie end to end, as :func:`segment_bounds` lays them), accumulated in fp32 for 16-bit rows
        (as ``sum`` accumulates).  Nothing without biases."""
        if not self.bias or not bounds:
            return
        if "b_fc" not in self._blocks:
            wide = grad.dtype if grad.dtype in (torch.float32, torch.float64) else torch.float32
            for kind, width in (("b_fc", d_pre.shape[1]), ("b_proj", grad.shape[1])):
                self._blocks[kind] = grad.new_zeros(self.El, width, dtype=wide)
                self.grads[kind] = list(self._blocks[kind].unbind(0))
        first, end = bounds[0][1], bounds[-1][2]
        lengths = torch.tensor([b - a for _, a, b in bounds])
        expert = torch.repeat_interleave(torch.tensor([j for j, _, _ in bounds]), lengths, output_size=end - first)
        expert = expert.to(grad.device)
        for kind, rows in (("b_proj", grad), ("b_fc", d_pre)):
            block = self._blocks[kind]
            block.index_add_(0, expert, rows[first:end].to(block.dtype))

    def put_proj(self, j: int, d_w: torch.Tensor, d_b: torch.Tensor | None) -> None:
        """Expert ``j``'s second linear's gradients for one piece of rows, computed by the caller."""
        self._put("proj", j, d_w, d_b)

    def put_fc(self, j: int, d_w: torch.Tensor, d_b: torch.Tensor | None) -> None:
        """Expert ``j``'s first linear's gradients for one piece of rows, computed by the caller."""
        self._put("fc", j, d_w, d_b)

    def _buffer(self, like: torch.Tensor, hidden: int, d_model: int) -> dict[str, torch.Tensor]:
        """The weight-gradient blocks of the one buffer, (El, d, h) for ``w_fc`` and (El, h, d) for ``w_proj``,
        in ``like``'s dtype and device (allocated at the first call)."""
        if "fc" not in self._blocks:
            size = self.El * d_model * hidden
            flat = like.new_empty(2 * size)
            if flat.device.type == "cpu":
                hostmem.advise_huge_pages(flat)
            self._blocks["fc"] = flat[:size].view(self.El, d_model, hidden)
            self._blocks["proj"] = flat[size:].view(self.El, hidden, d_model)
        return self._blocks

    def _add(self, kind: str, j: int, inp: torch.Tensor, grad_out: torch.Tensor, hidden: int, d_model: int) -> None:
        held = self.grads[kind]
        if held[j] is None:
            held[j] = torch.mm(inp.t(), grad_out, out=self._buffer(inp, hidden, d_model)[kind][j])
        else:
            held[j].addmm_(inp.t(), grad_out)

    def _put(self, kind: str, j: int, d_w: torch.Tensor, d_b: torch.Tensor | None) -> None:
        for k, g in [(kind, d_w)] + ([("b_" + kind, d_b)] if self.bias else []):
            held = self.grads[k]
            held[j] = g if held[j] is None else held[j].add_(g)

    def result(self, params, like: torch.Tensor) -> list[torch.Tensor]:
        """The gradients in ``params``' order and dtype (w_fc..., w_proj..., then b_fc..., b_proj...); an
        expert without rows gets a zero gradient, never a missing one."""
        kinds = self.KINDS if self.bias else self.KINDS[:2]
        out = []
        for i, kind in enumerate(kinds):
            for j, (g, p) in enumerate(zip(self.grads[kind], params[i * self.El:(i + 1) * self.El])):
                if g is None:
                    g = self._blocks[kind][j].zero_() if kind in self._blocks else like.new_zeros(p.shape)
                out.append(g if g.dtype == p.dtype else g.to(p.dtype))
        return out


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
        acc.add_biases(grad, d_pre, bounds)


# ---------------------------------------------------------------------------------------------------
# GPUs: whole segments, fused element-wise kernels


def _kept(act: torch.Tensor, pre: torch.Tensor, recompute: bool) -> tuple[torch.Tensor, ...]:
    """What the accelerator kernels keep for the backward: the activation and the pre-activation, or with
    ``recompute`` the pre-activation alone."""
    return (pre,) if recompute else (act, pre)


def _activation_and_pre(saved: tuple[torch.Tensor, ...], recompute: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_kept` at the start of a backward: the activation evaluated again from the
    pre-activation when only that was kept (PyTorch's fused GELU, one pass)."""
    if recompute:
        (pre,) = saved
        return F.gelu(pre, approximate="tanh"), pre
    act, pre = saved
    return act, pre


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
        return _kept(act, pre, self.recompute)

    def backward(self, grad, x, saved, bounds, weights, El, acc, g_x):
        act, pre = _activation_and_pre(saved, self.recompute)
        w_fc, w_proj = weights[:El], weights[El:2 * El]
        for j, a, b in bounds:
            acc.add_proj(j, act[a:b], grad[a:b])
            torch.mm(grad[a:b], w_proj[j].t(), out=act[a:b])            # d act, over the spent activation
        d_pre = torch.ops.aten.gelu_backward.grad_input(act, pre, approximate="tanh", grad_input=pre)
        for j, a, b in bounds:
            if g_x is not None:
                torch.mm(d_pre[a:b], w_fc[j].t(), out=g_x[a:b])
            acc.add_fc(j, x[a:b], d_pre[a:b])
        acc.add_biases(grad, d_pre, bounds)


# ---------------------------------------------------------------------------------------------------
# GPUs with a grouped GEMM: every expert's matmul in one launch


class _Groups:
    """The segments of one buffer as grouped-GEMM groups: group ``g`` is segment ``g`` (rows ``[ends[g-1],
    ends[g])``, expert ``experts[g]``); ``offs`` the int32 group ends on the buffer's device, ``row_group``
    (built on first use) each row's group, for the per-expert biases and their gradients."""

    def __init__(self, bounds: Bounds, rows: int, device: torch.device):
        start = 0
        for _, a, b in bounds:
            if a != start:
                raise ValueError(f"expert segments must tile the rows: a segment starts at row {a}, not {start}")
            start = b
        if start != rows:
            raise ValueError(f"expert segments cover {start} rows of {rows}")
        self.experts = [j for j, _, _ in bounds]
        self.sizes = [b - a for _, a, b in bounds]
        self.offs = torch.tensor([b for _, _, b in bounds], dtype=torch.int32, device=device)
        self.rows, self.device, self._row_group = rows, device, None

    def stack(self, per_expert) -> torch.Tensor:
        """Each group's expert's tensor, stacked group-major (an expert with several segments repeats)."""
        return torch.stack([per_expert[j] for j in self.experts])

    def row_group(self) -> torch.Tensor:
        if self._row_group is None:
            self._row_group = torch.repeat_interleave(
                torch.arange(len(self.sizes), device=self.device),
                torch.tensor(self.sizes, device=self.device), output_size=self.rows)
        return self._row_group

    def add_bias(self, t: torch.Tensor, per_expert) -> None:
        """``t[row] += bias of the row's expert``."""
        t.add_(self.stack(per_expert).index_select(0, self.row_group()))

    def sums(self, t: torch.Tensor) -> torch.Tensor:
        """(groups, cols): each group's rows of ``t`` summed (the bias gradients)."""
        return t.new_zeros(len(self.sizes), t.shape[1]).index_add_(0, self.row_group(), t)


class GroupedGemmKernel:
    """The grouped-GEMM kernel: each of the four matmul kinds of the experts (``x w_fc``, ``act w_proj``,
    and in the backward ``d act``, ``d x``) over every expert segment in one ``torch.nn.functional.
    grouped_mm`` launch (CUTLASS's grouped GEMM on NVIDIA SM90 / SM100 in bf16), the weight gradients likewise as
    one grouped GEMM of the transposed rows per kind (each group reduces over its own rows), and the GELU as
    :class:`SegmentKernel` runs it.  With many experts the per-segment loop of :class:`SegmentKernel` costs
    one launch per expert and matmul kind (six per expert and step), which a grouped GEMM replaces with six
    in all, as torchtitan's MoE (``torch._grouped_mm``) and Megatron-core's ``GroupedMLP`` (cuBLAS / CUTLASS
    grouped GEMM) do.  The weights are stacked per call in group order (one copy, which the cast to the
    compute dtype costs anyway under mixed precision).  Outputs and saved tensors as :class:`SegmentKernel`'s.

    PyTorch's grouped GEMM takes fp32, bf16 and fp16 (fp64 is refused); elsewhere than its fast path it runs
    a loop of matmuls inside one call, so :func:`kernel_for` picks this kernel only where the fast path
    exists."""

    def __init__(self, recompute: bool = False):
        self.recompute = recompute

    def forward(self, x, bounds, weights, El, bias, out):
        w_fc, w_proj, b_fc, b_proj = _split_weights(weights, El, bias)
        if not bounds:
            pre = x.new_empty(0, w_fc[0].shape[1])
            return _kept(pre, pre, self.recompute)
        groups = _Groups(bounds, x.shape[0], x.device)
        pre = F.grouped_mm(x, groups.stack(w_fc), offs=groups.offs)
        if bias:
            groups.add_bias(pre, b_fc)
        act = F.gelu(pre, approximate="tanh")
        y = F.grouped_mm(act, groups.stack(w_proj), offs=groups.offs)
        if bias:
            groups.add_bias(y, b_proj)
        out.copy_(y)
        return _kept(act, pre, self.recompute)

    def backward(self, grad, x, saved, bounds, weights, El, acc, g_x):
        if not bounds:
            return
        act, pre = _activation_and_pre(saved, self.recompute)
        w_fc, w_proj = weights[:El], weights[El:2 * El]
        groups = _Groups(bounds, x.shape[0], x.device)
        d_w_proj = F.grouped_mm(act.t(), grad, offs=groups.offs)                  # (groups, h, d)
        d_act = F.grouped_mm(grad, groups.stack(w_proj).transpose(1, 2), offs=groups.offs)
        d_pre = torch.ops.aten.gelu_backward.grad_input(d_act, pre, approximate="tanh", grad_input=pre)
        del d_act
        d_w_fc = F.grouped_mm(x.t(), d_pre, offs=groups.offs)                     # (groups, d, h)
        if g_x is not None:
            g_x.copy_(F.grouped_mm(d_pre, groups.stack(w_fc).transpose(1, 2), offs=groups.offs))
        b_proj = groups.sums(grad) if acc.bias else [None] * len(groups.experts)
        b_fc = groups.sums(d_pre) if acc.bias else [None] * len(groups.experts)
        for g, j in enumerate(groups.experts):
            acc.put_proj(j, d_w_proj[g], b_proj[g])
            acc.put_fc(j, d_w_fc[g], b_fc[g])


#: one stateless instance per (name, recompute)
_KERNELS = {(name, recompute): cls(recompute=recompute)
            for name, cls in (("tiled", CacheTiledKernel), ("segment", SegmentKernel), ("grouped", GroupedGemmKernel))
            for recompute in (False, True)}


@functools.cache
def has_fast_grouped_gemm(device: torch.device, dtype: torch.dtype, d_model: int, d_hidden: int) -> bool:
    """Whether PyTorch's grouped GEMM has its fused kernel for experts of these widths in ``dtype`` on
    ``device``: bf16 on NVIDIA GPUs of compute capability 9.x and 10.x (Hopper, datacenter Blackwell; CUTLASS,
    what PyTorch's ``_grouped_mm_cuda`` takes its fast path on), with
    both widths whole multiples of 16 bytes (its operands' leading dimensions; then every row slice the
    layer hands a kernel starts 16-byte aligned too).  Elsewhere ``grouped_mm`` runs a loop of matmuls or
    refuses the strides, and :class:`SegmentKernel` is the better loop.  Cached: every MoE layer asks at
    every call."""
    aligned = all(w * torch.finfo(dtype).bits % 128 == 0 for w in (d_model, d_hidden))
    return (device.type == "cuda" and dtype == torch.bfloat16 and aligned and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] in (9, 10))


def kernel_for(device: torch.device, dtype: torch.dtype, d_model: int, d_hidden: int,
               recompute: bool = False) -> ExpertKernel:
    """The kernel for experts ``d_model -> d_hidden -> d_model`` computing in ``dtype`` on ``device``:
    :class:`CacheTiledKernel` on a CPU, :class:`GroupedGemmKernel` where PyTorch's grouped GEMM is fused
    (:func:`has_fast_grouped_gemm`), :class:`SegmentKernel` elsewhere; ``recompute``: the variant that keeps
    the pre-activation alone for the backward."""
    if device.type == "cpu":
        return _KERNELS[("tiled", recompute)]
    fast = has_fast_grouped_gemm(device, dtype, d_model, d_hidden)
    return _KERNELS[("grouped" if fast else "segment", recompute)]


#: the kernels a config can name (``model.expert_kernel``), "auto" being :func:`kernel_for`'s choice per call
KERNEL_NAMES = ("auto", "tiled", "segment", "grouped")


def kernel_named(name: str, recompute: bool = False) -> ExpertKernel | None:
    """The kernel a config names (:data:`KERNEL_NAMES`); None for "auto" (the layer asks :func:`kernel_for`
    at each call)."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"expert kernel {name!r} is not one of {', '.join(KERNEL_NAMES)}")
    return None if name == "auto" else _KERNELS[(name, recompute)]


__all__ = ["ExpertKernel", "CacheTiledKernel", "SegmentKernel", "GroupedGemmKernel", "WeightGrads", "kernel_for",
           "has_fast_grouped_gemm", "kernel_named", "KERNEL_NAMES", "segment_bounds", "cast_weights"]
