"""Closed-form estimates for a DeepSeek-V3 recipe: parameters, flops per token and per-GPU
memory. Shared by `python -m moe_comm check` and the scale model (moe_comm.predict.scale_model prices
the dispatch/combine traffic, from moe_comm.predict.routing_plan's row counts).

Parameters and flops follow TorchTitan's own accounting (`get_moe_model_nparams_and_flops`):
flops/token = 6 x (active params - embedding) + 6 x layers x heads x (qk_nope + qk_rope + v) x seq,
where active params count the router, the shared experts and top_k / num_experts of the routed
experts; tests check both against TorchTitan on a meta-device model.

Memory (per GPU, bytes) is written down term by term so it can be argued with:
  * fp32 params and AdamW moments, 12 bytes per parameter, and fp32 gradients, 4 more, divided
    by the sharding degree. FSDP shards the dense part over dp_shard x cp and TP over tp; the
    routed experts over ep x efsdp (= dp_shard x cp x tp, the same total); PP keeps 1/pp of the
    layers per rank. HSDP's dp_replicate does not shard.
  * FSDP working set: the bf16 parameters of two units unsharded at once (current + prefetched);
    with EP a unit holds its block's dense part whole and 1/ep of its routed experts, over tp.
    The largest unit's unsharded gradients (bf16, and the fp32 copy reduce-scattered) exist
    transiently in the backward pass.
  * activations, per token per layer, in bf16 (2 bytes) unless noted; see `_act_bytes_per_token`.
    No AC keeps every layer's activations; "selective" keeps about half (TorchTitan's op SAC
    keeps matmul and attention outputs); "full" keeps each layer's input (dim x 2 bytes) plus
    one layer recomputed at a time. With PP, the schedule decides how many microbatch-stages a
    rank holds (moe_comm.predict.schedule: 1F1B min(microbatches, pp) on the first rank, an
    interleaved schedule more, the zero-bubble ones until each weight gradient ran), and the
    stage split which layers a rank has; the estimate is the pipeline rank that holds the most.
    The logits (one microbatch's tokens x vocab, fp32 for the loss, plus the bf16 output) sit
    on the rank with the last stage; with the loss compiled ([compile] components "loss") the
    bf16 output alone, which the compiled loss saves for its backward instead of the eager
    loss's fp32 log-probabilities (`logits_bytes`).
  * with PP, TorchTitan does not reshard a stage's parameters after the forward and torch's
    pipeline accumulates unsharded fp32 gradients over the microbatches: every block of the
    rank is unsharded in bf16, with an fp32 gradient, for the whole step.
  * without PP, activations and gradients never peak together (`MemoryEstimate`): the peak in
    use is the end of the forward pass or the end of the backward pass, whichever is larger, and the
    caching allocator reserves more than that (ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM, and a
    smaller figure without fully_shard).
  * without fully_shard (`fsdp_applied`: dp_shard x cp = 1 and EP 1, e.g. one GPU) there is no
    working set and no gradient reduce: TorchTitan trains under torch.autocast instead
    (`autocast`), with fp32 parameters. Autocast keeps a bf16 copy of every weight it casts until
    the weight's backward (its cast cache, and the grouped GEMM's explicit casts saved for
    backward; the embedding is not cast, and under AC the experts' casts are recomputed), and the
    residual stream stays fp32 (`_autocast_extra_bytes_per_token`). With TP or PP but no
    fully_shard TorchTitan turns mixed precision off: activations in fp32.
Checked against every measured memory figure, the 2xH200 runs (results/h200x2) and the one-GPU
recipe's (results/h200x1: world 1, autocast, each AC mode): results/scale_model.md's memory rows
give the estimate's error on each.
"""

from dataclasses import dataclass

from moe_comm.layout import Layout
from moe_comm.predict import schedule
from moe_comm.predict.schedule import Pipeline

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


