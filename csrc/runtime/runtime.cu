// NVSHMEM start-up and the process's buffers.
//
// NVSHMEM comes from the nvidia-nvshmem-cu13 wheel. It is bootstrapped by unique ID: rank 0's
// ID travels over the EP group's torch.distributed group (Python side), and every rank then
// calls nvshmemx_init_attr. The buffers are allocated once, sized from the recipe; the copies of
// the ranks of this node are mapped through nvshmem_ptr (the NVLink hop needs them), while
// ranks of other nodes are only reached by puts and signals (the network hop).
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "common/launch.h"
#include "runtime/runtime.h"

namespace moe_comm {
namespace {

Buffers g_buffers;
bool g_initialized = false;
volatile int32_t* g_host_errors = nullptr;
std::vector<void*> g_symmetric;  // freed at finalize
std::vector<void*> g_local;

void fail(const std::string& what) { throw std::runtime_error("moe_comm: " + what); }

// Every symmetric buffer, in allocation order: name, bytes.
struct Sizes {
  size_t fwd_rows, fwd_meta, fwd_done, partial_flags, fwd_grad_w, grad_w_flags, ready;
  size_t net_slots, net_partials, net_grad_w, send_slots, home_rows, home_grad_w, rail, rail_sig, rail_ready, sig;
};

Sizes sizes(const RuntimeShape& s) {
  const Capacity& c = s.cap;
  const size_t G = s.local_size, N = s.world / s.local_size;
  Sizes z;
  z.fwd_rows = G * c.fwd_slots * (size_t)c.row_bytes;
  z.fwd_meta = G * c.fwd_slots * sizeof(RecvMeta);
  z.fwd_done = G * 2 * sizeof(uint32_t);
  z.partial_flags = G * c.fwd_chunks * sizeof(uint32_t);
  z.fwd_grad_w = G * c.fwd_slots * kMaxTopK * sizeof(float);
  z.grad_w_flags = G * c.fwd_slots * sizeof(uint32_t);
  z.ready = kCallKinds * G * sizeof(uint32_t);
  z.net_slots = (size_t)c.net_slots * c.net_slot_bytes();
  z.net_partials = (size_t)c.net_slots * c.row_bytes;
  z.net_grad_w = (size_t)c.net_slots * kMaxTopK * sizeof(float);
  z.send_slots = (size_t)c.send_slots * c.net_slot_bytes();
  z.home_rows = (size_t)c.send_slots * c.row_bytes;
  z.home_grad_w = (size_t)c.send_slots * kMaxTopK * sizeof(float);
  z.rail = N * (N + G) * sizeof(int32_t);
  z.rail_sig = N * sizeof(uint64_t);
  z.rail_ready = kCallKinds * N * sizeof(uint64_t);
  z.sig = N * c.chunks * sizeof(uint64_t);
  return z;
}

// nvshmem_malloc rounds each allocation up; keep room for that.
constexpr size_t kAllocSlack = 512;

template <typename T>
T* symmetric_alloc(size_t bytes, const char* name) {
  void* ptr = nvshmem_malloc(bytes > 0 ? bytes : 16);
  if (ptr == nullptr) {
    std::ostringstream msg;
    msg << "nvshmem_malloc of " << bytes << " bytes for " << name
        << " failed; the symmetric heap (NVSHMEM_SYMMETRIC_SIZE) is too small or the GPU is out of memory";
    fail(msg.str());
  }
  MOE_COMM_CUDA_CHECK(cudaMemset(ptr, 0, bytes > 0 ? bytes : 16));
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

// This node's copies of a symmetric buffer, through the NVLink (or same-GPU) mappings.
template <typename T>
void map_node(T* local, T* Peer::*field, const Topology& t, const char* name) {
  for (int h = 0; h < t.local_size; ++h) {
    const int pe = t.rank_of(t.node, h);
    void* ptr = nvshmem_ptr(local, pe);
    if (ptr == nullptr) {
      std::ostringstream msg;
      msg << "EP rank " << pe << " (rank " << h << " of node " << t.node << " of " << t.nodes
          << ") has no NVLink/P2P mapping of " << name
          << "; the ranks of one node must be NVLink peers (nvidia-smi topo -m), or set [moe_comm] "
             "virtual_node_size to the size of the NVLink domain";
      fail(msg.str());
    }
    g_buffers.peer[h].*field = static_cast<T*>(ptr);
  }
}

}  // namespace

size_t symmetric_bytes(const RuntimeShape& shape) {
  const Sizes z = sizes(shape);
  const size_t all[] = {z.fwd_rows,     z.fwd_meta,   z.fwd_done,   z.partial_flags, z.fwd_grad_w, z.grad_w_flags,
                        z.ready,        z.net_slots,  z.net_partials, z.net_grad_w,  z.send_slots, z.home_rows,
                        z.home_grad_w,  z.rail,       z.rail,       z.rail_sig,    z.rail_ready, z.sig,
                        z.sig,          z.sig};
  size_t bytes = 0;
  for (size_t b : all) bytes += b + kAllocSlack;
  return bytes;
}

std::vector<uint8_t> unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) fail("nvshmemx_get_uniqueid failed");
  std::vector<uint8_t> bytes(sizeof(id));
  std::memcpy(bytes.data(), &id, sizeof(id));
  return bytes;
}

