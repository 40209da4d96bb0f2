# Helper sourced by the platform env files (not a platform itself): find this node's
# InfiniBand HCAs and export the NCCL/UCX/NVSHMEM device lists from them.
#
# Why detect instead of hard-coding: public Nebius B200 material disagrees (mlx5_4..11 vs the
# "mlx5" prefix) and a node also exposes mlx5_12, a virtual NIC that must not carry traffic.
# Only ports whose link layer is InfiniBand are kept, minus MOE_COMM_HCA_EXCLUDE. Any variable
# already exported before sbatch (e.g. NCCL_IB_HCA) wins over the detected value.
# Check by hand on a worker: `srun -N1 ibv_devinfo -l` and `ibv_devinfo -d mlx5_4 | grep -E 'state|link_layer'`.

moe_comm_ib_hcas() {
    local dev name exclude=",${MOE_COMM_HCA_EXCLUDE:-mlx5_12},"
    for dev in "${MOE_COMM_IB_SYSFS:-/sys/class/infiniband}"/*; do
        [[ -e "$dev/ports/1/link_layer" ]] || continue
        name=${dev##*/}
        if [[ "$exclude" == *",$name,"* ]]; then
            continue
        fi
        if [[ "$(cat "$dev/ports/1/link_layer")" == "InfiniBand" ]]; then
            printf '%s\n' "$name"
        fi
    done
    return 0
}

MOE_COMM_HCAS=$(moe_comm_ib_hcas | paste -sd, -)
if [[ -n "$MOE_COMM_HCAS" ]]; then
    # "=" makes NCCL match names exactly (mlx5_1 would otherwise also match mlx5_10..).
    export NCCL_IB_HCA=${NCCL_IB_HCA:-=$MOE_COMM_HCAS}
    export UCX_NET_DEVICES=${UCX_NET_DEVICES:-$(printf '%s:1,' ${MOE_COMM_HCAS//,/ } | sed 's/,$//')}
    export NVSHMEM_HCA_LIST=${NVSHMEM_HCA_LIST:-$UCX_NET_DEVICES}
else
    echo "moe_comm env: no InfiniBand HCA found under /sys/class/infiniband; NCCL will use sockets" >&2
fi
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-eth0}
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-$NCCL_SOCKET_IFNAME}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# NVSHMEM over InfiniBand with GPU-initiated RDMA (IBGDA), for the backends that use NVSHMEM
# (the settings Nebius gives for DeepEP on Soperator). IBGDA also needs the NVIDIA driver options
# EnableStreamMemOPs=1 and PeerMappingOverride=1 on the hosts (soperator/README.md) and
# unlimited locked memory. `moe_comm check` and `submit` read these by sourcing the platform env
# file before launch: an EP group across nodes needs NVSHMEM_REMOTE_TRANSPORT and an HCA list.
moe_comm_nvshmem_ibgda() {
    export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-ibrc}
    export NVSHMEM_IB_ENABLE_IBGDA=${NVSHMEM_IB_ENABLE_IBGDA:-1}
    export NVSHMEM_IBGDA_NIC_HANDLER=${NVSHMEM_IBGDA_NIC_HANDLER:-gpu}
    # The detected HCAs (above); where none were found (a login node), every HCA but the
    # excluded virtual NIC, in NVSHMEM's exclusion syntax.
    export NVSHMEM_HCA_LIST=${NVSHMEM_HCA_LIST:-^${MOE_COMM_HCA_EXCLUDE:-mlx5_12}}
    ulimit -l unlimited 2>/dev/null \
        || echo "moe_comm env: could not raise the locked-memory limit (ulimit -l is $(ulimit -l)); IBGDA may fail to register memory" >&2
}