def expert_params(a, experts):
    """Parameters of `experts` experts of flavor `a`, each w1 and w3 (dim -> moe_inter_dim) and w2
    (back): a layer's routed or shared experts, or a rank's share of them (a fraction is kept)."""
    return 3 * experts * a.dim * a.moe_inter_dim


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
    routed = expert_params(a, m.num_experts)
    shared = expert_params(a, m.num_shared_experts)
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


def fsdp_applied(layout: Layout) -> bool:
    """Whether TorchTitan wraps the model in fully_shard: deepseek_v3's parallelize does when
    FSDP or CP shard (dp_shard x cp > 1) or EP borrows from them (ep > 1)."""
    return layout.dp_shard * layout.cp > 1 or layout.ep > 1


def autocast(layout: Layout) -> bool:
    """Whether TorchTitan trains under torch.autocast (maybe_enable_amp: without fully_shard, and
    with neither TP nor PP, where it turns mixed precision off)."""
    return not fsdp_applied(layout) and layout.tp == 1 and layout.pp == 1


def _autocast_extra_bytes_per_token(a, moe_layer: bool) -> float:
    """What autocast adds to `_act_bytes_per_token` in one layer: the residual stream is fp32
    (the embedding's output, and every residual add of a bf16 output to it), so both norms save
    fp32 inputs (+2 B x dim each), and each norm's output is cast to bf16 by every linear that
    reads it, each cast saved for that linear's backward: attention's wq_a and wkv_a (one copy
    more than counted), the MoE's router gate and shared experts' w1 and w3 (two more; the
    dispatch's copy is the counted one), the dense FFN's w1 and w3 (one more)."""
    return 2 * 2 * a.dim + 2 * a.dim * (1 + (2 if moe_layer else 1))


# The caching allocator keeps what it freed: torch's max_reserved exceeds the peak in use by
# about this many bytes per parameter of the output projection (vocab x dim / tp). Fitted by
# moe_comm.predict.validation.fit_allocator_cache over the 2xH200 memory figures of
# results/model_inputs/scale_model_validation.json (10 runs: the 671B-shaped layers bf16 and float8, 16B);
# tests/test_scale_model.py fails if the fit moves away from it. Vocabulary-sized buffers
# (logits in fp32 and bf16 and their gradients, the unsharded embedding and output and their
# fp32 gradients) are a step's largest transient blocks and leave the cache fragmented; the
# term is an empirical fit, not a mechanism.
ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM = 41.0
# ... and without fully_shard (one GPU: autocast), where no unsharded embedding, output or their
# gradients pass through the cache: fitted over the one-H200 recipe's run 27 (no AC, with and
# without the MoE calls' CUDA graphs). The 2xH200 figure above overestimated the one-GPU runs'
# reserved memory by 21-28% (results/scale_model.md, before session 22).
ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM_UNSHARDED = 4.4


