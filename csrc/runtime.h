// The process's NVSHMEM state: start-up, buffers, error words, teardown.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "buffers.h"
#include "launch.h"

namespace moe_comm {

// Bytes of symmetric heap init allocates (the Python side sets NVSHMEM_SYMMETRIC_SIZE from it).
size_t symmetric_bytes(int world, int max_tokens, int max_row_bytes);
std::vector<uint8_t> unique_id();
void init(const std::vector<uint8_t>& uid, int rank, int world, int max_tokens, int max_row_bytes, int max_blocks);
bool initialized();
const Buffers& buffers();
// [rows needed beyond capacity (0 if none), bad expert index seen, duplicate expert seen].
std::vector<int32_t> read_errors(bool clear);
void barrier(cudaStream_t stream);
// Called before each kernel with kDispatchLikeCalls or kCombineLikeCalls: two calls of one
// kind in a row would let a fast peer overwrite buffers a slow one still reads, so a
// barrier on the stream separates them (never needed in training, where kinds alternate).
void before_call(int kind, cudaStream_t stream);
void finalize();

}  // namespace moe_comm
