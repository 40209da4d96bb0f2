# Nebius H100/H200 nodes (8 GPUs, NVLink 4, 8 x 400G InfiniBand), sourced by the job.
# MOE_COMM_BACKEND is set by the job from the recipe's [moe_comm] backend.
# NVLink multicast (NVLS) is left to NCCL/NVSHMEM's defaults and to the user's exports: turning
# it off is a rule of the project's lent test machines (experiments/device_env.py), not of a cluster.
source "$(dirname "${BASH_SOURCE[0]}")/infiniband.sh"

case "${MOE_COMM_BACKEND:-nccl}" in
    nvshmem|deepep) moe_comm_nvshmem_ibgda ;;
esac
