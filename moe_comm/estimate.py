"""Closed-form estimates for a DeepSeek-V3 recipe: parameters, flops per token, per-GPU memory
and per-step dispatch/combine volume. Shared by `python -m moe_comm check` and the scale model.

Parameters and flops follow TorchTitan's own accounting (`get_moe_model_nparams_and_flops`):
flops/token = 6 x (active params - embedding) + 6 x layers x heads x (qk_nope + qk_rope + v) x seq,
where active params count the router, the shared experts and top_k / num_experts of the routed
experts; tests check both against TorchTitan on a meta-device model.

Memory (per GPU, bytes) is written down term by term so it can be argued with:
  * model states: 16 bytes per parameter (fp32 params 4 + fp32 grads 4 + AdamW moments 8),
    divided by the sharding degree. FSDP shards the dense part over dp_shard x cp and TP over
    tp; the routed experts over ep x efsdp (= dp_shard x cp x tp, the same total); PP keeps
    1/pp of the layers per rank. HSDP's dp_replicate does not shard.
  * FSDP working set: the bf16 parameters of the two largest transformer blocks unsharded at
    once (current + prefetched), divided by tp.
  * activations, per token per layer, in bf16 (2 bytes) unless noted; see `_act_bytes_per_token`.
    No AC keeps every layer's activations; "selective" keeps about half (TorchTitan's op SAC
    keeps matmul and attention outputs); "full" keeps each layer's input (dim x 2 bytes) plus
    one layer recomputed at a time. With PP, 1F1B keeps min(microbatches, pp) microbatches in
    flight on the first stage. The logits (tokens x vocab, fp32 for the loss, plus the bf16
    output) sit on the last stage.
Check the estimate against measured points (NOTES §1): 16B on 2 H200s at batch 1 x 4096 with
full AC measured 127 GB; the 671B-shaped layers at 4 x 4096 without AC measured 137 GB.
"""

import math
from dataclasses import dataclass

GiB = 1024**3


@dataclass
class ParamCounts:
    total: int
    active: int  # per token: dense + router + shared + top_k/num_experts of the routed experts
    embedding: int  # tok_embeddings only (TorchTitan excludes it from flops, not the output)
    routed_experts: int
    per_block_max: int  # the largest transformer block, for the FSDP working set

    def flops_per_token(self, args, seq_len: int) -> int:
        head_dims = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
        return 6 * (self.active - self.embedding) + 6 * args.n_layers * args.n_heads * head_dims * seq_len


def _attention_params(a) -> int:
    qk_head = a.qk_nope_head_dim + a.qk_rope_head_dim
    if a.q_lora_rank == 0:
        q = a.dim * a.n_heads * qk_head
    else:
        q = a.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.n_heads * qk_head
    kv = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    kv += a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
    wo = a.n_heads * a.v_head_dim * a.dim
    return q + kv + wo


