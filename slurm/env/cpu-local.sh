# CPU-only runs (gloo) on a local or test Slurm: no GPUs, no InfiniBand, fake nodes that all
# live on this host. Used by the CPU debug recipe's Slurm tests.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# All fake nodes are this host: keep gloo on loopback whatever the node names resolve to.
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
