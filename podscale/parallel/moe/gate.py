"""Routing for mixture-of-experts layers: a linear router, top-k gating with expert capacity, the
auxiliary losses and the per-step routing statistics.

References (equation numbers are the papers'):

* GShard — Lepikhin et al. 2020, "GShard: Scaling Giant Models with Conditional Computation and Automatic
  Sharding", section 2.2 and Algorithm 1: top-2 gating, expert capacity, first choices before second choices,
  the second expert kept with probability ``2 * g2`` (random routing), tokens over capacity dropped and
  carried by the residual connection, the auxiliary load-balancing loss.
* Switch — Fedus et al. 2021, "Switch Transformers", section 2.1-2.2: top-1 routing with the gate value as
  the output scale (eq. 2), capacity ``(tokens per batch / experts) * capacity factor`` (eq. 3), and the
  load-balancing loss ``alpha * N * sum_i f_i * P_i`` (eq. 4-6), here ``E * sum_e f_e * P_e``.
* ST-MoE — Zoph et al. 2022, "ST-MoE: Designing Stable and Transferable Sparse Expert Models", eq. 5: the
  router z-loss ``1/B sum_i (log sum_j exp(x_ij))^2``.
* DeepSeek-V3 — DeepSeek-AI 2024, section 2.1.2, "auxiliary-loss-free load balancing": a per-expert bias
  added to the affinities for the top-k *selection* only (gate values come from the unbiased scores),
  moved after each step by ``gamma`` towards balance: ``b_e -= gamma`` for an overloaded expert, ``+= gamma``
  for an underloaded one.  Section 2.1.2 also gives its gating (eq. 15-16): sigmoid affinities
  ``s = sigmoid(u^T e)`` instead of a softmax, the gate values the chosen affinities normalised over the k
  choices and scaled (the routed scaling factor), and node-limited routing (also section 2.1.2): the experts in M
  groups, a token choosing only among the experts of its best few groups, a group ranked by the sum of its
  highest affinities (Megatron-core's ``moe_router_score_function = "sigmoid"``,
  ``moe_router_num_groups``, ``moe_router_group_topk``, ``moe_router_topk_scaling_factor``): see
  :class:`Gating`.
* Global-batch balancing — Qiu et al. 2025, "Demons in the Detail: On Implementing Load Balancing Loss for
  Training Specialized Mixture-of-Expert Models": the load-balancing loss with ``f_e`` counted over the whole
  global batch (every data-, expert- and tensor-parallel rank's tokens) instead of each group's, ``P_e`` staying
  local, so experts are balanced over the batch rather than inside every sequence and can specialise by
  domain (Megatron-core's ``moe_router_load_balancing_type = "global_aux_loss"``; Qwen3-MoE): see
  :func:`first_choice_counts` and :func:`load_balancing_loss`.  The paper also reaches the global batch of a
  step run as several micro-batches (gradient accumulation) with a buffer of the counts of the step's
  micro-batches so far, micro-batch m's loss taking its ``f_e`` from micro-batches 1..m: see :class:`StepCounts`.

Groups: GShard splits the tokens into G groups of S tokens and applies the capacity per group.  Here the
second-to-last dimension of the layer's input is the group (a GPT's (B, T, d) input: one group per sequence),
so the groups, and with them every routing decision, are the same whatever the data-parallel or
expert-parallel layout.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from podscale.runtime import comm


def expert_capacity(capacity_factor: float, top_k: int, group_size: int, experts: int) -> int:
    """GShard's expert capacity per group: ``C = ceil(capacity_factor * k * S / E)``."""
    return math.ceil(capacity_factor * top_k * group_size / experts)


