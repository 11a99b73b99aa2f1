"""Mixture-of-experts (GShard, Switch, ST-MoE, DeepSeek-V3 balancing) with expert parallelism over ``ep``."""
from podscale.parallel.moe.gate import AUX_LOSS_SCOPES, DROP_POLICIES, Gating, MoEStats, Router, Routing, expert_capacity, \
    first_choice_counts, load_balancing_loss, route, router_z_loss, routing_uniform, sequence_token_keys, \
    token_axis_groups
from podscale.parallel.moe.layer import EXPERT_DISPATCHES, Expert, Experts, MoELayer, MoEOutput, WidthSplit, check_moe_args, \
    dense_parameters, expert_parameters, grad_norm, reduce_gradients

__all__ = ["MoELayer", "Gating", "MoEOutput", "Experts", "Router", "Routing", "MoEStats", "route", "expert_capacity",
           "load_balancing_loss", "router_z_loss", "routing_uniform", "sequence_token_keys", "expert_parameters",
           "dense_parameters", "reduce_gradients", "grad_norm", "check_moe_args", "Expert", "WidthSplit",
           "AUX_LOSS_SCOPES", "first_choice_counts", "token_axis_groups", "EXPERT_DISPATCHES",
           "DROP_POLICIES"]
