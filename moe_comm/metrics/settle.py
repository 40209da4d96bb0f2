"""The metrics' CPU collectives wait until gloo has let go of their tensors.

ProcessGroupGloo runs a collective on a worker thread (its runLoop), marks the work complete,
and only then drops its reference to the work, and with it to the work's tensors. If the
Python code that waited has already dropped the tensors, that late release frees their Python
objects, which takes the GIL. When it comes after CPython began finalizing (a rank that ends
right after its last step line, on a loaded machine), CPython ends the worker thread with
pthread_exit inside a C++ noexcept destructor, and std::terminate aborts the process:
"terminate called without an active exception", exit -6, for a run that had finished.

Measured on this 2-core CPU machine: the tail of a PP 2 x DP 2 gloo job (P2P, a functional
all-reduce, the pipeline stages' all-gather, then exit) aborted 5 and 6 times in 20 runs; a core
dump showed ~AsyncAllgatherWork -> TensorImpl::decref_pyobject -> gil_scoped_acquire ->
PyThread_exit_thread -> std::terminate on a gloo worker while the main thread was in
Py_FinalizeEx. Waiting for the release first: 0 in 20. TorchTitan's process groups stay alive
until the process ends (its functional collectives keep them), so their workers always meet
the finalizing interpreter.

The metrics processor's collectives are the last of every step, and so of every run: they
wait here (bounded) before their tensors go out of scope. NCCL is not affected (its watchdog
releases works and destroy_process_group joins it), so GPU tensors pass straight through.
"""

import time

import torch

RELEASE_TIMEOUT_S = 5.0


def released(*tensors: torch.Tensor, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
    """Return once no C++ owner but the caller's Python objects holds `tensors` (CPU tensors of
    a gloo collective that has completed), or after `timeout_s`."""
    cpu = [t for t in tensors if t.device.type == "cpu"]
    deadline = time.monotonic() + timeout_s
    while any(t._use_count() > 1 for t in cpu) and time.monotonic() < deadline:
        time.sleep(0.0002)  # releases the GIL for the worker
