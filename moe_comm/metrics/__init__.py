"""Per-step MoE communication metrics on top of TorchTitan's, to JSONL and W&B.

- `instrument(backend)` wraps a dispatch/combine backend with timers and routing counters.
- `build_metrics_processor` is the train spec's `build_metrics_processor_fn`: TorchTitan's
  MetricsProcessor plus the comm breakdown, the right MFU peak, a JSONL file and W&B naming.
- `keys` names every metric this package adds; `report` and `dashboard` read them from there.

The torch/TorchTitan parts load on first use, so `python -m moe_comm dashboard`, which only
needs `keys` and `naming`, starts without importing torch (`report` asks the backend classes
for their labels and colours, which does).
"""

import importlib

_LAZY = {
    "instrument": "moe_comm.metrics.instrumented",
    "InstrumentedBackend": "moe_comm.metrics.instrumented",
    "build_metrics_processor": "moe_comm.metrics.processor",
    "MoECommMetricsProcessor": "moe_comm.metrics.processor",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_comm.metrics' has no attribute {name!r}")
