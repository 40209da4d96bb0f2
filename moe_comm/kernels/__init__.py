"""Python side of csrc/: build, NVSHMEM runtime, and the autograd of the custom ops."""

# Warps of each 32-warp block of a communication kernel that push rows over NVLink; the rest
# receive (dispatch, combine backward: wait for arrivals and record the layout) or finalize
# (combine: add up the partials that came home).
DISPATCH_SENDER_WARPS = 24
COMBINE_PUSHER_WARPS = 16
