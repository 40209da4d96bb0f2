"""Python side of csrc/: build, NVSHMEM runtime, and the autograd of the custom ops."""

# Warps of each 32-warp block given to each role of a kernel (the rest do the receiving side).
DISPATCH_SENDER_WARPS = 16
COMBINE_PUSHER_WARPS = 16
COMBINE_BACKWARD_SENDER_WARPS = 12
COMBINE_BACKWARD_COLLECTOR_WARPS = 2
