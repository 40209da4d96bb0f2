"""Names of the logged metrics: one place, shared by the processor, `report` and `dashboard`.

TorchTitan's own keys are kept as TorchTitan spells them. Ours live under "moe_comm/" so they
form one section in W&B. All times and byte counts are per training step on the logging rank,
summed over every MoE layer (averaged over the steps since the previous log line).
"""

# The per-step file in a run's dump folder (job.dump_folder): one JSON object per logged step.
JSONL_NAME = "metrics.jsonl"

# TorchTitan 0.2.2 (torchtitan/components/metrics.py, MetricsProcessor.log)
LOSS = "loss_metrics/global_avg_loss"
GRAD_NORM = "grad_norm"  # total norm of the gradients before clipping ([training] max_norm)
TPS = "throughput(tps)"  # tokens/s per GPU
TFLOPS = "tflops"
MFU = "mfu(%)"  # against the peak chosen by moe_comm.metrics.peaks (8-bit peak under fp8)
STEP_TIME_TT = "time_metrics/end_to_end(s)"
MEM_RESERVED = "memory/max_reserved(GiB)"
MEM_ACTIVE = "memory/max_active(GiB)"

# Ours
PREFIX = "moe_comm/"
DISPATCH_MS = PREFIX + "dispatch_ms"  # forward dispatch + its backward
COMBINE_MS = PREFIX + "combine_ms"  # forward combine + its backward
DISPATCH_FWD_MS = PREFIX + "dispatch_fwd_ms"
DISPATCH_BWD_MS = PREFIX + "dispatch_bwd_ms"
COMBINE_FWD_MS = PREFIX + "combine_fwd_ms"
COMBINE_BWD_MS = PREFIX + "combine_bwd_ms"
COMM_MS = PREFIX + "comm_ms"  # dispatch_ms + combine_ms: time inside comm, on the stream it runs on
# Exposed: time the compute stream spent in (no overlap) or waiting for (overlap) MoE comm.
DISPATCH_EXPOSED_MS = PREFIX + "dispatch_exposed_ms"
COMBINE_EXPOSED_MS = PREFIX + "combine_exposed_ms"
COMM_EXPOSED_MS = PREFIX + "comm_exposed_ms"  # dispatch_exposed_ms + combine_exposed_ms
COMM_HIDDEN_PCT = PREFIX + "comm_hidden(%)"  # 100 * (1 - comm_exposed_ms / comm_ms), under overlap only
STEP_MS = PREFIX + "step_ms"  # wall time per step between log lines
COMM_EXPOSED_PCT = PREFIX + "comm_exposed(%)"  # 100 * comm_exposed_ms / step_ms
IMBALANCE_RANK = PREFIX + "imbalance_rank"  # max/mean routed rows per EP rank, mean over layers
IMBALANCE_RANK_WORST = PREFIX + "imbalance_rank_worst"  # ... worst layer
IMBALANCE_EXPERT = PREFIX + "imbalance_expert"  # max/mean routed rows per expert, mean over layers
IMBALANCE_EXPERT_WORST = PREFIX + "imbalance_expert_worst"
DISPATCH_GB = PREFIX + "dispatch_GB"  # bytes leaving this rank for other ranks, dispatch fwd+bwd
COMBINE_GB = PREFIX + "combine_GB"
SENT_GB = PREFIX + "sent_GB"  # dispatch_GB + combine_GB
COMM_BW = PREFIX + "comm_GBps"  # sent_GB / comm time: bandwidth as the compute stream sees it
PEAK_TFLOPS = PREFIX + "peak_tflops"  # the peak mfu(%) divides by
MFU_BF16 = PREFIX + "mfu_bf16_peak(%)"  # against the bf16 peak (differs from mfu(%) under fp8)

# Static fields written on every JSONL line (W&B gets them as config, name and tags).
BACKEND = "backend"
BACKEND_OPTIONS = "backend_options"
RECIPE = "recipe"
DEVICE = "device"
PEAK_DTYPE = "peak_dtype"
EP_SIZE = "ep_size"
WORLD_SIZE = "world_size"
LOCAL_BATCH = "local_batch_size"
SEQ_LEN = "seq_len"
SENDS_PER = "sends_once_per"  # "expert" (all-to-all) or "rank" (dedup); how bytes are counted
# Only on runs whose comm ran over an emulated network link (moe_comm.kernels.emulated_link): its
# per-call times and setting. Such a run's comm times are the emulation's, not a network's.
EMULATED_LINK = "emulated_link"
