"""Autograd and fake (meta) kernels for torch.ops.moe_comm.dispatch / combine.

The ops are registered by the CUDA library (csrc/ops/schemas.cpp). Their backward passes are
each other: dispatch's backward is an unweighted combine of the row gradients; combine's
backward dispatches the output gradient along the forward's routes (as e4m3 with per-128
scales when combine was called with `fp8_grad`: [moe_comm] combine_grad_dtype = "fp8"), scaling
by the routing weights and returning the weights' gradients. Both take the SM budget
(`num_sms`, `network_sms`) from the forward call, kept in the autograd context. The fake
kernels compute every shape from the ops' arguments (`shape` = [world, local_size, fwd_slots,
net_slots]), so they need no runtime state. Under activation checkpointing the recompute never
calls them again: moe_comm.titan.recompute replays what the forward's calls returned. A forward
that ran through a layer's CUDA graphs (moe_comm.kernels.call_graphs) runs its backward op
through them too.

Dispatch for the FP8 experts (`fp8_rows`) goes through `dispatch_fp8_rows` instead, which says why.
"""

import torch

from moe_comm.kernels import call_graphs, fp8

@torch.library.register_fake("moe_comm::dispatch")
def _dispatch_fake(x, topk_idx, topk_w, num_experts, capacity, align, fp8_wire, fp8_rows, num_sms, network_sms, shape):
    world, local_size, fwd_slots, net_slots = shape
    nodes, local_experts = world // local_size, num_experts // world
    tokens, top_k = topk_idx.shape
    slots = local_size * fwd_slots

    def i32(*size):
        return torch.empty(*size, dtype=torch.int32, device=x.device)

    return (
        x.new_empty(capacity, x.shape[1], dtype=fp8.FP8 if fp8_rows else x.dtype),
        i32(local_experts),
        i32(tokens, local_size),
        i32(tokens, nodes),
        i32(nodes, nodes + local_size),
        i32(net_slots, local_size),
        i32(local_size + 2 * local_experts + 1),
        i32(slots, top_k),
        torch.empty(slots, top_k, dtype=torch.float32, device=x.device),
        i32(slots),
        torch.empty(capacity if fp8_rows else 0, dtype=torch.float32, device=x.device),
    )


@torch.library.register_fake("moe_comm::combine")
def _combine_fake(y, topk_w, rank_pos, send_idx, rail_counts, net_route, recv_info, slot_rows, slot_w, slot_origin,
                  weighted, fp8_grad, num_sms, network_sms):
    return y.new_empty(rank_pos.shape[0], y.shape[1])


@torch.library.register_fake("moe_comm::combine_backward")
def _combine_backward_fake(grad_out, y, rank_pos, send_idx, rail_counts, net_route, recv_info, slot_rows, slot_w,
                           slot_origin, fp8_wire, num_sms, network_sms):
    return torch.empty_like(y), y.new_empty(rank_pos.shape[0], slot_rows.shape[1], dtype=torch.float32)


HANDLE = slice(2, 10)  # dispatch's outputs that make the handle combine takes
# Autograd hands a backward zeros for each output that had no gradient unless told not to: for
# dispatch's non-differentiable outputs (the handle; the FP8 rows and their scales) that was ten
# zero-filled tensors a call, 0.6 ms of the one-GPU recipe's FP8 step (run 60's profile: 0.30 ms
# for the [rows, hidden] e4m3 rows alone). The backward passes below take None for them. The rows
# are dispatch's one differentiable output, so a backward that runs has their gradient.


def _combine_rows_back(ctx, grad_rows, topk_w, handle, num_sms, network_sms):
    """Dispatch's backward: the rows' gradients summed back to their tokens (an unweighted combine),
    through the CUDA graphs the forward ran in, if any (moe_comm.kernels.call_graphs)."""
    return call_graphs.run_backward_op(
        ctx, "combine", (grad_rows.contiguous(), topk_w, *handle, False, False, num_sms, network_sms))


