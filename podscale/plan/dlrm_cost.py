"""Step time and memory of DLRM (Naumov et al. 2019) as podscale runs it: embedding tables sharded over all
devices (row-, table- or column-wise, :mod:`podscale.table.embedding`), MLPs replicated (data parallel).

Dense part, per step of B samples on N devices (each owns B/N samples):
    MLPs + interaction                  GEMMs of B/N rows (forward, input and weight gradients)
    gradient all-reduce of MLP weights  fp32, overlapped with the backward of the top MLP (the measured
                                        exposed fraction on a CPU), and the all-reduce of the step's loss
    kernels                             the dense part's kernels at the device's host cost per kernel
    optimizer                           Adam over the MLP weights

Tables, two models:

* **Host model** (a calibrated CPU system, whose ``[table]`` rates ``podscale plan calibrate`` measured:
  :class:`~podscale.plan.hardware.TableRates`).  A CPU spends a table step in the host work of the
  Baidu parameter server's pull/push (Zhao et al., MLSys 2020) as podscale does it, so each part is
  priced from the measured cost of its operation (``call + items * per_item + floats * per_float``):
  the ids of a rank (``B/N * L`` per table), their deduplication, the distinct ids a deduplication
  leaves (the expected distinct count of a Zipf sample, :func:`podscale.table.estimate.expected_distinct`),
  the store's read and write of those rows (key-index search and gather in the keyed store, a gather in
  the dense one; with a DRAM budget, the cache's own work plus the SSD engine's reads of the misses and
  writes of the evicted dirty rows, the miss rate from :func:`podscale.table.estimate.hit_rate`), the
  row copies of the exchange, the pooling (``embedding_bag``, also the backward's row gradients), the
  sparse optimizer on the touched rows, and the exchange itself: ``all_to_all_single`` of the split
  sizes, the deduplicated ids, the rows (or pooled bags) and their gradients, 4 collectives a step
  (+2 small all-gathers with an SSD tier, whose verdicts on the budget and the store every rank agrees).
  Row-wise: every rank owns 1/N of every table's keys and looks up its samples' deduplicated ids;
  table-/column-wise: the owner of a table (a column block) deduplicates and pools all N ranks' ids and
  returns pooled bags, so the busiest owner sets the step (table-wise: ceil(T/N) tables; column-wise:
  every rank one block of each table).
* **Bandwidth model** (any other system, e.g. GPUs, where the table's kernels stream rows):
  ``B * T * L * d * 4 bytes * 3`` (gather, gradient, row update) / N at memory bandwidth, and the
  all-to-all of pooled vectors forward and backward.

Memory per device: 1/N of the fp32 tables + the sparse optimizer's state (row-wise Adagrad one float per
row), fully replicated MLPs with Adam (16 bytes/param), and activations of B/N samples.
"""
from __future__ import annotations

from . import network as net
from .compute import gemm_time, stream_time
from .hardware import System
from .layout import Layout, LayoutError
from .models import DLRM
from .prediction import Prediction

# Collectives of a table step: split sizes, ids, rows / pooled bags, gradients (all_to_all_single each).
TABLE_COLLECTIVES = 4
# Kernels of the dense part a step launches (each pays the device's host cost per kernel, 0 on a GPU):
# a linear layer's addmm and ReLU forward, two matmuls, the bias sum and ReLU's backward; the dot
# interaction's stack, batched matmul, triangle gather and concatenation, forward and backward; per table
# its pooled vector's gradient scaling, copy and slice of the concatenation; the loss forward and backward.
KERNELS_PER_LINEAR = 6
KERNELS_INTERACTION = 8
KERNELS_PER_TABLE = 3
KERNELS_LOSS = 6
TIERED_AGREEMENTS = 2   # with a DRAM cache tier: the budget's and the store's verdicts (4-int all-gathers)


def _state_floats(model: DLRM, width: int) -> int:
    from podscale.table.estimate import STATE_FLOATS
    return STATE_FLOATS[model.sparse_optimizer](width)


