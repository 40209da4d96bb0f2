"""The kernels' error words, named from csrc/common/errors.h (one copy for CUDA and Python).

The GPU writes them into mapped host memory without any synchronisation; `describe` turns a
read of them into the message the host raises.
"""

import re
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "common" / "errors.h"


def _enum(text: str, name: str, prefix: str) -> dict[int, tuple[str, str]]:
    """value -> (enumerator without `k` and `prefix`, its comment) of `enum name : int`."""
    body = re.search(r"enum " + name + r" : int \{(.*?)\};", text, re.S)
    if body is None:
        raise RuntimeError(f"{HEADER} has no enum {name}")
    found = re.finditer(r"^\s*k" + prefix + r"(\w+) = (\d+),\s*(?://\s*(.*))?$", body[1], re.M)
    return {int(m[2]): (m[1], (m[3] or "").strip()) for m in found}


_TEXT = HEADER.read_text()
WORDS = {name: value for value, (name, _) in _enum(_TEXT, "ErrorWord", "Error").items()}
KERNELS = {value: name for value, (name, _) in _enum(_TEXT, "CommKernel", "Kernel").items()}
PHASES = {value: what for value, (_, what) in _enum(_TEXT, "WaitPhase", "Phase").items()}
SLOT_BUFFERS = {value: what for value, (_, what) in _enum(_TEXT, "SlotBuffer", "Slots").items()}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass(frozen=True)
class KernelErrors:
    """One read of the error words."""

    rows_needed: int  # expert rows a call needed beyond the receive capacity (0: none)
    bad_expert_index: bool
    duplicate_expert: bool
    slots_buffer: str  # which slot buffer overflowed ("" if none)
    slots_needed: int
    timeout_kernel: str  # the communication kernel whose wait gave up ("" if none)
    timeout_phase: str
    timeout_peer: int

    @classmethod
    def from_words(cls, words: list[int]) -> "KernelErrors":
        w = {name: words[i] for name, i in WORDS.items() if name != "Words"}
        kernel = w["TimeoutKernel"]
        return cls(
            rows_needed=w["RowsNeeded"],
            bad_expert_index=bool(w["ExpertIndex"]),
            duplicate_expert=bool(w["DuplicateExpert"]),
            slots_buffer=SLOT_BUFFERS.get(w["SlotsBuffer"], ""),
            slots_needed=w["SlotsNeeded"],
            timeout_kernel=_snake(KERNELS.get(kernel - 1, "?")) if kernel else "",
            timeout_phase=PHASES.get(w["TimeoutPhase"], "?") if kernel else "",
            timeout_peer=w["TimeoutPeer"] if kernel else -1,
        )

    @property
    def any(self) -> bool:
        return bool(self.rows_needed or self.bad_expert_index or self.duplicate_expert or self.slots_buffer
                    or self.timeout_kernel)
