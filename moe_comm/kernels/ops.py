"""Autograd and fake (meta) kernels for torch.ops.moe_comm.dispatch / combine.

The ops themselves are registered by the CUDA library (csrc/ops.cpp). Their backward passes
are each other: dispatch's backward is an unweighted combine of the row gradients; combine's
backward dispatches the output gradient along the forward's routes, scaling by the routing
weights and returning the weights' gradients (csrc/combine_backward.cu, csrc/expand.cu,
csrc/collect_grad_w.cu). TorchTitan's selective activation checkpointing keeps both ops'
outputs (moe_comm.titan puts them on its save list), so recomputation never communicates again.
"""

import torch

from moe_comm.kernels import COMBINE_PUSHER_WARPS, DISPATCH_SENDER_WARPS


def _world() -> int:
    from moe_comm.kernels.runtime import NvshmemRuntime

    return NvshmemRuntime._current.world if NvshmemRuntime._current is not None else 1


def _max_tokens() -> int:
    from moe_comm.kernels.runtime import NvshmemRuntime

    return NvshmemRuntime._current.shape.max_tokens if NvshmemRuntime._current is not None else 1


@torch.library.register_fake("moe_comm::dispatch")
def _dispatch_fake(x, topk_idx, topk_w, num_experts, capacity, align, num_sms, sender_warps):
    world, max_tokens, k = _world(), _max_tokens(), topk_idx.shape[1]
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty(capacity, x.shape[1]),
        torch.empty(num_experts // world, **i32),
        torch.empty(x.shape[0], world, **i32),
        torch.empty(world, max_tokens, k, **i32),
        torch.empty(world, max_tokens, k, dtype=torch.float32, device=x.device),
        torch.empty(world, max_tokens, **i32),
        torch.empty(world + 2 * (num_experts // world), **i32),
    )


@torch.library.register_fake("moe_comm::combine")
def _combine_fake(y, topk_idx, topk_w, token_slot, slot_rows, slot_w, slot_token, recv_info, num_experts, align,
                  weighted, num_sms, pusher_warps):
    return y.new_empty(token_slot.shape[0], y.shape[1])


@torch.library.register_fake("moe_comm::combine_backward")
def _combine_backward_fake(grad_out, y, topk_idx, token_slot, slot_rows, slot_w, slot_token, recv_info, num_experts,
                           align, num_sms, sender_warps):
    return torch.empty_like(y), y.new_empty(token_slot.shape[0], slot_rows.shape[2], dtype=torch.float32)


def _dispatch_setup(ctx, inputs, output):
    x, topk_idx, topk_w, num_experts, capacity, align, num_sms, sender_warps = inputs
    _, _, token_slot, slot_rows, slot_w, slot_token, recv_info = output
    ctx.save_for_backward(topk_idx, topk_w, token_slot, slot_rows, slot_w, slot_token, recv_info)
    ctx.num_experts, ctx.align, ctx.num_sms = num_experts, align, num_sms
    ctx.mark_non_differentiable(*output[1:])


def _dispatch_backward(ctx, grad_recv_x, *_):
    topk_idx, topk_w, token_slot, slot_rows, slot_w, slot_token, recv_info = ctx.saved_tensors
    grad_x = torch.ops.moe_comm.combine(
        grad_recv_x.contiguous(), topk_idx, topk_w, token_slot, slot_rows, slot_w, slot_token, recv_info,
        ctx.num_experts, ctx.align, False, ctx.num_sms, COMBINE_PUSHER_WARPS,
    )
    return grad_x, None, None, None, None, None, None, None


def _combine_setup(ctx, inputs, output):
    (y, topk_idx, topk_w, token_slot, slot_rows, slot_w, slot_token, recv_info, num_experts, align, weighted,
     num_sms, _) = inputs
    if not weighted:
        raise RuntimeError("moe_comm::combine is differentiable only with weighted=True")
    ctx.save_for_backward(y, topk_idx, token_slot, slot_rows, slot_w, slot_token, recv_info)
    ctx.num_experts, ctx.align, ctx.num_sms = num_experts, align, num_sms


def _combine_backward(ctx, grad_out):
    y, topk_idx, token_slot, slot_rows, slot_w, slot_token, recv_info = ctx.saved_tensors
    grad_y, grad_w = torch.ops.moe_comm.combine_backward(
        grad_out.contiguous(), y, topk_idx, token_slot, slot_rows, slot_w, slot_token, recv_info,
        ctx.num_experts, ctx.align, ctx.num_sms, DISPATCH_SENDER_WARPS,
    )
    return grad_y, None, grad_w, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("moe_comm::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("moe_comm::combine", _combine_backward, setup_context=_combine_setup)
