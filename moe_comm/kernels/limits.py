"""The kernels' bounds, read from csrc/common/limits.h so Python and CUDA share one copy.

Recipe checks run on login nodes without a GPU or a built extension, so the numbers come from
the header itself rather than from the compiled library.
"""

import re
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "common" / "limits.h"


@dataclass(frozen=True)
class KernelLimits:
    max_top_k: int
    max_experts: int
    max_ranks: int
    max_ranks_per_node: int
    max_nodes: int
    max_emulated_hold_us: int  # one call of the emulated link (moe_comm.kernels.emulated_link)


def _read(header: Path = HEADER) -> KernelLimits:
    values = {m[1]: int(m[2]) for m in re.finditer(r"constexpr int k(\w+) = (\d+);", header.read_text())}
    names = {"MaxTopK": "max_top_k", "MaxExperts": "max_experts", "MaxRanks": "max_ranks",
             "MaxRanksPerNode": "max_ranks_per_node", "MaxNodes": "max_nodes",
             "MaxEmulatedHoldUs": "max_emulated_hold_us"}
    missing = sorted(set(names) - set(values))
    if missing:
        raise RuntimeError(f"{header} does not define {', '.join('k' + n for n in missing)}")
    return KernelLimits(**{field: values[name] for name, field in names.items()})


LIMITS = _read()
