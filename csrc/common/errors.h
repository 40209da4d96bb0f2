// The error words the kernels raise and the host reads after a call (mapped pinned memory),
// and the names of what a communication kernel can wait for. moe_comm/kernels/errors.py reads
// this file for the messages, so keep each enumerator on one line: `kName = N,  // what`.
#pragma once

namespace moe_comm {

enum ErrorWord : int {
  kErrorRowsNeeded = 0,       // expert rows a call needed when they exceeded the receive capacity
  kErrorExpertIndex = 1,      // 1: a topk index outside [0, num_experts)
  kErrorDuplicateExpert = 2,  // 1: a token picked the same expert twice
  kErrorSlotsBuffer = 3,      // SlotBuffer that overflowed, 0: none
  kErrorSlotsNeeded = 4,      // slots that buffer needed
  kErrorTimeoutKernel = 5,    // CommKernel + 1 of the first wait that timed out, 0: none
  kErrorTimeoutPhase = 6,     // WaitPhase of that wait
  kErrorTimeoutPeer = 7,      // EP rank it waited for
  kErrorWords = 8,
};

enum SlotBuffer : int {
  kSlotsForwarded = 1,  // rows one forwarder of the node delivers to one rank
  kSlotsNetwork = 2,    // rows one rank receives over the network
};

enum CommKernel : int {
  kKernelDispatch = 0,      // dispatch (and the backward of combine)
  kKernelCombine = 1,       // combine (and the backward of dispatch)
  kKernelCollectGradW = 2,  // routing-weight gradients travelling home
  kKernelPreflight = 3,     // the preflight's probes between every pair of ranks
};

enum WaitPhase : int {
  kPhaseReady = 0,         // the peer announcing its buffers are free for this call
  kPhaseCounts = 1,        // the peer's send counts (network hop)
  kPhaseNetworkRows = 2,   // a chunk of rows from the peer over the network
  kPhaseForwarded = 3,     // the peer finishing its NVLink deliveries to this rank
  kPhasePartials = 4,      // a chunk of partial sums from the peer over NVLink
  kPhaseHomePartials = 5,  // a chunk of combined rows coming home from the peer over the network
  kPhaseGradW = 6,         // routing-weight gradients from the peer over NVLink
  kPhaseHomeGradW = 7,     // routing-weight gradients coming home from the peer over the network
};

}  // namespace moe_comm
