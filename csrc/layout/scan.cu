// Scan: per column, the exclusive prefix of the per-run counts, and the column's total. It
// turns the counts each warp took over its own run (of tokens, or of recv slots) into the
// positions the whole call agrees on, with no atomics, so layouts are deterministic.
#include <cub/block/block_scan.cuh>

#include "common/launch.h"
#include "layout/layout.h"

namespace moe_comm {

constexpr int kScanThreads = 256;

__global__ void __launch_bounds__(kScanThreads) scan_kernel(const ScanArgs a) {
  using BlockScan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename BlockScan::TempStorage temp;
  int32_t* row = a.run_counts + (int64_t)blockIdx.x * a.runs;
  const int per_thread = (a.runs + kScanThreads - 1) / kScanThreads;
  const int begin = min(a.runs, (int)threadIdx.x * per_thread);
  const int end = min(a.runs, begin + per_thread);
  int sum = 0;
  for (int r = begin; r < end; ++r) sum += row[r];
  int offset = 0, total = 0;
  BlockScan(temp).ExclusiveSum(sum, offset, total);
  for (int r = begin; r < end; ++r) {
    const int v = row[r];
    row[r] = offset;
    offset += v;
  }
  if (threadIdx.x == 0) a.column_totals[blockIdx.x] = total;
}

void launch_scan(const ScanArgs& a, cudaStream_t stream) {
  if (a.columns <= 0) return;
  scan_kernel<<<a.columns, kScanThreads, 0, stream>>>(a);
  MOE_COMM_CHECK_LAUNCH("scan");
}

}  // namespace moe_comm