# ---------------------------------------------------------------------------------------------------
# deterministic per-token uniforms (random routing that every layout draws identically)

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (the "lowbias32" multiply-xorshift) on int64 tensors holding values
    below 2**32; every product stays below 2**63, so the arithmetic is exact on every device."""
    x = x & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def routing_uniform(keys: torch.Tensor, seed: int) -> torch.Tensor:
    """Uniform numbers in [0, 1) as a pure function of (``seed``, each token's integer key).

    A token's draw depends on its own key, never on where it sits in a rank's batch, so one process and
    every (dp, ep) split of the same global batch make the same random-routing decisions.
    """
    k = keys.to(torch.int64)
    h = _mix32(_mix32(k & _MASK32) ^ _mix32((k >> 32) & _MASK32) ^ (seed & _MASK32))
    h = _mix32(h ^ ((seed >> 32) & _MASK32))
    return h.to(torch.float64).div_(2.0**32).to(torch.float32)


def sequence_token_keys(idx: torch.Tensor) -> torch.Tensor:
    """(B, T) integer keys for the tokens of integer sequences ``idx``: a hash of the whole sequence's ids
    combined with the position, so the same sample gives the same keys on any rank."""
    B, T = idx.shape
    powers, w = [], 1
    for _ in range(T):  # powers of a prime modulo 2**31 - 1 (products stay below 2**62)
        powers.append(w)
        w = w * 1_000_003 % (2**31 - 1)
    w = torch.tensor(powers, dtype=torch.int64, device=idx.device)
    row = ((idx.to(torch.int64) + 1) * w).sum(1) % (2**31 - 1)
    pos = torch.arange(T, dtype=torch.int64, device=idx.device)
    return (_mix32(row)[:, None] << 20) + pos[None, :]


# ---------------------------------------------------------------------------------------------------
# routing


@dataclass(frozen=True)
class Gating:
    """How router logits become expert choices and gate values.

    * ``score``: ``"softmax"`` (GShard, Switch: probabilities over the experts) or ``"sigmoid"``
      (DeepSeek-V3 eq. 15: each expert's affinity on its own, ``sigmoid(logit)``, so one expert's score does
      not depend on the others').  With k > 1 the gate values are the chosen scores normalised over the k
      choices either way (GShard's rule; DeepSeek-V3 eq. 13); with k = 1 the chosen score itself (Switch
      eq. 2: normalising one choice would leave the router without a gradient from the loss).
    * ``groups``, ``group_top_k``: node-limited routing (DeepSeek-V3 section 2.1.2; Megatron-core's
      group-limited routing): the E experts in ``groups`` consecutive groups of E/groups (experts
      ``[g E/groups, (g+1) E/groups)``; laid over the ep ranks, a group is a rank or a node), each
      token's groups ranked by the sum of their ``max(1, k // group_top_k)`` highest selection scores, and
      its k experts chosen among the experts of its best ``group_top_k`` groups only, so its tokens
      travel to at most ``group_top_k`` groups.  ``groups = 1``: no limit.
    * ``scale``: the gate values times this (DeepSeek-V3's routed scaling factor, 2.5 there; 1: none).

    The auxiliary loss's router probabilities are the softmax, or for sigmoid scores the scores normalised
    over all experts (DeepSeek-V3 eq. 20's ``s'``)."""

    score: str = "softmax"
    groups: int = 1
    group_top_k: int = 1
    scale: float = 1.0

    #: the score functions
    SCORES = ("softmax", "sigmoid")

    def check(self, experts: int, top_k: int) -> None:
        """One-line ValueErrors naming the setting and the fix."""
        if self.score not in self.SCORES:
            raise ValueError(f"router score {self.score!r} is not one of {', '.join(self.SCORES)}")
        if not self.scale > 0:
            raise ValueError(f"router scale={self.scale} must be > 0 (1: gate values unscaled)")
        if self.groups < 1 or experts % self.groups:
            raise ValueError(f"router groups={self.groups} must divide the {experts} experts into equal groups: "
                             "use a divisor of the experts (1: no group limit)")
        if not 1 <= self.group_top_k <= self.groups:
            raise ValueError(f"router group_top_k={self.group_top_k} must be between 1 and the {self.groups} "
                             "groups")
        if top_k > self.group_top_k * (experts // self.groups):
            raise ValueError(f"top_k={top_k} exceeds the {self.group_top_k * (experts // self.groups)} experts of "
                             f"a token's {self.group_top_k} groups: raise group_top_k or lower top_k")

    def scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the scores the gates come from, the router probabilities of the auxiliary loss)."""
        if self.score == "softmax":
            probs = torch.softmax(logits, dim=-1)
            return probs, probs
        s = torch.sigmoid(logits)
        return s, s / s.sum(-1, keepdim=True)

    def allowed(self, scores: torch.Tensor, top_k: int) -> torch.Tensor:
        """``scores`` (..., E) with every expert outside a token's best ``group_top_k`` groups set to -inf
        (itself when ``groups = 1``)."""
        if self.groups == 1:
            return scores
        E = scores.shape[-1]
        per_group = scores.unflatten(-1, (self.groups, E // self.groups))
        m = min(max(1, top_k // self.group_top_k), E // self.groups)
        # a group's rank: the sum of its m best scores (a sum of values: ties inside a group do not matter)
        group_score = per_group.topk(m, dim=-1).values.sum(-1)
        best = _top_choices(group_score, self.group_top_k)
        ok = torch.zeros_like(group_score, dtype=torch.bool).scatter_(-1, best, True)
        return per_group.masked_fill(~ok.unsqueeze(-1), float("-inf")).flatten(-2)


@dataclass
class Routing:
    """Every token's choices in a batch of G groups of S tokens (N = G * S), with k choices each.

    ``expert[n, j]`` is token n's j-th choice (global expert id), ``weight[n, j]`` its gate value
    (differentiable: Switch's ``p_i(x)`` for k = 1, GShard's normalised ``g_j / (g_1 + g_2)`` for k > 1),
    ``keep[n, j]`` whether that choice is dispatched (not skipped by random routing, within capacity) and
    ``position[n, j]`` its slot in the expert's buffer of its group (-1 when not kept).  ``wanted[n, j]``
    is whether the choice asked for a slot at all (random routing can skip a second choice);
    ``wanted & ~keep`` are the choices dropped for capacity.  ``order`` lists the kept choices (as
    ``n * k + j``) sorted by expert, then group, then priority: the dispatch order of the fast path;
    ``counts[e]`` is how many of them expert e gets, ``demand[e]`` how many choices asked it for a slot.
    """

    expert: torch.Tensor
    weight: torch.Tensor
    keep: torch.Tensor
    wanted: torch.Tensor
    position: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor
    capacity: int | None
    groups: int
    group_size: int
    demand: torch.Tensor


def _top_choices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(..., k): the indices of the k largest scores over the last dim, in descending order, ties to the
    lowest expert id.

    ``k`` passes of ``max`` (each best masked out for the next; ``max`` returns the first maximal index):
    ``topk``'s tie order is unspecified, and on the CPU at E = 64, k = 2 it takes about twice as long as
    two passes (torch 2.13)."""
    best = scores.max(-1, keepdim=True).indices
    if k == 1:
        return best
    picks, rest = [best], scores.clone()
    for _ in range(k - 1):
        rest.scatter_(-1, picks[-1], float("-inf"))
        picks.append(rest.max(-1, keepdim=True).indices)
    return torch.cat(picks, -1)


#: which choices keep an over-full expert's slots (``model.drop_policy``): ``"position"``, GShard's rule: every token's
#: first choice before any second choice, each in token order; ``"priority"``, Batch Prioritized Routing (Riquelme
#: et al. 2021, V-MoE, section 4.1): first choices before second choices still, but the tokens ranked by their
#: top routing score instead of their position, so a capacity drops the tokens the router is least sure of;
#: ``"probs"``, Megatron-core's ``moe_token_drop_policy = "probs"``: each expert keeps the choices with the highest
#: routing scores for it, first or second choices alike
DROP_POLICIES = ("position", "priority", "probs")


def check_drop_policy(policy: str) -> None:
    """A one-line ValueError naming the key and the choices for an unknown policy."""
    if policy not in DROP_POLICIES:
        raise ValueError(f"model.drop_policy={policy!r} is not one of {', '.join(DROP_POLICIES)}")


def _listing(gates: torch.Tensor, policy: str) -> torch.Tensor | None:
    """The choices of (G, S, k) scores ``gates`` in the order they claim capacity slots, as token-major ids
    ``n * k + j`` (:data:`DROP_POLICIES`); None for GShard's order with k = 1 (token order: the identity).
    Sorts are stable and descending, so equal scores keep token order and every layout lists the same."""
    G, S, k = gates.shape
    dev = gates.device
    ids = torch.arange(G * S * k, device=dev).view(G, S, k)
    if policy == "probs":
        return torch.sort(gates.detach().reshape(-1), descending=True, stable=True).indices
    if policy == "priority":
        order = torch.sort(gates.detach()[..., 0], dim=1, descending=True, stable=True).indices    # (G, S)
        ids = ids.gather(1, order.unsqueeze(-1).expand(G, S, k))
    elif k == 1:
        return None
    return ids.transpose(1, 2).reshape(-1)                    # (g, j, s): choice-major within each group


def route(logits: torch.Tensor, top_k: int, capacity: int | None, second_uniform: torch.Tensor | None = None,
          selection_bias: torch.Tensor | None = None, gating: Gating = Gating(),
          drop_policy: str = "position") -> tuple[Routing, torch.Tensor]:
    """GShard's Algorithm 1 generalised to k choices, on router logits of shape (G, S, E).

    * scores ``softmax(logits)`` (or ``sigmoid``: :class:`Gating`); the k experts with the highest ``scores
      + selection_bias`` (the bias is DeepSeek-V3's and only selects), among the experts of the token's
      best groups under a group limit;
    * gate values: ``p_e`` for k = 1 (Switch), normalised over the k choices for k > 1 (GShard, before any
      capacity check), times ``gating.scale``;
    * with ``second_uniform`` (G, S) given and k = 2, the second choice is kept when ``u < 2 * g_2``
      (GShard's random routing: kept with probability proportional to its weight);
    * with a ``capacity`` C, slots are handed out per group and expert in priority order: every token's
      first choice in token order, then every second choice, ... (``drop_policy = "position"``; or the
      tokens ranked by their top score, ``"priority"``; or every choice by its score, ``"probs"``:
      :data:`DROP_POLICIES`); a choice past slot C is dropped.  Without a capacity (dropless) every choice
      is kept.

    The slots come from one stable sort of the choices, listed in priority order (:func:`_listing`), by
    (expert, group): inside a segment the order is the priority order, so a choice's slot is its offset
    in the segment.  No (S, E) one-hot or cumulative sum is built.

    Returns the routing and the router probabilities (G, S, E) for the auxiliary loss.
    """
    G, S, E = logits.shape
    k, N, dev = top_k, G * S, logits.device
    # token-major (every token's E values in one row): a row's softmax is the same whatever N and the
    # token's place (a softmax over the tokens of an (E, N) layout vectorises across tokens, and the tail
    # of a vector loop rounds differently, which would let a layout flip a near-tie)
    scored, probs = gating.scores(logits)
    scores = scored.detach()
    if selection_bias is not None:
        scores = scores + selection_bias.to(scores.dtype)
    choice = _top_choices(gating.allowed(scores, k), k)                         # (G, S, k)
    gates = scored.gather(-1, choice)
    weight = gates if k == 1 else gates / gates.sum(-1, keepdim=True).clamp_min(torch.finfo(gates.dtype).tiny)
    wanted = torch.ones_like(choice, dtype=torch.bool)
    skips = second_uniform is not None and k == 2
    if skips:
        wanted[..., 1] = second_uniform.to(weight.dtype) < 2 * weight[..., 1].detach()
    if gating.scale != 1.0:
        weight = weight * gating.scale
    # the choices in priority order (token-major ids; None: token order), keyed by (expert, group)
    listing = _listing(gates, drop_policy)
    key = choice * G                                                            # (G, S, k)
    if G > 1:
        key = key + torch.arange(G, device=dev).view(G, 1, 1)
    key = key.reshape(-1)
    if skips:
        key = key.masked_fill(~wanted.reshape(-1), E * G)                       # skipped choices sort last
    if listing is not None:
        key = key.index_select(0, listing)
    sorted_key, perm = torch.sort(key, stable=True)
    seg_count = torch.bincount(key, minlength=E * G + 1)
    seg_start = torch.cumsum(seg_count, 0).sub_(seg_count)
    slot = torch.arange(N * k, device=dev).sub_(seg_start[sorted_key])
    kept_sorted = sorted_key < E * G if skips else None
    if capacity is not None:
        within = slot < capacity
        kept_sorted = within if kept_sorted is None else kept_sorted & within
    # the priority-ordered choices' token-major ids n * k + j
    sorted_ids = perm if listing is None else listing.index_select(0, perm)
    if kept_sorted is not None:
        slot.masked_fill_(~kept_sorted, -1)
    # perm is a permutation, so the scatter writes every entry
    position = torch.empty_like(slot).scatter_(0, sorted_ids, slot)
    keep = position >= 0
    demand = seg_count[:E * G]
    supplied = demand if capacity is None else demand.clamp(max=capacity)
    if G != 1:
        demand, supplied = demand.view(E, G).sum(1), supplied.view(E, G).sum(1)
    r = Routing(expert=choice.reshape(N, k), weight=weight.reshape(N, k), keep=keep.view(N, k),
                wanted=wanted.reshape(N, k), position=position.view(N, k),
                order=sorted_ids if kept_sorted is None else sorted_ids[kept_sorted],
                counts=supplied, capacity=capacity, groups=G, group_size=S, demand=demand)
    return r, probs


#: where the load-balancing loss counts its ``f_e`` (``model.aux_loss_scope``; a test holds the two equal):
#: ``"group"``, each routing group's own tokens (Switch, GShard); ``"global"``, every token of the global batch
#: of this micro-batch step (Qiu et al. 2025; Megatron-core's ``"global_aux_loss"``); ``"global_step"``, every
#: token of the step's micro-batches so far, on every rank (Qiu et al. 2025's buffer over the micro-batches of
#: gradient accumulation: :class:`StepCounts`)
AUX_LOSS_SCOPES = ("group", "global", "global_step")


def check_aux_loss_scope(scope: str) -> None:
    """A one-line ValueError naming the key and the choices for an unknown scope."""
    if scope not in AUX_LOSS_SCOPES:
        raise ValueError(f"model.aux_loss_scope={scope!r} is not one of {', '.join(AUX_LOSS_SCOPES)}")


def token_axis_groups(mesh) -> tuple[tuple[str, ...], ...]:
    """The mesh axis groups over which the ranks of an MoE layer route different tokens: dp x ep (the data
    ranks), and tp, whose ranks route different samples (:meth:`podscale.parallel.moe.MoELayer.forward`).
    Summed over in turn: one group over all three would be one more process group.  Under pipeline
    parallelism these are the ranks of one stage (the mesh's groups never span pp)."""
    return (("dp", "ep"),) + ((("tp",),) if mesh.size("tp") > 1 else ())


def first_choice_counts(first_choice: torch.Tensor, experts: int, mesh=None) -> torch.Tensor:
    """(E + 1,) int64: how many tokens chose each expert first, then how many tokens were counted.

    Without ``mesh``, this rank's ``first_choice`` (N,) alone (one process: the whole batch).  With it, summed
    over every rank that routes other tokens of this layer in this forward (:func:`token_axis_groups`: an
    all-reduce of E + 1 integers over dp x ep, then one over tp), so the shares ``counts[:E] / counts[E]`` are
    the global batch's: the ``f_e`` of the global-batch load-balancing loss (Qiu et al. 2025; Megatron-core's
    ``moe_router_load_balancing_type = "global_aux_loss"``), taken per micro-batch as Megatron-core does (the
    paper's variant that also accumulates them over the micro-batches of a step adds them up in
    :class:`StepCounts`).  Collective on
    the mesh: every rank of those groups calls it once per forward of the layer, in the same order, whatever
    its routing (a rank without tokens too).  Counts are integers and carry no gradient."""
    counts = torch.bincount(first_choice.reshape(-1), minlength=experts)
    both = torch.cat([counts, counts.new_tensor([first_choice.numel()])])
    if mesh is not None:
        for axes in token_axis_groups(mesh):
            comm.all_reduce(both, mesh, axes)
    return both


class StepCounts:
    """The first-choice counts (:func:`first_choice_counts`, summed over the ranks) of the micro-batches of one
    optimizer step so far: the buffer of Qiu et al. 2025 ("Demons in the Detail"), which, when the
    global batch is reached by gradient accumulation, keeps the counts of the step's micro-batches so that the
    loss of micro-batch m takes its ``f_e`` from micro-batches 1..m (the whole step's batch at the last one).
    ``P_e`` stays each group's own, so each micro-batch's gradient still reaches the router through ``P`` only.

    A running sum of E + 1 integers that lives for one step: :meth:`reset` at the step's start (the MoE layer's
    ``start_step``), :meth:`add` after each micro-batch's count, no state-dict entry (a checkpoint is taken
    between steps, and the step after it starts its own sum).  Activation recomputation runs a micro-batch's forward again in its
    backward, when later micro-batches may have added theirs: :meth:`replay` gives it the sum its first forward
    used, without adding (per layer the backwards run in the order of the forwards, in every schedule)."""

    def __init__(self):
        self.total: torch.Tensor | None = None
        self._used: deque[torch.Tensor] = deque()   # the sum each forward used, oldest first, until replayed

    def reset(self) -> None:
        """Forget the counts: the next micro-batch starts a step."""
        self.total = None
        self._used.clear()

    def add(self, counts: torch.Tensor) -> torch.Tensor:
        """The sum with this micro-batch's ``counts`` (E + 1,) added: the counts its loss uses."""
        self.total = counts if self.total is None else self.total + counts
        self._used.append(self.total)
        return self.total

    def replay(self) -> torch.Tensor:
        """For a recomputed forward: the sum the oldest forward not yet recomputed used."""
        if not self._used:
            raise RuntimeError("a recomputed MoE forward has no first forward in this step to repeat")
        return self._used.popleft()


def load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor,
                        counts: torch.Tensor | None = None) -> torch.Tensor:
    """Switch eq. 4-6 (GShard's l_aux up to its constant): ``E * sum_e f_e * P_e`` per group, averaged over
    groups; ``f_e`` is the share of the group's tokens whose first choice is e (not differentiable), ``P_e``
    the group's mean router probability for e.  Equals 1 for perfectly uniform routing.

    ``counts`` (E + 1,): first-choice counts and their token count (:func:`first_choice_counts`) that give
    every group the same ``f_e = counts[e] / counts[E]`` instead of its own: the global-batch loss of Qiu et
    al. 2025 (Megatron-core's ``"global_aux_loss"``) when they are summed over the ranks, ``P_e`` still each
    group's own (so the loss is ``E * sum_e f_e^global * P_e^local``, averaged over groups; its gradient
    reaches the router through ``P`` only)."""
    G, S, E = probs.shape
    if G == 0:
        return probs.sum()
    if counts is None:
        cell = first_choice.reshape(G, S)
        if G > 1:
            cell = cell + torch.arange(0, G * E, E, device=probs.device).view(G, 1)
        f = torch.bincount(cell.reshape(-1), minlength=G * E).view(G, E).to(probs.dtype) / S
    else:
        f = counts[:E].to(probs.dtype) / counts[E].clamp_min(1)                # (E,), the same for every group
    P = probs.mean(1)                                                          # (G, E)
    return E * (f * P).sum(-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE eq. 5: the mean over tokens of ``logsumexp(logits)^2``."""
    if logits.numel() == 0:
        return logits.sum()
    return torch.logsumexp(logits, dim=-1).square().mean()


# ---------------------------------------------------------------------------------------------------
# statistics


@dataclass
class MoEStats:
    """Routing counts of one or more forwards of one MoE layer (detached; add them up over micro-batches).

    ``wanted[e]``: choices that asked expert e for a slot; ``kept[e]``: choices dispatched to it.  The
    counts are this rank's; :meth:`all_reduce` sums them over mesh axes for global figures.
    ``peak_rows``: the most rows this rank's experts ran in one forward (the largest over forwards and,
    after :meth:`all_reduce`, over ranks; ``ranks`` counts the ranks summed).  Over a rank's even share,
    ``tokens * top_k / (ranks * forwards)`` (every choice run, the ranks evenly loaded: the planner's unit;
    dropped or randomly skipped choices make the actual mean lower), it is the busiest ep rank's load, to
    which its expert activations and expert time scale: a capacity bounds it (by the capacity factor),
    dropless nothing below ``ep``; the planner prices a dropless layer at ``dropless_peak_load`` of it.
    """

    tokens: torch.Tensor      # 0-dim int64
    wanted: torch.Tensor      # (E,) int64
    kept: torch.Tensor        # (E,) int64
    aux_loss: torch.Tensor    # 0-dim float, summed over forwards (divide by ``forwards`` for the mean)
    z_loss: torch.Tensor
    top_k: int = 1
    peak_rows: int = 0
    ranks: int = 1
    forwards: int = 1

    @classmethod
    def of(cls, routing: Routing, aux: torch.Tensor, z: torch.Tensor, rows: int) -> "MoEStats":
        """``rows``: the rows this rank's experts ran (with one ep rank, its kept choices)."""
        # every tensor on the routing's device: all_reduce concatenates them for one collective (NCCL: the GPU)
        return cls(tokens=torch.tensor(routing.expert.shape[0], device=routing.expert.device),
                   wanted=routing.demand, kept=routing.counts, aux_loss=aux.detach().float(),
                   z_loss=z.detach().float(), top_k=routing.expert.shape[1], peak_rows=rows)

    def __add__(self, other: "MoEStats") -> "MoEStats":
        return MoEStats(self.tokens + other.tokens, self.wanted + other.wanted, self.kept + other.kept,
                        self.aux_loss + other.aux_loss, self.z_loss + other.z_loss, self.top_k,
                        max(self.peak_rows, other.peak_rows), self.ranks, self.forwards + other.forwards)

    def all_reduce(self, mesh, axes) -> "MoEStats":
        """The counts summed over ``axes`` (collective: every rank on them calls it); losses averaged, the
        peak rows the largest."""
        E = self.wanted.numel()
        flat = torch.cat([t.to(torch.float64).view(-1)
                          for t in (self.tokens, self.wanted, self.kept, self.aux_loss, self.z_loss)])
        peak = torch.tensor([self.peak_rows], dtype=torch.float64, device=flat.device)
        comm.all_reduce(flat, mesh, axes)
        comm.all_reduce(peak, mesh, axes, op=dist.ReduceOp.MAX)
        n = mesh.size(*((axes,) if isinstance(axes, str) else axes))
        counts = flat[:1 + 2 * E].round().to(torch.int64)
        return MoEStats(counts[0], counts[1:1 + E], counts[1 + E:], (flat[-2] / n).float(), (flat[-1] / n).float(),
                        self.top_k, int(peak[0]), self.ranks * n, self.forwards)

    def all_reduce_groups(self, mesh, groups) -> "MoEStats":
        """:meth:`all_reduce` over each axis group of ``groups`` in turn (collective); itself when ``mesh``
        is None."""
        out = self
        if mesh is not None:
            for axes in groups:
                out = out.all_reduce(mesh, axes)
        return out

    #: the keys of :meth:`summary`, in its order
    SUMMARY_KEYS = ("dropped_share", "load_min", "load_max", "load_entropy", "aux_loss", "z_loss",
                    "peak_rank_load")

    @property
    def dropped(self) -> int:
        """Choices dropped for capacity."""
        return int(self.wanted.sum() - self.kept.sum())

    def summary(self) -> dict[str, float]:
        """Dropped share of the choices, per-expert load (share of dispatched choices: min, max and the
        entropy normalised by log E, 1 = uniform), mean aux and z losses, and the busiest rank's rows in
        one forward over a rank's even share (:attr:`peak_load`)."""
        total = max(int(self.kept.sum()), 1)
        load = self.kept.double() / total
        nz = load[load > 0]
        E = self.kept.numel()
        entropy = float(-(nz * nz.log()).sum() / math.log(E)) if E > 1 else 1.0
        return {"dropped_share": self.dropped / max(int(self.wanted.sum()), 1),
                "load_min": float(load.min()), "load_max": float(load.max()), "load_entropy": entropy,
                "aux_loss": float(self.aux_loss) / self.forwards, "z_loss": float(self.z_loss) / self.forwards,
                "peak_rank_load": self.peak_load}

    @property
    def peak_load(self) -> float:
        """The busiest rank's rows in one forward over a rank's even share of the choices, tokens x top_k
        per rank and forward (0 without tokens)."""
        mean = int(self.tokens) * self.top_k / (self.ranks * self.forwards)
        return self.peak_rows / mean if mean else 0.0


# ---------------------------------------------------------------------------------------------------
# the router


class Router(nn.Module):
    """The linear router ``logits = x W^T`` (no bias), computed in fp32 (fp64 for fp64 inputs) outside
    autocast, as Switch's selective precision recommends (section 2.4).  With ``bias_balancing`` it
    keeps DeepSeek-V3's per-expert selection bias as a buffer, moved by :meth:`update_bias`."""

    def __init__(self, d_model: int, experts: int, bias_balancing: bool = False, bias_update_rate: float = 1e-3):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, d_model))
        nn.init.normal_(self.weight, std=0.02)
        self.bias_update_rate = bias_update_rate
        self.register_buffer("selection_bias", torch.zeros(experts) if bias_balancing else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), self.weight.to(dtype))

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's update from the global per-expert load ``load`` (E,) of the last step:
        ``b_e += gamma * sign(mean load - load_e)``.  Every rank must pass the same (globally summed) counts
        so the biases stay identical."""
        load = load.to(self.selection_bias.dtype)
        self.selection_bias.add_(self.bias_update_rate * torch.sign(load.mean() - load))
