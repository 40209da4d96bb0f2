"""The figures the prediction code reads rather than measures (datasheets, public measurements,
probes on this project's machines not yet recorded in results/), each an `Assumption` with its
source, and where the measured inputs live.

Every other module of moe_comm.predict may import this one; it imports none of theirs, so the
read figures sit at the bottom of the package."""

from dataclasses import dataclass
from pathlib import Path

from moe_comm import gpus

REPO = Path(__file__).resolve().parents[2]
# The one folder the model reads under results/: its measured inputs, each described (what, machine,
# date, kernels' commit, command) in its MANIFEST.json. The rest of results/ is the archive.
MODEL_INPUTS = REPO / "results" / "model_inputs"
VALIDATION = MODEL_INPUTS / "scale_model_validation.json"


@dataclass(frozen=True)
class Assumption:
    """A figure the model takes as given. An unmeasured input the predictions carry as a range
    also has `low` and `high` (the input's own values, whichever end is pessimistic) and the
    source of that range."""

    name: str
    value: float
    unit: str
    source: str
    low: float | None = None
    high: float | None = None
    range_source: str = ""


@dataclass(frozen=True)
class Inputs:
    """One value of each unmeasured input a prediction is made at (`SCENARIOS`): the central
    values, or every one at the end of its range that gives the fewest tokens per second ("low")
    or the most ("high"). tokens/s moves one way with each, so the two ends bound every mix.
      network_efficiency  the achieved share of the NIC's line rate
      peak_share          another GPU's share of its datasheet peaks, over the share the measured
                          GPU reached (1: the same share)
      imbalance           which statistic of the measured busiest-rank load stands for the routing
                          ("drawn": only the drawn routing's own; "median", "p90" of the measured)
      idle_ratio          GPU idle per busy second of compute (launch gaps, host work)
      host_sync           which end of each measured host synchronisation's cost ("low",
                          "central", "high")"""

    network_efficiency: float
    peak_share: float
    imbalance: str
    idle_ratio: float
    host_sync: str


# The predictions every figure of `check` and `plan` carries: the pessimistic end, the central
# value, the optimistic end.
SCENARIOS = ("low", "central", "high")


# Datasheet and public figures (read, not measured here); the GPUs' own from moe_comm.gpus.
READ = {
    "nvlink_gbps.H200": Assumption("NVLink per GPU, per direction, H200/H100", gpus.model("H200").nvlink_gbps, "GB/s",
                                   "NVIDIA H200 datasheet (NVLink 900 GB/s bidirectional)"),
    "nvlink_gbps.B200": Assumption("NVLink per GPU, per direction, B200", gpus.model("B200").nvlink_gbps, "GB/s",
                                   "NVIDIA B200 datasheet (NVLink 5, 1.8 TB/s bidirectional); issue 12"),
    "hbm_tbs.H200": Assumption("HBM bandwidth, H200", gpus.model("H200").hbm_tbs, "TB/s", "NVIDIA H200 datasheet"),
    # DeepEP's own kernels have not been run into results/ yet (the two-GPU issue runs them in the
    # benchmark itself); until then the model prices them from DeepEP v1.2.1's
    # tests/test_intranode.py as run on this project's 2xH200 machine.
    "deepep_us.dispatch": Assumption("DeepEP v1.2.1 intranode BF16 dispatch, 2 ranks, 4096 tokens, hidden 7168, "
                                     "top-8, 256 experts, 24 SMs", 353.0, "us",
                                     "DeepEP v1.2.1's tests/test_intranode.py on this project's 2xH200 machine, "
                                     "2026-11-30, read off its output; not a results/ figure"),
    "deepep_us.combine": Assumption("DeepEP v1.2.1 intranode combine, same run", 393.0, "us",
                                    "the same DeepEP test run, as above"),
    "hbm_tbs.H100": Assumption("HBM bandwidth, H100 SXM", gpus.model("H100").hbm_tbs, "TB/s", "NVIDIA H100 datasheet"),
    "hbm_tbs.B200": Assumption("HBM bandwidth, B200", gpus.model("B200").hbm_tbs, "TB/s", "NVIDIA B200 datasheet"),
    "nic_gbps": Assumption("network per GPU (one CX7 400 Gb/s NIC per GPU)", 50.0, "GB/s",
                           "issue 12 (8 x 400 Gb/s CX7 per Nebius B200 node)"),
    "network_efficiency": Assumption(
        "achieved share of the NIC line rate, every backend", 43.0 / 50.0, "",
        "DeepEP V1 internode, 43 GB/s RDMA at EP16 on CX7 (DeepEP's README, deepseek-ai/DeepEP); no multi-node run here yet",
        low=35.0 / 50.0, high=0.95,
        range_source="low: 35 GB/s, issue 34 item 4's plausible figure for an all-to-all of 32 ranks over 4 "
                     "nodes; high: InfiniBand NDR's 400 Gb/s less its headers (4 KiB MTU) and completion "
                     "signalling. The published EP 32 figures (DeepEP V1 58, V2 61, Hybrid-EP 55-58, UCCL-EP "
                     "53-57 GB/s: each project's own README or paper) exceed the 50 GB/s line rate: they count bytes the NIC does not "
                     "carry, so they bound nothing"),
    "peak_share": Assumption(
        "another GPU (B200) reaches the measured GPU's (H200's) share of its datasheet peaks, times this",
        1.0, "", "assumption: no B200 was measured here (moe_comm.predict.layer_compute)",
        low=0.85, high=1.0,
        range_source="low: issue 34 item 4 (a new GPU's kernels at 85% of the H200's share); high: the same "
                     "share (nothing measured suggests more)"),

    "sm_push_gbps": Assumption("NVLink stores one 1024-thread SM sustains", 142.0 / 4, "GB/s",
                               "a probe of SM-driven stores to the peer on this project's 2xH200 machine, 2026-11: 4 SMs "
                               "-> 142 GB/s; not a results/ figure"),
    "nccl_nvlink_gbps_h200": Assumption("NCCL all_to_all_single, bytes crossing NVLink per GPU (H200)", 290.0,
                                        "GB/s", "a probe of NCCL 2.28.9 all_to_all_single on this project's 2xH200 machine, "
                                        "2026-11: 4096x8 rows x 7168 bf16 in 0.81 ms; not a results/ figure"),
    "deepep_permute_us_per_row": Assumption("TorchTitan's DeepEP path: _permute_tokens per expert row (H200)",
                                            614.0 / 32740, "us", "a profile on one H200, 2026-11: 614 us at 32,740 expert "
                                            "rows; not a results/ figure"),
    "deepep_unpermute_us_per_row": Assumption("TorchTitan's DeepEP path: scores x + _unpermute_tokens per expert row",
                                              1500.0 / 32740, "us", "the same profile: 1,500 us at 32,740 expert rows; not a "
                                              "results/ figure"),
    "fsdp_prefetch_units": Assumption("FSDP units whose collectives are not hidden (first all-gather, last "
                                      "reduce-scatter)", 1.0, "units", "TorchTitan FSDP2 prefetch (assumption)"),
}
