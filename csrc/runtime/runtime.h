// The process's NVSHMEM state: start-up, buffers, error words, teardown.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/buffers.h"

namespace moe_comm {

// What the buffers are sized for; fixed for the life of the process.
struct RuntimeShape {
  int rank = 0, world = 1, local_size = 1;
  Capacity cap;
  double timeout_s = 30.0;
};

// Bytes of symmetric heap `init` allocates (the Python side sets NVSHMEM_SYMMETRIC_SIZE from it).
size_t symmetric_bytes(const RuntimeShape& shape);
std::vector<uint8_t> unique_id();
void init(const std::vector<uint8_t>& uid, const RuntimeShape& shape);
const Buffers& buffers();
// The error words ([kErrorWords], common/errors.h) as the GPU wrote them so far (no sync).
std::vector<int32_t> read_errors(bool clear);
// NVSHMEM's collective teardown only when `together` (every rank agreed) and no wait of this rank
// gave up; otherwise only this process's own buffers are freed.
void finalize(bool together);

}  // namespace moe_comm
