// NVSHMEM start-up and the process's buffers.
//
// NVSHMEM comes from the nvidia-nvshmem-cu13 wheel. It is bootstrapped by unique ID: rank 0's
// ID travels over the existing torch.distributed group (Python side), every rank then calls
// nvshmemx_init_attr. The buffers are allocated once, sized from the recipe, and every peer's
// copy is mapped through nvshmem_ptr; a peer without an NVLink mapping is an error (these
// kernels are the intranode path).
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "runtime.h"

namespace moe_comm {
namespace {

Buffers g_buffers;
bool g_initialized = false;
volatile int32_t* g_host_errors = nullptr;
std::vector<void*> g_symmetric;  // freed at finalize
std::vector<void*> g_local;
int g_last_kind = -1;

void fail(const std::string& what) { throw std::runtime_error("moe_comm: " + what); }

template <typename T>
T* symmetric_alloc(size_t count, const char* name) {
  const size_t bytes = count * sizeof(T);
  void* ptr = nvshmem_malloc(bytes);
  if (ptr == nullptr) {
    std::ostringstream msg;
    msg << "nvshmem_malloc of " << bytes << " bytes for " << name
        << " failed; the symmetric heap (NVSHMEM_SYMMETRIC_SIZE) is too small or the GPU is out of memory";
    fail(msg.str());
  }
  MOE_COMM_CUDA_CHECK(cudaMemset(ptr, 0, bytes));
  g_symmetric.push_back(ptr);
  return static_cast<T*>(ptr);
}

template <typename T>
T* local_alloc(size_t count) {
  void* ptr = nullptr;
  MOE_COMM_CUDA_CHECK(cudaMalloc(&ptr, count * sizeof(T)));
  MOE_COMM_CUDA_CHECK(cudaMemset(ptr, 0, count * sizeof(T)));
  g_local.push_back(ptr);
  return static_cast<T*>(ptr);
}

template <typename T>
void map_peers(T* local, T* (&peers)[kMaxRanks], int world, const char* name) {
  for (int pe = 0; pe < world; ++pe) {
    void* ptr = nvshmem_ptr(local, pe);
    if (ptr == nullptr) {
      std::ostringstream msg;
      msg << "rank " << pe << " has no NVLink/P2P mapping of " << name
          << "; the nvshmem backend moves tokens within one node only (EP group on one NVLink domain)";
      fail(msg.str());
    }
    peers[pe] = static_cast<T*>(ptr);
  }
}

}  // namespace

size_t symmetric_bytes(int world, int max_tokens, int max_row_bytes) {
  const size_t slots = (size_t)world * max_tokens;
  size_t bytes = 0;
  bytes += 2 * slots * max_row_bytes;                       // rows, partials
  bytes += slots * sizeof(SlotMeta);                        // meta
  bytes += 3 * slots * sizeof(uint32_t);                    // slot, partial, grad_w flags
  bytes += (size_t)world * (kMaxExperts + 1) * sizeof(int32_t) + world * sizeof(uint32_t);
  bytes += (size_t)max_tokens * kMaxTopK * sizeof(float);  // grad_w
  return bytes;
}

std::vector<uint8_t> unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) fail("nvshmemx_get_uniqueid failed");
  std::vector<uint8_t> bytes(sizeof(id));
  std::memcpy(bytes.data(), &id, sizeof(id));
  return bytes;
}

