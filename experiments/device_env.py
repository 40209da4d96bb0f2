"""The environment every run on the project's lent H200 test machines gets: NVLink multicast
(NVLS) off in NCCL, torch symmetric memory and NVSHMEM, because a program that uses multicast can
take those shared hosts down.

It is a rule of those machines, not of the product: `python -m moe_comm train` and the
slurm/env/ platform files leave multicast to the libraries' defaults and to the user's exports
(a B200 or H100 cluster is free to use it). The benchmark and GPU-test helpers that run on the
lent machines add it: runner.py (the training runs of mfu_sweep.py and the others),
tests/test_nvshmem_gpu.py, run_h200x2.sh, gpu_checks.sh.
"""

DEVICE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