@dataclass
class MemoryEstimate:
    """Per-GPU bytes at the two moments a step peaks, and what the allocator keeps beyond that.

    At the end of the forward pass every activation is alive but no gradient exists yet
    (TorchTitan zeroes gradients to None); by the end of the backward pass the activations are
    gone and the sharded gradients all exist. Between the two the sum moves linearly, so the
    peak in use is the larger end (both measured on 2xH200: the 671B-shaped layers without AC
    peak at the first, 16B with full AC at the second)."""

    params_and_optimizer: float  # fp32 params + AdamW moments, 12 B/param, sharded
    gradients: float  # fp32 sharded gradients, 4 B/param
    fsdp_working_set: float  # bf16 params unsharded: two units, or with PP all the rank's (0 without fully_shard)
    grad_reduce: float  # unsharded gradients: the largest unit's bf16 + fp32, or with PP all the rank's fp32
    activations: float
    weight_copies: float  # autocast's bf16 copies of the weights, held to their backward (0 under fully_shard)
    logits: float
    allocator_cache: float  # reserved beyond the peak in use (ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM*)
    pipelined: bool = False  # PP: gradients accumulate while microbatches are in flight
    microbatches_in_flight: float = 1.0  # whole-rank microbatches whose activations are held at the peak
    stages_per_rank: int = 1
    # what activation checkpointing keeps of each MoE layer's dispatch and combine so that its
    # recompute re-runs neither (comm_kept_bytes), for every MoE layer-microbatch in flight
    comm_kept: float = 0.0
    # the memory pools of the MoE calls' CUDA graphs (call_graph_bytes), held for the whole step
    call_graphs: float = 0.0
    # the FP8 experts' e4m3 weights, kept over the step where the run caches them
    # (moe_comm.fp8_experts.caches_weights, WeightCache): the forward's copies from the step's first
    # forward (or the last optimizer step, for whole weights), dgrad's transposed copies (as many
    # bytes) from its first backward (or with the forward's) to the next step's first forward
    fp8_weights: float = 0.0
    # of those (or, in a run that does not cache, what each MoE layer's forward saves for its
    # backward, which transposes them), the forward's copies: held at the forward's end
    fp8_forward_weights: float = 0.0

    @property
    def forward_end(self) -> float:
        """The most activations alive; with PP, the accumulating gradients are there too (the
        first microbatch's backward precedes the last one's forward), and so are the FP8
        experts' transposed copies; without PP only their forward copies are."""
        held = (self.params_and_optimizer + self.fsdp_working_set + self.weight_copies + self.activations
                + self.comm_kept + self.logits + self.call_graphs)
        if self.pipelined:
            return held + self.grad_reduce + max(self.fp8_weights, self.fp8_forward_weights)
        return held + self.fp8_forward_weights

    @property
    def backward_end(self) -> float:
        return (self.params_and_optimizer + self.gradients + self.fsdp_working_set + self.grad_reduce
                + self.call_graphs + self.fp8_weights)

    @property
    def total(self) -> float:
        """The peak in use (torch.cuda max_allocated / TorchTitan's memory/max_active)."""
        return max(self.forward_end, self.backward_end)

    @property
    def peak_at(self) -> str:
        return "end of forward" if self.forward_end >= self.backward_end else "end of backward"

    @property
    def reserved(self) -> float:
        """What torch's caching allocator reserves (TorchTitan's memory/max_reserved)."""
        return self.total + self.allocator_cache


def _block_unit(a, layout: Layout, layer: int) -> float:
    """Parameters of one block on this rank as FSDP unshards them: the routed experts split over
    ep, the rest whole (FSDP all-gathers it), both over tp."""
    if layer < a.n_dense_layers:
        return _dense_block_params(a) / layout.tp
    routed = expert_params(a, a.moe_args.num_experts)
    return (_moe_block_params(a) - routed + routed / max(layout.ep, 1)) / layout.tp


def _dense_block_params(a) -> int:
    return _attention_params(a) + 2 * a.dim + 3 * a.dim * a.inter_dim


def _moe_block_params(a) -> int:
    m = a.moe_args
    routed = expert_params(a, m.num_experts)
    shared = expert_params(a, m.num_shared_experts)
    router = a.dim * m.num_experts + (m.num_experts if m.gate_bias else 0)
    return _attention_params(a) + 2 * a.dim + routed + shared + router


@dataclass(frozen=True)
class PipelineRank:
    """One pipeline-parallel rank: its layers, and whether it holds the embedding and the
    output (moe_comm.predict.schedule's stage split)."""

    pipe: Pipeline
    rank: int
    layers: tuple[int, ...]
    embedding: bool
    output: bool