void init(const std::vector<uint8_t>& uid, int rank, int world, int max_tokens, int max_row_bytes, int max_blocks) {
  if (g_initialized) fail("NVSHMEM is already initialised in this process");
  if (world < 1 || world > kMaxRanks) {
    std::ostringstream msg;
    msg << "an expert-parallel group of " << world << " ranks; the nvshmem backend serves 1 to " << kMaxRanks
        << " ranks of one node";
    fail(msg.str());
  }
  if (uid.size() != sizeof(nvshmemx_uniqueid_t)) fail("the NVSHMEM unique id has the wrong size");
  if (max_row_bytes % 16 != 0) fail("max_row_bytes must be a multiple of 16");

  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr) != 0) fail("nvshmemx_set_attr_uniqueid_args failed");
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) {
    fail("nvshmemx_init_attr failed (check NVSHMEM_* environment, e.g. NVSHMEM_REMOTE_TRANSPORT=none on one node)");
  }
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != world) {
    std::ostringstream msg;
    msg << "NVSHMEM came up as PE " << nvshmem_my_pe() << " of " << nvshmem_n_pes() << ", expected " << rank << " of "
        << world;
    fail(msg.str());
  }

  Buffers& b = g_buffers;
  b.rank = rank;
  b.world = world;
  b.max_tokens = max_tokens;
  b.max_row_bytes = max_row_bytes;
  b.max_blocks = max_blocks;
  const size_t slots = (size_t)world * max_tokens;
  b.rows = symmetric_alloc<uint8_t>(slots * max_row_bytes, "dispatch rows");
  b.partials = symmetric_alloc<uint8_t>(slots * max_row_bytes, "combine partials");
  b.meta = symmetric_alloc<SlotMeta>(slots, "slot metadata");
  b.slot_flag = symmetric_alloc<uint32_t>(slots, "slot flags");
  b.partial_flag = symmetric_alloc<uint32_t>(slots, "partial flags");
  b.grad_w_flag = symmetric_alloc<uint32_t>(slots, "routing-weight gradient flags");
  b.counts = symmetric_alloc<int32_t>((size_t)world * (kMaxExperts + 1), "counts");
  b.counts_flag = symmetric_alloc<uint32_t>(world, "count flags");
  b.grad_w = symmetric_alloc<float>((size_t)max_tokens * kMaxTopK, "routing-weight gradients");
  map_peers(b.rows, b.peer_rows, world, "dispatch rows");
  map_peers(b.partials, b.peer_partials, world, "combine partials");
  map_peers(b.meta, b.peer_meta, world, "slot metadata");
  map_peers(b.slot_flag, b.peer_slot_flag, world, "slot flags");
  map_peers(b.partial_flag, b.peer_partial_flag, world, "partial flags");
  map_peers(b.grad_w_flag, b.peer_grad_w_flag, world, "routing-weight gradient flags");
  map_peers(b.counts, b.peer_counts, world, "counts");
  map_peers(b.counts_flag, b.peer_counts_flag, world, "count flags");
  map_peers(b.grad_w, b.peer_grad_w, world, "routing-weight gradients");

  b.block_hist = local_alloc<int32_t>((size_t)max_blocks * (kMaxExperts + kMaxRanks));
  b.token_rank = local_alloc<int32_t>((size_t)max_tokens * kMaxTopK);
  b.calls = local_alloc<uint32_t>(2);
  void* host_errors = nullptr;
  MOE_COMM_CUDA_CHECK(cudaHostAlloc(&host_errors, kErrorWords * sizeof(int32_t), cudaHostAllocMapped));
  std::memset(host_errors, 0, kErrorWords * sizeof(int32_t));
  void* device_errors = nullptr;
  MOE_COMM_CUDA_CHECK(cudaHostGetDevicePointer(&device_errors, host_errors, 0));
  g_host_errors = static_cast<volatile int32_t*>(host_errors);
  b.errors = static_cast<int32_t*>(device_errors);

  // Every peer must see zeroed flags before any kernel writes one.
  MOE_COMM_CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();
  g_initialized = true;
}

const Buffers& buffers() {
  if (!g_initialized) fail("NVSHMEM is not initialised; the nvshmem backend must call init first");
  return g_buffers;
}

bool initialized() { return g_initialized; }

std::vector<int32_t> read_errors(bool clear) {
  std::vector<int32_t> out(kErrorWords, 0);
  if (g_host_errors == nullptr) return out;
  for (int i = 0; i < kErrorWords; ++i) {
    out[i] = g_host_errors[i];
    if (clear) g_host_errors[i] = 0;
  }
  return out;
}

void barrier(cudaStream_t stream) {
  buffers();
  nvshmemx_barrier_all_on_stream(stream);
  MOE_COMM_CUDA_CHECK(cudaGetLastError());
}

void before_call(int kind, cudaStream_t stream) {
  if (kind == g_last_kind) barrier(stream);
  g_last_kind = kind;
}

void finalize() {
  if (!g_initialized) return;
  MOE_COMM_CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();
  for (void* ptr : g_symmetric) nvshmem_free(ptr);
  for (void* ptr : g_local) MOE_COMM_CUDA_CHECK(cudaFree(ptr));
  g_symmetric.clear();
  g_local.clear();
  MOE_COMM_CUDA_CHECK(cudaFreeHost(const_cast<int32_t*>(g_host_errors)));
  g_host_errors = nullptr;
  nvshmem_finalize();
  g_buffers = Buffers{};
  g_last_kind = -1;
  g_initialized = false;
}

}  // namespace moe_comm
