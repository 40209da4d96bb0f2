"""The environment every run on the project's lent H200 test machines gets: NVLink multicast
(NVLS) off in NCCL, torch symmetric memory and NVSHMEM, because a program that uses multicast can
take those shared hosts down.

It is a rule of those machines, not of the product: `python -m moe_comm train` and the
slurm/env/ platform files leave multicast to the libraries' defaults and to the user's exports
(a B200 or H100 cluster is free to use it). The benchmark and GPU-test helpers that run on the
lent machines add it (and Mps, when ranks share a GPU): runner.py (the training runs of mfu_sweep.py and the others),
tests/test_nvshmem_gpu.py, run_h200x2.sh, gpu_checks.sh.
"""

import shutil
import subprocess
import time

DEVICE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class Mps:
    """The CUDA MPS daemon while several ranks share one GPU (NVSHMEM PEs over a gloo group; root on
    the device machines). A daemon already running (started by the caller's script) is used as it
    is and left running; one started here is stopped here. Also a context manager."""

    def __init__(self):
        self.started = False

    def start(self) -> None:
        control = shutil.which("nvidia-cuda-mps-control")
        if control is None:
            raise RuntimeError("several ranks must share a GPU but nvidia-cuda-mps-control is not on the PATH")
        if subprocess.run([control, "-d"], capture_output=True).returncode == 0:
            self.started = True
            time.sleep(1)
        elif subprocess.run(["pgrep", "-f", "nvidia-cuda-mps-control"], capture_output=True).returncode != 0:
            raise RuntimeError("nvidia-cuda-mps-control -d failed and no MPS daemon runs")

    def stop(self) -> None:
        if self.started:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, check=False)
            self.started = False

    def __enter__(self) -> "Mps":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