def pipeline_ranks(a, layout: Layout, local_batch: int, microbatch: int, pp_schedule: str,
                   layers_per_stage: int | None = None) -> list[PipelineRank]:
    """Every pipeline rank's stages, as TorchTitan builds them (raises ValueError where it or
    torch would refuse the schedule)."""
    if layout.pp == 1:
        return [PipelineRank(Pipeline("1F1B", 1, 1, 1), 0, tuple(range(a.n_layers)), True, True)]
    v = schedule.stages_per_rank(pp_schedule, layout.pp, a.n_layers, layers_per_stage)
    pipe = Pipeline(schedule.canonical(pp_schedule), layout.pp, local_batch // microbatch, v)
    pipe.validate()
    split = schedule.stage_layers(a.n_layers, layout.pp * v)
    ranks = []
    for r in range(layout.pp):
        stages = schedule.rank_stages(pipe.name, layout.pp, v, r)
        ranks.append(PipelineRank(pipe, r, tuple(i for s in stages for i in split[s]), 0 in stages,
                                  layout.pp * v - 1 in stages))
    return ranks


def memory_per_gpu(
    a, layout: Layout, local_batch: int, seq_len: int, ac_mode: str, microbatch: int = 1,
    pp_schedule: str = "1F1B", layers_per_stage: int | None = None, *, comm_kept_per_layer: float = 0.0,
    extra_chunks: int = 0, call_graphs_per_layer: float = 0.0, fp8_weights_per_layer: float = 0.0,
    fp8_forward_weights_per_layer: float = 0.0, loss_compiled: bool = False,
) -> MemoryEstimate:
    """Per-GPU memory; with PP, of the pipeline rank that holds the most. `comm_kept_per_layer`:
    the bytes activation checkpointing keeps per MoE layer and microbatch so that its recompute
    re-runs no communication (comm_kept_bytes, for the run's backend; 0 where the recompute
    re-runs it, as TorchTitan's own does); `extra_chunks`: microbatch-stages a schedule holds
    beyond its own (the microbatch overlap's one more warmup forward); `call_graphs_per_layer`: the
    MoE calls' CUDA graph pools per MoE layer (call_graph_bytes, for a backend that graphs them);
    `fp8_weights_per_layer`: what the FP8 experts keep of their e4m3 weights per MoE layer over the
    step (moe_comm.fp8_experts.cached_weight_bytes, where the run caches them);
    `fp8_forward_weights_per_layer`: the forward's copies among them, or what a run that does not
    cache saves from each layer's forward to its backward (forward_weight_bytes); `loss_compiled`:
    TorchTitan compiles the loss (logits_bytes)."""
    if layout.pp > 1:
        ranks = pipeline_ranks(a, layout, local_batch, microbatch, pp_schedule, layers_per_stage)
        return max((_memory(a, layout, local_batch, seq_len, ac_mode, microbatch, r, comm_kept_per_layer,
                            extra_chunks, call_graphs_per_layer, fp8_weights_per_layer, fp8_forward_weights_per_layer,
                            loss_compiled)
                    for r in ranks), key=lambda mem: mem.total)
    return _memory(a, layout, local_batch, seq_len, ac_mode, microbatch, None, comm_kept_per_layer,
                   call_graphs_per_layer=call_graphs_per_layer, fp8_weights_per_layer=fp8_weights_per_layer,
                   fp8_forward_weights_per_layer=fp8_forward_weights_per_layer, loss_compiled=loss_compiled)


def _memory(a, layout: Layout, local_batch: int, seq_len: int, ac_mode: str, microbatch: int,
            rank: PipelineRank | None, comm_kept_per_layer: float = 0.0, extra_chunks: int = 0,
            call_graphs_per_layer: float = 0.0, fp8_weights_per_layer: float = 0.0,
            fp8_forward_weights_per_layer: float = 0.0, loss_compiled: bool = False) -> MemoryEstimate:
    p = count_params(a)
    shard = layout.dp_shard * layout.cp * layout.tp * layout.pp
    routed_per_block = expert_params(a, a.moe_args.num_experts)
    # a block's share on this rank: the routed experts split over ep, the rest whole (FSDP
    # all-gathers it), both over tp
    if p.per_block_max > routed_per_block and a.n_layers > a.n_dense_layers:
        dense_part = p.per_block_max - routed_per_block
        unit = (dense_part + routed_per_block / max(layout.ep, 1)) / layout.tp
    else:
        unit = p.per_block_max / layout.tp
    cp_tp = layout.tp * layout.cp
    sharded = fsdp_applied(layout)
    if rank is None:
        fsdp_working_set = 2 * 2 * unit
        grad_reduce = (2 + 4) * unit
        layers = range(a.n_layers)
        tokens = tokens_one_mb = local_batch * seq_len
        in_flight = 1.0
    else:
        # TorchTitan keeps a pipelined stage's parameters unsharded from its first forward to
        # the step's end (reshard_after_forward = not pp_enabled) and torch's pipeline runs
        # every microbatch's backward but the last without gradient sync, so FSDP accumulates
        # each parameter's unsharded gradient in fp32 until the stage's REDUCE_GRAD: both for
        # all the rank's blocks (and its embedding / output), alive while microbatches are
        # in flight
        held = rank_unsharded_params(a, layout, rank)
        fsdp_working_set = 2 * held
        grad_reduce = 4 * held
        layers = rank.layers
        tokens_one_mb = microbatch * seq_len
        in_flight = rank.pipe.microbatches_in_flight(rank.rank) + extra_chunks / rank.pipe.v
        tokens = in_flight * tokens_one_mb
    amp = autocast(layout)
    weight_copies = 0.0
    act_scale, layer_input = (1.0, 2) if sharded or amp else (2.0, 4)  # no mixed precision: fp32 activations
    if not sharded:  # no fully_shard: no unsharded copies to gather, no gradient reduce
        fsdp_working_set = grad_reduce = 0.0
        if amp:  # autocast's bf16 weight copies (the experts' only without AC: under AC they are recomputed)
            routed = expert_params(a, a.moe_args.num_experts) * sum(1 for i in layers if i >= a.n_dense_layers)
            weight_copies = 2 * (p.total - p.embedding - (routed if ac_mode != "none" else 0))
            layer_input = 4  # the residual stream is fp32
    per_token = [act_scale * (_act_bytes_per_token(a, i >= a.n_dense_layers)
                              + (_autocast_extra_bytes_per_token(a, i >= a.n_dense_layers) if amp else 0.0)) / cp_tp
                 for i in layers]
    if ac_mode == "full":
        activations = tokens * len(per_token) * layer_input * a.dim / cp_tp + tokens_one_mb * max(per_token, default=0.0)
    elif ac_mode == "selective":
        activations = 0.5 * tokens * sum(per_token)
    else:
        activations = tokens * sum(per_token)
    # without AC the kept outputs are the layer's activations, counted above
    moe_layers = sum(1 for i in layers if i >= a.n_dense_layers)
    comm_kept = comm_kept_per_layer * moe_layers * in_flight if ac_mode != "none" else 0.0
    on_last = rank is None or rank.output
    logits = tokens_one_mb * a.vocab_size * logits_bytes(loss_compiled) / cp_tp if on_last else 0.0
    per_param = ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM if sharded else ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM_UNSHARDED
    cache = per_param * a.vocab_size * a.dim / layout.tp
    return MemoryEstimate(
        params_and_optimizer=12 * p.total / shard, gradients=4 * p.total / shard,
        fsdp_working_set=fsdp_working_set, grad_reduce=grad_reduce, activations=activations,
        weight_copies=weight_copies, logits=logits, allocator_cache=cache, pipelined=rank is not None,
        microbatches_in_flight=in_flight, stages_per_rank=rank.pipe.v if rank else 1, comm_kept=comm_kept,
        call_graphs=call_graphs_per_layer * moe_layers, fp8_weights=fp8_weights_per_layer * moe_layers,
        fp8_forward_weights=fp8_forward_weights_per_layer * moe_layers,
    )


# ---------------------------------------------------------- what the step model prices per step


def rank_unsharded_params(a, layout: Layout, rank: PipelineRank | None) -> float:
    """Parameters of a rank's FSDP units as fully_shard all-gathers them (every layer without PP):
    each block's routed experts over ep and the rest whole, the embedding and output projection
    where the rank holds them, all over tp."""
    layers = rank.layers if rank else range(a.n_layers)
    outer = (int(rank.embedding) + int(rank.output)) if rank else 2
    return sum(_block_unit(a, layout, i) for i in layers) + outer * a.vocab_size * a.dim / layout.tp


def logits_bytes(loss_compiled: bool) -> int:
    """Bytes per logit the last stage holds at the end of its forward: the output projection's
    bf16 logits (2), and under TorchTitan's eager loss their fp32 log-probabilities, which
    cross-entropy saves for its backward (4). TorchTitan's compiled loss saves the bf16 logits
    alone and recomputes the softmax in its backward (its saved tensors, traced on CPU: one bf16
    tensor of the logits' shape, against one fp32 one eager; tests/test_estimate.py)."""
    return 2 if loss_compiled else 2 + 4


def param_copy_bytes(a, layout: Layout, rank: PipelineRank | None, microbatches: int) -> float:
    """HBM bytes per step of the parameter- and gradient-sized copies no layer part times, on the
    rank holding `rank`'s layers (None: every layer, no PP):
      * under fully_shard without PP, per parameter of the rank's units: the all-gather's copy-out
        (read + write bf16) in the forward and again in the backward (TorchTitan reshards after
        forward), and the bf16 gradient cast to the fp32 reduce dtype into the reduce-scatter's
        input: 4 + 4 + 6 = 14 B;
      * under fully_shard with PP: one all-gather copy-out (4 B), the first microbatch's gradient
        cast to fp32 (6 B), every later microbatch's fp32 += bf16 accumulation (10 B each;
        FSDP2's unsharded_accumulated_grad while torch's pipeline skips the gradient sync) and the
        reduce-scatter's input copy of the fp32 sum (8 B);
      * under autocast (one GPU): every weight but the embedding cast to bf16 in the forward
        (read fp32, write bf16) and its gradient cast back in the backward: 12 B;
      * without mixed precision: none."""
    if fsdp_applied(layout):
        held = rank_unsharded_params(a, layout, rank)
        if layout.pp > 1:
            return held * (4 + 6 + 10 * max(microbatches - 1, 0) + 8)
        return held * (4 + 4 + 6)
    if autocast(layout):
        p = count_params(a)
        return 12 * (p.total - p.embedding)
    return 0.0


def chunked_expert_bytes(a, layout: Layout) -> tuple[float, float]:
    """(forward, backward) bytes the chunked overlap adds per MoE layer and microbatch. Each
    chunk runs the rank's routed experts with the same weights (TokenLevelExperts.forward_chunks),
    so autograd adds the second chunk's weight gradient to the first's: read two, write one, in
    the gradient's dtype - bf16 under fully_shard's mixed precision, fp32 otherwise. Under
    autocast (one GPU) each call also casts the fp32 weights to bf16 again (read 4 + write 2 B)
    and its gradient back (6 B). Measured on one H200 (results/h200x1/README.md, run 20: the
    one-GPU recipe's profiled step, chunked against none), which records what these adds, casts
    and copies took and what these bytes take at the model's HBM rate."""
    local = expert_params(a, a.moe_args.num_experts / layout.ep)
    if fsdp_applied(layout):
        return 0.0, local * 3 * 2
    if autocast(layout):
        return local * 6, local * (3 * 4 + 6)
    return 0.0, local * 3 * 4


def optimizer_bytes(params: float) -> float:
    """Per sharded parameter: fused AdamW reads param, grad and two moments and writes three
    (28 B), the gradient-norm clip reads the gradients for the norm (4 B) and scales them in place
    (8 B; torch's clip_grads_with_norm_ multiplies even when the factor clamps to 1). The three
    kernels of the one-GPU step profiles (results/h200x1/one_gpu_training/profiles)."""
    return 40 * params


def comm_kept_bytes(a, tokens: int, ep: int, backend: str, *, overlap: str = "none", act_bytes: int = 2,
                    recv_capacity_factor: float = 0.0, ranks_per_node: int = 0, align: int = 8) -> float:
    """Bytes that activation checkpointing keeps per MoE layer and microbatch so that its recompute
    never calls dispatch or combine (moe_comm.titan.recompute), from the layer's forward to its
    backward; plain checkpointing kept none of it (it recomputed, and re-sent, it). Add it per MoE
    layer and microbatch-stage in flight, in every AC mode (without AC it is part of the layer's
    activations already).

    `tokens`: what the rank routes through the layer per microbatch (T); `act_bytes`: the rows'
    dtype (2 for bf16: what FSDP's mixed precision and autocast compute in, and what FP8 dispatch
    dequantises into; 4 without mixed precision). Per dispatch/combine call (two calls of half the
    tokens each under overlap "chunked"), with K = top_k, D = dim, L = experts per rank, R = the
    (token, expert) rows a rank receives (T K under balanced routing):
      * nccl: the expert-major rows (R + L x align, rounded to align) x D and their int32 gather
        indices; combine's weighted sum saves the (token, k) rows in fp32 (T K D x 4); the sort
        order and its token index (int64, T K each) and the fp32 routing weights; combine's output.
      * nvshmem: the expert rows at the buffer's capacity, twice (dispatch's output and
        combine's saved input: moe_comm.kernels.capacity.expert_rows, a static bound that
        recv_capacity_factor scales), the handle (int32 slot tables of the recv buffer, fp32
        slot weights, per-token rank/node positions) and the fp32 routing weights; combine's
        output.
      * deepep: the received rows twice (dispatch's permuted output and combine's saved input),
        their int64 permutation indices and fp32 scores, DeepEP's handle (about 5 bytes per token
        and EP rank); combine's output.
    """
    from moe_comm.backends.base import chunk_sizes, OVERLAP_CHUNKS
    from moe_comm.kernels import capacity

    m = a.moe_args
    K, D, E = m.top_k, a.dim, m.num_experts
    L = E // ep
    total = 0.0
    for T in chunk_sizes(tokens, OVERLAP_CHUNKS[overlap]):
        R = T * K
        out = T * D * act_bytes
        if backend == "nccl":
            padded = -(-(R + L * align) // align) * align
            total += padded * (D * act_bytes + 4) + R * D * 4 + R * (8 + 8 + 4) + out
        elif backend == "nvshmem":
            cap = capacity.expert_rows(T, E, K, ep, recv_capacity_factor, align)
            G = min(ep, ranks_per_node or ep)
            sizes = capacity.buffer_sizes(T, E, K, D * act_bytes, ep, G, recv_capacity_factor)
            slots = G * sizes.fwd_slots
            handle = T * (G + sizes.nodes) * 4 + sizes.net_slots * G * 4 + slots * (K * 8 + 4)
            total += 2 * cap * D * act_bytes + handle + R * 4 + out
        elif backend == "deepep":
            total += 2 * R * D * act_bytes + R * (8 + 8 + 8 + 4) + T * ep * 5 + out
        else:
            raise ValueError(f"backend {backend!r} is not one of nccl, nvshmem, deepep")
    return total


def call_graph_bytes(a, tokens: int, ep: int, recv_capacity_factor: float = 0.0, act_bytes: int = 2,
                     align: int = 8) -> float:
    """Bytes the CUDA graphs of one MoE layer's calls keep in their memory pools
    (moe_comm.kernels.call_graphs: each instance keeps its outputs' memory while idle, and a call
    whose earlier outputs are still alive gets another instance): about two of each call kind's
    outputs - dispatch's expert rows (the buffer's capacity), combine's output (the tokens), and
    their backwards' (rows-shaped and tokens-shaped) - for the rank's `tokens` per call. Measured
    on one H200: the one-GPU recipe's peak in use rose by 8.1 GiB when its MoE calls became graphs
    (2 MoE layers of 8192 tokens: results/h200x1/README.md, this rule gives 7.9)."""
    from moe_comm.kernels import capacity

    m = a.moe_args
    cap = capacity.expert_rows(tokens, m.num_experts, m.top_k, ep, recv_capacity_factor, align)
    return 2 * (2 * cap + 2 * tokens) * a.dim * act_bytes

