# Nebius H100/H200 nodes (8 GPUs, NVLink 4, 8 x 400G InfiniBand), sourced by the job.
# MOE_COMM_BACKEND is set by the job from the recipe's [moe_comm] backend.
source "$(dirname "${BASH_SOURCE[0]}")/infiniband.sh"

# NVLink multicast stays off on our H100/H200 hosts (the project's device notes require it):
# NCCL's NVLS algorithms, torch symmetric-memory multicast and NVSHMEM's NVLS all use it.
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1

case "${MOE_COMM_BACKEND:-nccl}" in
    nvshmem|deepep) moe_comm_nvshmem_ibgda ;;
esac