def _store_time(system: System, model: DLRM, rows: float, table_rows: int, width: int, shards: int,
                global_ids: float) -> float:
    """Read and write back ``rows`` distinct rows of a shard whose stored rows are ``width`` floats, and
    create those of keys no earlier step drew (keyed stores, ``model.step``)."""
    from podscale.table.estimate import expected_new, hit_rate
    r = system.table
    stored = width + _state_floats(model, width) + 1             # weights, optimizer state, last use
    if model.storage == "dense":
        return (r.time("dense_get", rows, rows * stored, call=False)
                + r.time("dense_put", rows, rows * stored, call=False))
    new = 0.0
    if model.step is not None:   # the shard's share of the step's never-seen keys, read, created and written
        new = expected_new(table_rows, model.alpha, global_ids, model.step) / shards   # by "create", not by
        rows = max(0.0, rows - new)                                                      # get/put below
    # (the one-id step creates no row: creating pays its call's fixed cost in every step that has new keys)
    create = r.time("create", new, new * stored, call=False) + min(1.0, new) * r.ops["create"][0]
    if model.dram_budget_mb is None:
        return (r.time("keyed_get", rows, rows * stored, call=False)
                + r.time("keyed_put", rows, rows * stored, call=False) + create)
    cache_rows = max(1, int(model.dram_budget_mb * 2 ** 20) // (4 * stored))
    hit = hit_rate(table_rows, model.alpha, cache_rows, shards, model.cache_policy, ids_per_step=int(global_ids))
    # Every miss (new keys too: the cache asks the SSD engine first) reads the engine and evicts a row, dirty
    # once trained, so written back.  (New keys' creation is priced as in the keyed store.)
    miss = max(new, (rows + new) * (1.0 - hit))
    return (r.time("cached_get", rows, rows * stored, call=False)
            + r.time("cached_put", rows, rows * stored, call=False) + create
            + r.time("ssd_get", miss, miss * stored) + r.time("ssd_put", miss, miss * stored))


def _distinct(model: DLRM, table_rows: int, ids: float) -> float:
    from podscale.table.estimate import expected_distinct
    return expected_distinct(table_rows, model.alpha, ids)


def table_host_time(system: System, n: int, model: DLRM, local: int) -> tuple[dict, float]:
    """Host seconds per step of the tables on the busiest rank, by part, and the bytes each rank sends
    in the step's exchanges (ids, rows or bags, gradients).  Each operation is priced without its call's
    fixed cost, which the measured one-id step (``step_row`` / ``step_pooled`` per table) holds."""
    r = system.table
    T = len(model.tables)
    parts = {"dedup": 0.0, "store": 0.0, "pool": 0.0, "optimizer": 0.0, "copies": 0.0}
    sent = 0.0
    ids = local * model.lookups_per_table                     # ids of one table on one rank
    if model.sharding == "row":
        parts["host"] = r.time("step_row", T)
        for rows, d in model.tables:
            mine = _distinct(model, rows, ids)                    # after this rank's deduplication
            owned = _distinct(model, rows, n * ids) / n           # keys of this shard in the step
            parts["dedup"] += r.time("dedup", ids, call=False) + r.time("dedup", mine, call=False)
            parts["store"] += _store_time(system, model, owned, rows, d, n, n * ids)
            # the reply's gather, its assembly, the gradient's gather and the owner's sums: d floats a row
            parts["copies"] += 4 * r.time("copy", mine, mine * d, call=False)
            parts["pool"] += 2 * r.time("pool", ids, ids * d, call=False)   # bags forward, row gradients
            parts["optimizer"] += r.time("update", owned, owned * d, call=False)
            sent += mine * 16 + 2 * mine * d * 4                   # ids + counts, rows, gradients
        return parts, sent
    # pooled exchange: each table's (column block's) owner deduplicates and pools every rank's ids
    owners: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    load = [0] * n
    for t, (rows, d) in enumerate(model.tables):
        if model.sharding == "table":
            k = min(range(n), key=lambda i: (load[i], i))
            load[k] += d
            owners[k].append((rows, d))
        else:
            blocks = min(n, d)
            for j in range(blocks):
                owners[(t + j) % n].append((rows, round(d * (j + 1) / blocks) - round(d * j / blocks)))
    busiest = None
    for shards in owners:
        own = {k: 0.0 for k in parts}
        own["host"] = r.time("step_pooled", max(T, len(shards)))
        for rows, w in shards:
            g = n * ids                                            # every rank's ids of this table
            u = _distinct(model, rows, g)
            own["dedup"] += r.time("dedup", g, call=False)
            own["store"] += _store_time(system, model, u, rows, w, 1, g)
            own["pool"] += 2 * r.time("pool", g, g * w, call=False)   # bags forward, row gradients backward
            own["optimizer"] += r.time("update", u, u * w, call=False)
            own["copies"] += 2 * r.time("copy", n * local, n * local * w, call=False)  # bags out, grads in
        if busiest is None or sum(own.values()) > sum(busiest.values()):
            busiest = own
    for _, d in model.tables:
        sent += ids * 8 + local * 8 + 2 * local * d * 4            # ids + bag lengths, bags, gradients
    return busiest, sent


def predict_dlrm(system: System, devices: int, model: DLRM, lay: Layout, batch: int) -> Prediction:
    if (lay.tp, lay.pp, lay.ep) != (1, 1, 1) or lay.dp != devices:
        raise LayoutError("DLRM layouts are data parallel for the MLPs with tables sharded over all devices: "
                          f"use tp=1, pp=1, ep=1, dp={devices}")
    m = lay.num_microbatches(batch)
    dev, n = system.device, devices
    local = lay.microbatch
    T, d = len(model.tables), model.bottom_mlp[-1]
    mlp = 0.0
    for widths in (model.bottom_mlp, model.interaction_mlp_widths):
        for k_in, k_out in zip(widths[:-1], widths[1:]):
            mlp += 3 * gemm_time(dev, local, k_out, k_in, bytes_per_element=4)
    f = T + 1
    mlp += 3 * gemm_time(dev, f, f, d, batch=local, bytes_per_element=4)    # pairwise dot interaction
    layers = len(model.bottom_mlp) + len(model.interaction_mlp_widths) - 2
    dense_host = (KERNELS_PER_LINEAR * layers + KERNELS_INTERACTION + KERNELS_PER_TABLE * T
                  + KERNELS_LOSS) * dev.kernel_overhead
    allreduce = net.all_reduce_time(system, 4 * model.mlp_params, n, 1) if n > 1 else 0.0
    # The gradient all-reduce overlaps the top MLP's backward; on a CPU the overlap still costs the measured
    # fraction of the all-reduce (its thread competes with the compute for the cores).  The engine then
    # all-reduces the step's loss: one more collective.
    exposed_ar = (allreduce * dev.overlap_exposed if dev.overlap_exposed else max(0.0, allreduce - m * mlp / 3))
    if n > 1:
        exposed_ar += net.all_reduce_time(system, 4, n, 1)
    optimizer = stream_time(dev, 30 * model.mlp_params)
    notes = []
    if system.table is not None:
        parts, sent = table_host_time(system, n, model, local)
        calls = TABLE_COLLECTIVES + (TIERED_AGREEMENTS if model.dram_budget_mb is not None else 0)
        # each collective waits like a minimal all-reduce between compute kernels (the calibrated latency
        # and wait), its bytes at the link's bandwidth
        a2a = (net.all_to_all_time(system, sent, n, 1) - net.all_to_all_time(system, 0.0, n, 1)
               + calls * net.all_reduce_time(system, 4, n, 1) if n > 1 else 0.0)
        breakdown = {f"table_{k}": m * v for k, v in parts.items()}
        breakdown["all_to_all"] = m * a2a
        notes.append("tables: host model (calibrated [table] rates: dedup, store, pooling, sparse update)")
    else:
        lookups = local * T * model.lookups_per_table
        breakdown = {"embedding": m * 3 * stream_time(dev, lookups * d * 4),
                     "all_to_all": m * (2 * net.all_to_all_time(system, local * T * d * 4, n, 1) if n > 1 else 0.0)}
        notes.append("tables: bandwidth model (bytes moved at memory bandwidth; no [table] rates calibrated)")
    breakdown.update({"mlp": m * mlp, "dense_kernels": m * dense_host, "dp_communication": exposed_ar,
                      "optimizer": optimizer})
    state = sum(r * _state_floats(model, dd) for r, dd in model.tables)
    tables_bytes = (4 * model.embedding_params + 4 * state) / n
    if model.dram_budget_mb is not None:
        tables_bytes = min(tables_bytes, T * model.dram_budget_mb * 2 ** 20)   # each shard's DRAM tier
    memory = {"embedding_tables": tables_bytes,
              "mlp_states": 16 * model.mlp_params,
              "activations": 4 * local * (sum(model.bottom_mlp) + sum(model.interaction_mlp_widths) + T * d) * 2,
              "reserved": dev.reserved_bytes}
    total_mem = sum(memory.values())
    mlp_flops = 2 * 3 * batch * model.mlp_params
    if total_mem > dev.memory_bytes:
        notes.append("does not fit in device memory")
    return Prediction(
        system=system.name, devices=devices, batch=batch, model=model.name, layout=lay.to_dict(),
        step_time_s=sum(breakdown.values()), time_breakdown_s=breakdown, memory_per_device_bytes=total_mem,
        memory_breakdown_bytes=memory, memory_capacity_bytes=dev.memory_bytes, host_memory_per_device_bytes=0.0,
        hardware_flops_per_step=mlp_flops, model_flops_per_step=mlp_flops, tokens_per_step=batch,
        peak_flops_per_device=dev.peak_flops, notes=notes)
