# Nebius B200 nodes on Soperator (8 x B200, NVLink 5, 8 x 400G InfiniBand), sourced by the job.
# MOE_COMM_BACKEND is set by the job from the recipe's [moe_comm] backend. NVLink multicast
# (NVLS) stays at NCCL/NVSHMEM's defaults: a user's export of NCCL_NVLS_ENABLE and friends wins.
source "$(dirname "${BASH_SOURCE[0]}")/infiniband.sh"

case "${MOE_COMM_BACKEND:-nccl}" in
    nvshmem|deepep) moe_comm_nvshmem_ibgda ;;
esac