def _dispatch_setup(ctx, inputs, output):
    if inputs[7]:
        raise RuntimeError("moe_comm::dispatch with fp8_rows is differentiable through dispatch_fp8_rows only")
    ctx.num_sms, ctx.network_sms = inputs[8], inputs[9]
    ctx.save_for_backward(inputs[2], *output[HANDLE])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero gradients made for the handle (HANDLE's comment)


def _dispatch_backward(ctx, grad_recv_x, *_):
    topk_w, *handle = ctx.saved_tensors
    grad_x = _combine_rows_back(ctx, grad_recv_x, topk_w, handle, ctx.num_sms, ctx.network_sms)
    return (grad_x,) + (None,) * 10


def _combine_setup(ctx, inputs, output):
    y, _topk_w, *handle = inputs[:10]
    weighted, ctx.fp8_grad, ctx.num_sms, ctx.network_sms = inputs[10:14]
    if not weighted:
        raise RuntimeError("moe_comm::combine is differentiable only with weighted=True")
    ctx.save_for_backward(y, *handle)


def _combine_backward(ctx, grad_out):
    y, *handle = ctx.saved_tensors
    grad_y, grad_w = call_graphs.run_backward_op(
        ctx, "combine_backward", (grad_out.contiguous(), y, *handle, ctx.fp8_grad, ctx.num_sms, ctx.network_sms),
    )
    return (grad_y, grad_w) + (None,) * 12


torch.library.register_autograd("moe_comm::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("moe_comm::combine", _combine_backward, setup_context=_combine_setup)
# the same autograd for calls replayed from a layer's CUDA graphs
call_graphs.AUTOGRAD.update(dispatch=(_dispatch_setup, _dispatch_backward), combine=(_combine_setup, _combine_backward))
fp8.register_fakes()


class _DispatchFp8Rows(torch.autograd.Function):
    """See dispatch_fp8_rows."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_w, num_experts, capacity, align, fp8_wire, num_sms, network_sms, shape):
        out = torch.ops.moe_comm.dispatch(x, topk_idx, topk_w, num_experts, capacity, align, fp8_wire, True, num_sms,
                                          network_sms, shape)
        recv_q, tokens_per_expert, handle, recv_scale = out[0], out[1], out[HANDLE], out[10]
        rows_grad = x.new_zeros(()).expand(recv_q.shape)
        ctx.num_sms, ctx.network_sms = num_sms, network_sms
        ctx.save_for_backward(topk_w, *handle)
        ctx.mark_non_differentiable(recv_q, recv_scale, tokens_per_expert, *handle)
        ctx.set_materialize_grads(False)  # HANDLE's comment says why
        return (rows_grad, recv_q, recv_scale, tokens_per_expert, *handle)

    @staticmethod
    def backward(ctx, grad_rows, *_):
        topk_w, *handle = ctx.saved_tensors
        return (_combine_rows_back(ctx, grad_rows, topk_w, handle, ctx.num_sms, ctx.network_sms),) + (None,) * 9


def dispatch_fp8_rows(x, topk_idx, topk_w, num_experts, capacity, align, fp8_wire, num_sms, network_sms, shape):
    """Dispatch for the FP8 experts: (rows_grad, e4m3 rows, their scales, tokens_per_expert,
    *handle). The rows arrive as e4m3 with one fp32 scale per row, and autograd cannot carry
    their bf16 gradient through an e4m3 tensor (it casts a gradient to its input's dtype). So
    `rows_grad` comes first: a zero-stride bf16 view of the rows' shape (no memory) that the FP8
    experts take as their differentiable input and return the rows' gradient for, which then
    flows back through an unweighted combine, as dispatch's backward always does."""
    return _DispatchFp8Rows.apply(x, topk_idx, topk_w, num_experts, capacity, align, fp8_wire, num_sms, network_sms,
                                  shape)
