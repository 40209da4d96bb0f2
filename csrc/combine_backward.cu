// Backward of combine, the communication half: the output gradient travels along the
// forward's routes, once per rank, into the `rows` buffers the forward dispatch used; the call
// ends when every row meant for this rank has arrived. The scaled expert-major copies and the
// routing-weight gradients are computed locally afterwards (expand.cu, backward mode).
//
// One cooperative launch of `num_blocks` blocks, two roles at once:
//   senders    push grad_out rows to the slots the forward dispatch assigned at other ranks (the
//              own rank's rows stay in grad_out) and release a per-slot flag;
//   receivers  wait for every slot other ranks send here.
#include <cooperative_groups.h>

#include "buffers.h"
#include "common.cuh"
#include "launch.h"

namespace cg = cooperative_groups;

namespace moe_comm {

__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    combine_backward_kernel(const Buffers buf, const CombineBackwardArgs a) {
  cg::grid_group grid = cg::this_grid();
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int world = buf.world, rank = buf.rank;
  const uint32_t tag = buf.calls[kDispatchLikeCalls] + 1;
  const int row_stride = buf.max_row_bytes / 16;

  if (warp < a.sender_warps) {
    const int senders = gridDim.x * a.sender_warps;
    const int sender = blockIdx.x * a.sender_warps + warp;
    const uint4* grad_out = static_cast<const uint4*>(a.grad_out);
    for (int t = sender; t < a.num_tokens; t += senders) {
      const int my_slot = lane < world ? a.token_slot[(int64_t)t * world + lane] : -1;
      uint4* dst[kMaxRanks];
      peer_row_destinations(dst, buf.peer_rows, my_slot, world, rank, buf.max_tokens, row_stride);
      copy_row(grad_out + (int64_t)t * a.row_vecs, dst, a.row_vecs, lane);
      __threadfence_system();
      __syncwarp();
      if (lane < world && lane != rank && my_slot >= 0) {
        store_release_sys(buf.peer_slot_flag[lane] + (int64_t)rank * buf.max_tokens + my_slot, tag);
      }
    }
  } else {
    const int receivers = gridDim.x * (kWarpsPerBlock - a.sender_warps);
    const int receiver = blockIdx.x * (kWarpsPerBlock - a.sender_warps) + (warp - a.sender_warps);
    const SlotOrder order(a.recv_info + RecvInfo{world, 0}.slots_from(0), 1, rank, world, true);
    for (int i = receiver; i < order.total(); i += receivers) {
      int s, j;
      order.locate(i, s, j);
      wait_flag(buf.slot_flag + (int64_t)s * buf.max_tokens + j, tag);
    }
  }

  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) buf.calls[kDispatchLikeCalls] = tag;
}

void launch_combine_backward(const Buffers& buf, const CombineBackwardArgs& args, int num_blocks, cudaStream_t stream) {
  void* params[] = {const_cast<Buffers*>(&buf), const_cast<CombineBackwardArgs*>(&args)};
  launch_cooperative(reinterpret_cast<const void*>(combine_backward_kernel), num_blocks, 0, params, stream,
                     "combine_backward");
}

}  // namespace moe_comm
