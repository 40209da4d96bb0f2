"""Autograd and fake (meta) kernels for torch.ops.moe_comm.dispatch / combine.

The ops are registered by the CUDA library (csrc/ops/schemas.cpp). Their backward passes are
each other: dispatch's backward is an unweighted combine of the row gradients; combine's
backward dispatches the output gradient along the forward's routes, scaling by the routing
weights and returning the weights' gradients. Both take the SM budget (`num_sms`,
`network_sms`) from the forward call, kept in the autograd context. The fake kernels compute
every shape from the ops' arguments (`shape` = [world, local_size, fwd_slots, net_slots]), so
they need no runtime state. Under activation checkpointing the recompute never calls them again:
moe_comm.titan.recompute replays what the forward's calls returned. A forward that ran through a
layer's CUDA graphs (moe_comm.kernels.call_graphs) runs its backward op through them too.
"""

import torch

from moe_comm.kernels import call_graphs


@torch.library.register_fake("moe_comm::dispatch")
def _dispatch_fake(x, topk_idx, topk_w, num_experts, capacity, align, fp8, num_sms, network_sms, shape):
    world, local_size, fwd_slots, net_slots = shape
    nodes, local_experts = world // local_size, num_experts // world
    tokens, top_k = topk_idx.shape
    slots = local_size * fwd_slots

    def i32(*size):
        return torch.empty(*size, dtype=torch.int32, device=x.device)

    return (
        x.new_empty(capacity, x.shape[1]),
        i32(local_experts),
        i32(tokens, local_size),
        i32(tokens, nodes),
        i32(nodes, nodes + local_size),
        i32(net_slots, local_size),
        i32(local_size + 2 * local_experts + 1),
        i32(slots, top_k),
        torch.empty(slots, top_k, dtype=torch.float32, device=x.device),
        i32(slots),
    )


@torch.library.register_fake("moe_comm::combine")
def _combine_fake(y, topk_w, rank_pos, send_idx, rail_counts, net_route, recv_info, slot_rows, slot_w, slot_origin,
                  weighted, num_sms, network_sms):
    return y.new_empty(rank_pos.shape[0], y.shape[1])


@torch.library.register_fake("moe_comm::combine_backward")
def _combine_backward_fake(grad_out, y, rank_pos, send_idx, rail_counts, net_route, recv_info, slot_rows, slot_w,
                           slot_origin, num_sms, network_sms):
    return torch.empty_like(y), y.new_empty(rank_pos.shape[0], slot_rows.shape[1], dtype=torch.float32)


def _dispatch_setup(ctx, inputs, output):
    ctx.num_sms, ctx.network_sms = inputs[7], inputs[8]
    ctx.save_for_backward(inputs[2], *output[2:])
    ctx.mark_non_differentiable(*output[1:])


def _dispatch_backward(ctx, grad_recv_x, *_):
    topk_w, *handle = ctx.saved_tensors
    grad_x = call_graphs.run_backward_op(
        ctx, "combine", (grad_recv_x.contiguous(), topk_w, *handle, False, ctx.num_sms, ctx.network_sms),
    )
    return (grad_x,) + (None,) * 9


def _combine_setup(ctx, inputs, output):
    y, _topk_w, *handle = inputs[:10]
    weighted, ctx.num_sms, ctx.network_sms = inputs[10:13]
    if not weighted:
        raise RuntimeError("moe_comm::combine is differentiable only with weighted=True")
    ctx.save_for_backward(y, *handle)


def _combine_backward(ctx, grad_out):
    y, *handle = ctx.saved_tensors
    grad_y, grad_w = call_graphs.run_backward_op(
        ctx, "combine_backward", (grad_out.contiguous(), y, *handle, ctx.num_sms, ctx.network_sms),
    )
    return (grad_y, grad_w) + (None,) * 11


torch.library.register_autograd("moe_comm::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("moe_comm::combine", _combine_backward, setup_context=_combine_setup)
# the same autograd for calls replayed from a layer's CUDA graphs
call_graphs.AUTOGRAD.update(dispatch=(_dispatch_setup, _dispatch_backward), combine=(_combine_setup, _combine_backward))
