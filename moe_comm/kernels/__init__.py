"""Python side of csrc/: the build, the NVSHMEM runtime, the ops' autograd, and the kernels'
bounds and error words read from csrc's headers."""