void init(const std::vector<uint8_t>& uid, const RuntimeShape& s) {
  if (g_initialized) fail("NVSHMEM is already initialised in this process");
  std::ostringstream bad;
  if (s.world < 1 || s.world > kMaxRanks) bad << "an EP group of " << s.world << " ranks (1.." << kMaxRanks << ")";
  else if (s.local_size < 1 || s.local_size > kMaxRanksPerNode || s.world % s.local_size != 0)
    bad << s.local_size << " ranks per node for an EP group of " << s.world << " (1.." << kMaxRanksPerNode
        << ", dividing the group)";
  else if (s.world / s.local_size > kMaxNodes) bad << s.world / s.local_size << " nodes (at most " << kMaxNodes << ")";
  else if (s.cap.row_bytes % 16 != 0) bad << "rows of " << s.cap.row_bytes << " bytes (a multiple of 16)";
  if (!bad.str().empty()) fail("the nvshmem kernels cannot serve " + bad.str());
  if (uid.size() != sizeof(nvshmemx_uniqueid_t)) fail("the NVSHMEM unique id has the wrong size");

  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(s.rank, s.world, &id, &attr) != 0) fail("nvshmemx_set_attr_uniqueid_args failed");
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) {
    fail("nvshmemx_init_attr failed; see NVSHMEM's messages above (the Python side names the likely causes)");
  }
  if (nvshmem_my_pe() != s.rank || nvshmem_n_pes() != s.world) {
    std::ostringstream msg;
    msg << "NVSHMEM came up as PE " << nvshmem_my_pe() << " of " << nvshmem_n_pes() << ", expected " << s.rank << " of "
        << s.world;
    fail(msg.str());
  }

  Buffers& b = g_buffers;
  Topology& t = b.topo;
  t.rank = s.rank;
  t.world = s.world;
  t.local_size = s.local_size;
  t.nodes = s.world / s.local_size;
  t.node = s.rank / s.local_size;
  t.local = s.rank % s.local_size;
  b.cap = s.cap;
  int device = 0;
  MOE_COMM_CUDA_CHECK(cudaGetDevice(&device));
  MOE_COMM_CUDA_CHECK(cudaDeviceGetAttribute(&b.sm_count, cudaDevAttrMultiProcessorCount, device));

  const Sizes z = sizes(s);
  Peer self;
  self.fwd_rows = symmetric_alloc<uint8_t>(z.fwd_rows, "recv slot rows");
  self.fwd_meta = symmetric_alloc<RecvMeta>(z.fwd_meta, "recv slot metadata");
  self.fwd_done = symmetric_alloc<uint32_t>(z.fwd_done, "delivery counts");
  self.fwd_partials = symmetric_alloc<uint8_t>(z.fwd_rows, "partial sums");
  self.partial_flags = symmetric_alloc<uint32_t>(z.partial_flags, "partial-sum flags");
  self.fwd_grad_w = symmetric_alloc<float>(z.fwd_grad_w, "routing-weight gradients");
  self.grad_w_flags = symmetric_alloc<uint32_t>(z.grad_w_flags, "routing-weight gradient flags");
  self.ready = symmetric_alloc<uint32_t>(z.ready, "ready words");
  map_node(self.fwd_rows, &Peer::fwd_rows, t, "recv slot rows");
  map_node(self.fwd_meta, &Peer::fwd_meta, t, "recv slot metadata");
  map_node(self.fwd_done, &Peer::fwd_done, t, "delivery counts");
  map_node(self.fwd_partials, &Peer::fwd_partials, t, "partial sums");
  map_node(self.partial_flags, &Peer::partial_flags, t, "partial-sum flags");
  map_node(self.fwd_grad_w, &Peer::fwd_grad_w, t, "routing-weight gradients");
  map_node(self.grad_w_flags, &Peer::grad_w_flags, t, "routing-weight gradient flags");
  map_node(self.ready, &Peer::ready, t, "ready words");

  b.net_slots = symmetric_alloc<uint8_t>(z.net_slots, "network arrivals");
  b.net_partials = symmetric_alloc<uint8_t>(z.net_partials, "combined rows going home");
  b.net_grad_w = symmetric_alloc<float>(z.net_grad_w, "gradients going home");
  b.send_slots = symmetric_alloc<uint8_t>(z.send_slots, "send slots");
  b.home_rows = symmetric_alloc<uint8_t>(z.home_rows, "combined rows coming home");
  b.home_grad_w = symmetric_alloc<float>(z.home_grad_w, "gradients coming home");
  b.rail_counts = symmetric_alloc<int32_t>(z.rail, "rail counts");
  b.rail_send = symmetric_alloc<int32_t>(z.rail, "rail counts staging");
  b.rail_counts_sig = symmetric_alloc<uint64_t>(z.rail_sig, "rail count signals");
  b.rail_ready = symmetric_alloc<uint64_t>(z.rail_ready, "rail ready signals");
  b.net_sig = symmetric_alloc<uint64_t>(z.sig, "network chunk signals");
  b.home_sig = symmetric_alloc<uint64_t>(z.sig, "home chunk signals");
  b.home_grad_w_sig = symmetric_alloc<uint64_t>(z.sig, "home gradient signals");

  b.calls = local_alloc<uint32_t>(kCallKinds);
  b.delivered = local_alloc<uint32_t>(kMaxRanksPerNode);
  b.wait.abort = local_alloc<int32_t>(1);
  b.wait.timeout_ns = (int64_t)(s.timeout_s * 1e9);
  void* host_errors = nullptr;
  MOE_COMM_CUDA_CHECK(cudaHostAlloc(&host_errors, kErrorWords * sizeof(int32_t), cudaHostAllocMapped));
  std::memset(host_errors, 0, kErrorWords * sizeof(int32_t));
  void* device_errors = nullptr;
  MOE_COMM_CUDA_CHECK(cudaHostGetDevicePointer(&device_errors, host_errors, 0));
  g_host_errors = static_cast<volatile int32_t*>(host_errors);
  b.wait.errors = static_cast<int32_t*>(device_errors);

  Buffers* on_device = local_alloc<Buffers>(1);
  b.on_device = on_device;
  MOE_COMM_CUDA_CHECK(cudaMemcpy(on_device, &b, sizeof(Buffers), cudaMemcpyHostToDevice));

  // Every peer must see zeroed flags before any kernel writes one.
  MOE_COMM_CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();
  g_initialized = true;
}