def count_params(a) -> ParamCounts:
    """Parameters of a DeepSeekV3ModelArgs flavor, counted like TorchTitan counts them."""
    m = a.moe_args
    embedding = a.vocab_size * a.dim
    output = a.dim * a.vocab_size + a.dim  # output projection + final norm
    block_common = _attention_params(a) + 2 * a.dim  # attention + attention_norm + ffn_norm
    dense_block = block_common + 3 * a.dim * a.inter_dim
    routed = 3 * m.num_experts * a.dim * a.moe_inter_dim
    shared = 3 * a.dim * a.moe_inter_dim * m.num_shared_experts
    router = a.dim * m.num_experts + (m.num_experts if m.gate_bias else 0)
    moe_block = block_common + routed + shared + router
    n_moe = a.n_layers - a.n_dense_layers
    total = embedding + output + a.n_dense_layers * dense_block + n_moe * moe_block
    active = total - n_moe * routed + n_moe * (routed * m.top_k // m.num_experts)
    return ParamCounts(
        total=total,
        active=active,
        embedding=embedding,
        routed_experts=n_moe * routed,
        per_block_max=max(dense_block if a.n_dense_layers else 0, moe_block if n_moe else 0),
    )


@dataclass
class Layout:
    """The resolved parallel layout (TorchTitan's ParallelDims degrees) and its process count."""

    world: int
    nodes: int
    procs_per_node: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    etp: int

    @property
    def efsdp(self) -> int:
        return self.dp_shard * self.cp * self.tp // (self.etp * self.ep)


def _act_bytes_per_token(a, moe_layer: bool) -> float:
    """Activation bytes one token leaves in one layer without AC (bf16 unless noted).

    Attention (MLA): norm input and output, the q/kv low-rank paths, q, k, v, the attention
    output and wo's input: 4 dim + q_lora + kv_lora + rope + 3 heads (qk_head) + 3 heads v.
    Dense FFN: norm in/out + w1, w3 outputs and their product: 2 dim + 3 inter.
    MoE: the gathered, received and permuted rows and the combine input (4 x top_k x dim), the
    experts' w1/w3 outputs and product (3 x top_k x moe_inter), the shared experts' likewise,
    and fp32 router scores (4 bytes x experts)."""
    qk_head = a.qk_nope_head_dim + a.qk_rope_head_dim
    attn = 4 * a.dim + a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim
    attn += 3 * a.n_heads * qk_head + 3 * a.n_heads * a.v_head_dim
    if not moe_layer:
        return 2 * (attn + 2 * a.dim + 3 * a.inter_dim)
    m = a.moe_args
    moe = 2 * a.dim + 4 * m.top_k * a.dim + 3 * m.top_k * a.moe_inter_dim
    moe += 3 * m.num_shared_experts * a.moe_inter_dim
    return 2 * (attn + moe) + 4 * m.num_experts


@dataclass
class MemoryEstimate:
    model_states: float
    fsdp_working_set: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.model_states + self.fsdp_working_set + self.activations + self.logits


def memory_per_gpu(
    a, layout: Layout, local_batch: int, seq_len: int, ac_mode: str, microbatch: int = 1
) -> MemoryEstimate:
    p = count_params(a)
    shard = layout.dp_shard * layout.cp * layout.tp * layout.pp
    model_states = 16 * p.total / shard
    fsdp_working_set = 2 * 2 * p.per_block_max / layout.tp / (layout.ep if layout.ep > 1 else 1)
    # with EP the routed experts of a block are already split over ep; count the dense part whole
    if layout.ep > 1:
        dense_part = p.per_block_max - 3 * a.moe_args.num_experts * a.dim * a.moe_inter_dim
        fsdp_working_set = 2 * 2 * (dense_part + (p.per_block_max - dense_part) / layout.ep) / layout.tp

    layers_per_stage = math.ceil(a.n_layers / layout.pp)
    n_moe = a.n_layers - a.n_dense_layers
    moe_share = n_moe / a.n_layers
    per_token_layer = moe_share * _act_bytes_per_token(a, True) + (1 - moe_share) * _act_bytes_per_token(a, False)
    per_token_layer /= layout.tp * layout.cp
    if layout.pp > 1:
        in_flight = min(local_batch // microbatch, layout.pp)
        tokens = in_flight * microbatch * seq_len
        tokens_one_mb = microbatch * seq_len
    else:
        tokens = tokens_one_mb = local_batch * seq_len
    if ac_mode == "full":
        activations = tokens * layers_per_stage * 2 * a.dim / (layout.tp * layout.cp) + tokens_one_mb * per_token_layer
    elif ac_mode == "selective":
        activations = 0.5 * tokens * layers_per_stage * per_token_layer
    else:
        activations = tokens * layers_per_stage * per_token_layer
    logits = tokens_one_mb * a.vocab_size * (4 + 2) / (layout.tp * layout.cp)
    return MemoryEstimate(model_states, fsdp_working_set, activations, logits)


@dataclass
class CommVolume:
    rows_per_layer: int  # (token, expert) rows one rank sends per MoE layer, forward dispatch
    remote_fraction: float  # share of them going to other EP ranks (uniform routing)
    dedup_rows_per_layer: float  # rows if each token goes once to each rank it needs
    bytes_per_step: float  # dispatch + combine, forward + backward, all MoE layers, one rank


def comm_volume(a, layout: Layout, local_batch: int, seq_len: int, bytes_per_elem: int = 2) -> CommVolume:
    """Per-rank MoE traffic per training step under uniform routing.

    Forward: dispatch sends tokens x top_k rows of dim elements, combine brings as many back;
    backward repeats both in the other direction, so a step moves 4 x rows x dim x bytes per
    MoE layer of which (ep-1)/ep crosses to other ranks. A per-rank dedup (DeepEP, ours) sends
    a token once per rank that holds any of its experts: 1 - C(E - E/ep, K) / C(E, K) per rank.
    With PP only this rank's stage's MoE layers count."""
    m = a.moe_args
    tokens = local_batch * seq_len // (layout.cp * layout.tp)
    rows = tokens * m.top_k
    ep = max(layout.ep, 1)
    remote = (ep - 1) / ep
    per_rank = m.num_experts // ep
    p_rank = 1 - math.comb(m.num_experts - per_rank, m.top_k) / math.comb(m.num_experts, m.top_k)
    dedup = tokens * p_rank * (ep - 1)
    moe_layers = math.ceil((a.n_layers - a.n_dense_layers) / layout.pp)
    bytes_per_step = 4 * rows * remote * a.dim * bytes_per_elem * moe_layers
    return CommVolume(rows, remote, dedup, bytes_per_step)
