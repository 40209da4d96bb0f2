// The bounds the kernels are written for, in one place: the CUDA code reads them as constants,
// and moe_comm/kernels/limits.py reads this file, so recipe checks on a login node (no GPU, no
// built extension) refuse what the kernels cannot run with the kernels' own numbers.
// Keep each definition on one line of the form `constexpr int kName = value;`.
#pragma once

namespace moe_comm {

// Most experts one token may pick (DeepSeek-V3 uses 8): bounds per-slot metadata and the
// per-pick registers of the copy loops.
constexpr int kMaxTopK = 8;
// Most experts in one MoE layer: bounds the per-block histograms in shared memory.
constexpr int kMaxExperts = 1024;
// Most ranks in one expert-parallel group (32 nodes x 8 GPUs; at 256, one expert per GPU).
constexpr int kMaxRanks = 256;
// Most ranks of one node (one NVLink domain), reached through nvshmem_ptr peer mappings.
constexpr int kMaxRanksPerNode = 8;
// Most nodes one EP group spans (kMaxRanks / the smallest node that spans it).
constexpr int kMaxNodes = 32;
// Longest one call of the emulated network link holds its SMs (internode/emulated_link.cu), in us.
constexpr int kMaxEmulatedHoldUs = 1000000;

}  // namespace moe_comm