const Buffers& buffers() {
  if (!g_initialized) fail("NVSHMEM is not initialised; the nvshmem backend must start its runtime first");
  return g_buffers;
}

std::vector<int32_t> read_errors(bool clear) {
  std::vector<int32_t> out(kErrorWords, 0);
  if (g_host_errors == nullptr) return out;
  for (int i = 0; i < kErrorWords; ++i) {
    out[i] = g_host_errors[i];
    if (clear) g_host_errors[i] = 0;
  }
  return out;
}

void finalize(bool together) {
  if (!g_initialized) return;
  // NVSHMEM's teardown is collective and waits without a bound: only when every rank agreed
  // (Python side, bounded) that all reached it cleanly; never after a wait of this rank gave up.
  int32_t aborted = 0;
  MOE_COMM_CUDA_CHECK(cudaMemcpy(&aborted, g_buffers.wait.abort, sizeof(aborted), cudaMemcpyDeviceToHost));
  MOE_COMM_CUDA_CHECK(cudaDeviceSynchronize());
  const bool collective = together && aborted == 0;
  if (collective) {
    nvshmem_barrier_all();
    for (void* ptr : g_symmetric) nvshmem_free(ptr);
  }
  for (void* ptr : g_local) MOE_COMM_CUDA_CHECK(cudaFree(ptr));
  g_symmetric.clear();
  g_local.clear();
  MOE_COMM_CUDA_CHECK(cudaFreeHost(const_cast<int32_t*>(g_host_errors)));
  g_host_errors = nullptr;
  if (collective) nvshmem_finalize();
  g_buffers = Buffers{};
  g_initialized = false;
}

}  // namespace moe_comm
