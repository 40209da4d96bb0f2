// Pack: the send slots of the network hop (a token's row and metadata, once per other node it
// goes to), and with an FP8 wire the e4m3 copy of every own row that NVLink pushes and expand
// reads. NVSHMEM puts need their source in symmetric memory, and one contiguous slot per
// (token, node) lets a chunk of slots cross the network in one put.
//
// An FP8 row is quantised here, once, at its sender: one fp32 scale per 128 channels (FP8
// dispatch, combine's backward in FP8), or one scale for the whole row (`row_scale`: the rows the
// FP8 experts take, which keep their quantisation to the grouped GEMM; the wire format is the
// same, every group carrying the row's scale).
//
// One warp per token over the whole GPU; the row is loaded once and stored to every slot.
#include <cuda_bf16.h>

#include "common/copy.cuh"
#include "common/launch.h"
#include "layout/layout.h"

namespace moe_comm {

// Most send slots of one token: one per other node, and a token reaches at most top_k nodes.
constexpr int kMaxSendsPerToken = kMaxTopK;

__global__ void __launch_bounds__(kLocalThreads, kLocalBlocksPerSM) pack_kernel(const Buffers* __restrict__ buffers, const PackArgs a) {
  const Buffers& b = *buffers;
  const Topology t = b.topo;
  const int lane = threadIdx.x % kWarpSize;
  const int warps = gridDim.x * kLocalWarps;
  const int N = t.nodes, G = t.local_size, K = a.top_k, L = a.num_experts / t.world;
  const int slot_bytes = b.cap.net_slot_bytes();
  const int fp8_bytes = fp8_row_bytes(a.hidden);

  for (int tok = blockIdx.x * kLocalWarps + threadIdx.x / kWarpSize; tok < a.num_tokens; tok += warps) {
    const int my_send = lane < N ? a.send_idx[(int64_t)tok * N + lane] : -1;
    const unsigned sends = __ballot_sync(0xffffffffu, my_send >= 0);
    uint8_t* slot[kMaxSendsPerToken];
    int count = 0;
    for (unsigned rest = sends; rest != 0 && count < kMaxSendsPerToken; rest &= rest - 1) {
      const int m = __ffs(rest) - 1;
      const int s = __shfl_sync(0xffffffffu, my_send, m);
      slot[count++] = b.send_slots + (int64_t)s * slot_bytes;
      if (a.meta) {
        // The token's position at each rank of node m, from the picks that live there.
        NetMeta* meta = reinterpret_cast<NetMeta*>(slot[count - 1]);
        if (lane == 0) meta->token = tok;
        if (lane < K) {
          meta->expert[lane] = (int32_t)a.topk_idx[(int64_t)tok * K + lane];
          meta->weight[lane] = a.topk_w[(int64_t)tok * K + lane];
        }
        if (lane < G) {
          const int rank = t.rank_of(m, lane);
          int pos = -1;
          for (int k = 0; k < K; ++k) {
            const int64_t e = a.topk_idx[(int64_t)tok * K + k];
            const int p = a.pick_pos[(int64_t)tok * K + k];
            if (p >= 0 && e / L == rank) pos = p;
          }
          meta->rank_pos[lane] = pos;
        }
      }
    }
    if (count == 0 && !a.fp8) continue;

    const uint4* x = static_cast<const uint4*>(a.x) + (int64_t)tok * a.row_vecs;
    if (!a.fp8) {
      uint4* dst[kMaxSendsPerToken];
#pragma unroll
      for (int i = 0; i < kMaxSendsPerToken; ++i) dst[i] = i < count ? reinterpret_cast<uint4*>(slot[i] + kNetMetaBytes) : nullptr;
      copy_row(x, dst, a.row_vecs, lane);
      continue;
    }
    // FP8: 16 lanes per 128-channel group; row_vecs is a multiple of 16 (hidden % 128 == 0).
    uint8_t* own = a.own_fp8 + (int64_t)tok * fp8_bytes;
    float row_scale = 0.f;
    if (a.row_scale) {
      float amax = 0.f;
      for (int v = lane; v < a.row_vecs; v += kWarpSize) {
        float f[8];
        bf16x8_to_floats(x[v], f);
        amax = fmaxf(amax, amax8(f));
      }
      row_scale = fp8_scale(warp_max(amax), a.min_amax);
    }
    for (int base = 0; base < a.row_vecs; base += kWarpSize) {
      const int v = base + lane;
      const uint4 value = v < a.row_vecs ? x[v] : make_uint4(0, 0, 0, 0);
      const float group_scale = fp8_group_scale(value, a.min_amax);  // every lane takes part
      const float scale = a.row_scale ? row_scale : group_scale;
      if (v >= a.row_vecs) continue;
      const uint2 q = fp8_quantise8(value, fp8_inverse_scale(scale));
      const bool writes_scale = v % (kFp8GroupChannels / 8) == 0;
      const int scale_offset = a.hidden + 4 * (v / (kFp8GroupChannels / 8));
      *reinterpret_cast<uint2*>(own + 8 * v) = q;
      if (writes_scale) *reinterpret_cast<float*>(own + scale_offset) = scale;
      for (int i = 0; i < count; ++i) {
        uint8_t* row = slot[i] + kNetMetaBytes;
        *reinterpret_cast<uint2*>(row + 8 * v) = q;
        if (writes_scale) *reinterpret_cast<float*>(row + scale_offset) = scale;
      }
    }
  }
}

void launch_pack(const Buffers& b, const PackArgs& a, cudaStream_t stream) {
  const int blocks = warp_blocks(a.num_tokens, b.sm_count);
  if (blocks == 0) return;
  pack_kernel<<<blocks, kLocalThreads, 0, stream>>>(b.on_device, a);
  MOE_COMM_CHECK_LAUNCH("pack");
}

}  // namespace moe_comm
