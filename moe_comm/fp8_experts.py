"""The routed experts in FP8 ([moe_comm] expert_dtype = "fp8").

TorchTitan's SwiGLU experts, h = silu(x W1^T) * (x W3^T) and y = h W2^T per expert, with every
grouped GEMM in e4m3 through torch's `torch._scaled_grouped_mm` (SM90 CUTLASS, fast
accumulation, bf16 out). On torch 2.11 it takes rowwise scales only on Hopper: one fp32 scale per
row of the left operand and one per output channel of the right (no 1x128 blocks on SM90). On
operands already in e4m3 its GEMMs beat bf16's clearly at the flagship rank's rows; what made
torchao's float8 recipe slower than bf16 was quantising in eager PyTorch (results/h200x1/README.md;
experiments/fp8_grouped_gemm_probe.py measures the GEMMs). So nothing here is quantised twice or in eager mode:

- activations: one scale per row (a token-expert row). The experts' input rows come from
  dispatch already in e4m3 (`Fp8Rows`), quantised once: by the sender with one scale for the
  whole row when dispatch_dtype = "fp8" (the wire keeps FP8 dispatch's format, every 128-channel
  group carrying the row's scale) and kept so to the GEMM, or by the receiver's layout kernel
  with dispatch_dtype = "bf16". No dequantise-requantise.
- weights: one scale per output channel per expert, quantised from the parameters (the bf16
  weights FSDP gathers, fp32 at world 1) by a kernel of ours that reads each once. dgrad needs
  them K-major along the other dimension: it takes the same e4m3 codes transposed byte for byte,
  and the forward's row scales move onto its left operand (dY and dh13 are multiplied channel by
  channel by them before their rowwise quantisation, in the kernels that quantise them): dX =
  dY W = (dY diag(s)) Wq, exact before rounding. So the parameters are read once per copy-making,
  not twice, and no column statistics are taken. Where the experts' forward runs more than once
  per optimizer step (several microbatches, or an activation-checkpointing recompute), both
  copies are kept in a `WeightCache` until the weights change, so each is made once per step;
  see it. So are they where the weights stay whole between steps (the one-GPU recipe), made
  right after each optimizer step while the host logs the step. Otherwise the forward's copies
  are saved for the backward (1 byte per weight).
- between the GEMMs: one fused kernel computes silu(h1) * h3 and quantises it; in the backward
  one fused kernel computes the gate's gradient and quantises it.

The GEMMs (R rows, D hidden, I inter; W13 = [W1 | W3] makes the first one GEMM):
  forward  h13 = x W13^T      x per row, W13 per output channel         [R, 2I]
           y   = h W2^T       h = silu(h1) h3 per row, W2 per output ch  [R, D]
  dgrad    dh  = dy W2        dy x W2's row scales, per row; W2's codes^T   [R, I]
           dx  = dh13 W13     dh13 x W13's row scales, per row; W13's codes^T [R, D]
  wgrad    dW2 = dy^T h,  dW1 | dW3 = dh13^T x, per expert: both operands per (expert, channel)
           over the expert's rows, transposed (FP8 tensor cores take both operands K-major).

Which gradients are FP8, and why: every GEMM of the backward is. dgrad because its operands are
rowwise like the forward's (dy and dh13 are quantised once each, by fused kernels). wgrad because
it is a third of the experts' FLOPs: in bf16 it costs about as much as the whole FP8 forward, and
FP8 experts at three quarters of bf16's time (the layer benchmark's target) are out of reach
without it. Its price is a second quantisation of dy, h and dh13 along the tokens (one pass over
the rows each: the kernels that write them take each (expert, channel)'s amax on the way) and
coarser scales (one per channel over all of an expert's rows), the recipe torchao's float8 grouped
GEMMs use too. x needs no second quantisation: dW1 = dh1^T diag(s_x) x_q, so x's row scales go
into dh13's bf16 copy (the gate's backward writes it so) and x's codes are transposed as they are.
`wgrad_fp8=False` (bf16 weight gradients from the same operands: x's codes, dh13 with x's scales)
stays for the layer benchmark's comparison of the two. Every gradient leaves in bf16: the routing
and combine around the experts stay bf16.

Rows are expert-major and padded as dispatch lays them out: expert e's rows end at
cumsum(tokens_per_expert)[e], each segment a multiple of ROW_ALIGN (the FP8 GEMMs' tile of
rows); rows past the last segment are never read.
"""

import contextlib
import weakref
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from moe_comm import gpus
from moe_comm.errors import RecipeError
from moe_comm.kernels import capacity, fp8

# Rows per expert segment are padded to this. FP8 grouped GEMMs need each segment's start on 16
# bytes of e4m3 (the token dimension is the contraction in wgrad); 128, the GEMMs' tile of rows,
# also keeps the token-grouped wgrad GEMM off partial tiles: at the flagship rank's node-limited
# counts it took 2.89 ms padded to 16 and 2.29 padded to 128, as fast as at balanced counts, for
# 1.5% more rows (results/h200x1/README.md, run 39).
ROW_ALIGN = 128
# The widest hidden size and expert inter dim the row kernels hold in registers
# (csrc/experts/experts.h kMaxRowChannels).
MAX_CHANNELS = 8192
# GPU models of the Hopper generation (SM 9.0), where torch's rowwise FP8 grouped GEMM runs.
HOPPER = ("H100", "H200")


class Fp8Rows:
    """The rows dispatch hands the FP8 experts: e4m3 [R, D] with one fp32 scale per row [R],
    expert-major and padded like DispatchResult.recv_x_RD (padding rows zero, scale 1).

    A plain class on purpose: FSDP's mixed-precision input cast walks tuples, dicts and
    dataclasses, and would turn both tensors into bf16 on their way into the experts module."""

    __slots__ = ("data_RD", "scale_R")

    def __init__(self, data_RD: torch.Tensor, scale_R: torch.Tensor):
        self.data_RD = data_RD
        self.scale_R = scale_R


def rows_alignment(grouped_gemm_align: int, expert_dtype: str) -> int:
    """The per-expert row alignment dispatch lays the experts' rows out with: the grouped GEMM's
    (TorchTitan's, by converter), and for the FP8 experts at least ROW_ALIGN. NvshmemBackend lays
    them out so, and `check` counts them so."""
    return max(grouped_gemm_align, ROW_ALIGN) if expert_dtype == "fp8" else grouped_gemm_align


def expert_rows(tokens: int, num_experts: int, top_k: int, ranks: int, factor: float, grouped_gemm_align: int,
                expert_dtype: str) -> int:
    """The rows one rank hands its experts (moe_comm.kernels.capacity.expert_rows at
    `rows_alignment`), for the FP8 experts rounded up to a whole number of ROW_ALIGN so that even
    segments clamped at an overflow stay multiples of it. NvshmemBackend sizes its capacity so, and
    `check` prints it."""
    rows = capacity.expert_rows(tokens, num_experts, top_k, ranks, factor,
                                rows_alignment(grouped_gemm_align, expert_dtype))
    return -(-rows // ROW_ALIGN) * ROW_ALIGN if expert_dtype == "fp8" else rows


def check_run(run) -> list[str]:
    """Where FP8 experts cannot run, a RecipeError naming the field and the fix; what could not
    be verified before launch, as notes. `run` is a moe_comm.backends.RunPlan whose backend
    feeds FP8 rows (the backend class checks that)."""
    o = run.options
    fix = 'set [moe_comm] expert_dtype = "bf16"'
    if run.device != "cuda":
        raise RecipeError(f'[moe_comm] expert_dtype = "fp8" runs FP8 grouped GEMMs on Hopper GPUs; this run is on '
                          f"{run.device}: {fix}")
    gpu = gpus.lookup(run.gpu) if run.gpu else None
    notes = []
    if gpu is not None and not gpu.model.startswith(HOPPER):
        raise RecipeError(
            f'[moe_comm] expert_dtype = "fp8" runs torch\'s rowwise FP8 grouped GEMM, written for Hopper (SM 9.0); '
            f"on {gpu.model} the FP8 recipe is MXFP8 grouped GEMMs through torchao: {fix} and [model] converters = "
            '["quantize.grouped_mm.mx"] (recipes/deepseek_v3_671b_b200_mxfp8.toml)')
    if gpu is None:
        notes.append('expert_dtype = "fp8": the GPU is not known here; the start-up refuses anything but Hopper')
    grouped = [c for c in run.converters if c.startswith("quantize.grouped_mm.")]
    if grouped:
        raise RecipeError(f'[moe_comm] expert_dtype = "fp8" and [model] converters = {grouped} both quantise the '
                          f"routed experts' grouped GEMMs: choose one ({fix}, or drop the grouped_mm converter)")
    if o.overlap != "none" or run.dual_pipe_v:
        what = f'[moe_comm] overlap = "{o.overlap}"' if o.overlap != "none" else "DualPipeV's EP overlap"
        raise RecipeError(f'[moe_comm] expert_dtype = "fp8" runs with overlap = "none" only (its rows do not yet '
                          f"cross between the overlap's streams); {what} is set: set overlap = \"none\" or {fix}")
    if run.param_dtype and run.param_dtype != "bfloat16":
        raise RecipeError(f'[moe_comm] expert_dtype = "fp8" quantises bf16 rows; [training] mixed_precision_param '
                          f'is "{run.param_dtype}": set it to "bfloat16" or {fix}')
    if run.hidden % 16 or run.hidden > MAX_CHANNELS:
        raise RecipeError(f'[moe_comm] expert_dtype = "fp8" needs the hidden size a multiple of 16 and at most '
                          f"{MAX_CHANNELS}; the flavor's is {run.hidden}: {fix}")
    return notes


def require_device(device: torch.device) -> None:
    """Refuse a GPU the rowwise FP8 grouped GEMM was not written for (the backend calls this
    at start-up, where the device is known exactly)."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise RecipeError(
            f'[moe_comm] expert_dtype = "fp8" needs a Hopper GPU (SM 9.0); {torch.cuda.get_device_name(device)} is '
            f'SM {major}.{minor}: set [moe_comm] expert_dtype = "bf16" (on B200, MXFP8 through [model] converters = '
            '["quantize.grouped_mm.mx"])')


def check_shapes(dim: int, inter: int) -> None:
    if dim % 16 or inter % 16 or dim > MAX_CHANNELS or inter > MAX_CHANNELS:
        raise ValueError(f"FP8 experts need hidden ({dim}) and the experts' inter dim ({inter}) in multiples of 16, "
                         f"at most {MAX_CHANNELS}: set [moe_comm] expert_dtype = \"bf16\" for this flavor")


def caches_weights(forwards_per_step: int, ac_mode: str, weights_sharded: bool) -> bool:
    """Whether a run keeps the e4m3 weights over the step (`WeightCache`): where the experts'
    forward runs more than once between two optimizer steps - several microbatches (pipeline
    microbatches or gradient accumulation), or activation checkpointing's recompute - and where
    the experts' weights are whole tensors of their own between steps (no EP, FSDP or TP sharding:
    the one-GPU recipe), whose copies the cache makes right after each optimizer step
    (`WeightCache(weights=...)`). Sharded weights exist whole only while FSDP gathers them for a
    forward, and a single forward a step reuses nothing."""
    return forwards_per_step > 1 or ac_mode != "none" or not weights_sharded


def forward_weight_bytes(local_experts: int, dim: int, inter: int) -> int:
    """The forward's e4m3 W1|W3 and W2 of one MoE layer with their fp32 row scales: what a run that
    does not cache keeps from each MoE layer's forward to its backward (dgrad transposes them)."""
    return 3 * local_experts * dim * inter + 4 * local_experts * (2 * inter + dim)


def cached_weight_bytes(local_experts: int, dim: int, inter: int) -> int:
    """What a WeightCache holds for one MoE layer: the forward's copies (`forward_weight_bytes`)
    and dgrad's transposed codes (as many bytes, no scales of their own)."""
    return forward_weight_bytes(local_experts, dim, inter) + 3 * local_experts * dim * inter


_optimizer_steps = 0  # optimizer steps this process has taken, once a WeightCache exists
_stepping: list = []  # the optimizers whose step is under way, outermost first
_step_hooks = None
_ahead = weakref.WeakSet()  # the WeightCaches that make their copies right after an optimizer step


def _count_optimizer_steps() -> None:
    """Count every optimizer step from now on (global hooks, whichever optimizer steps), and have
    the caches that make their copies ahead make them.

    A step taken inside another optimizer's step counts as part of it, once, when the outermost
    one ends: TorchTitan's OptimizersContainer is an optimizer that steps its own, so torch's
    hooks run twice a step, and counting both made every copy twice (run 59). The versions of
    the weights cannot tell the two apart: a fused optimizer (TorchTitan's AdamW) writes them
    without bumping their version counters, so copies keyed on versions alone were never made
    again after the first step (run 60)."""
    global _step_hooks

    def started(optimizer, args, kwargs):
        for i, o in enumerate(_stepping):  # already under way: that step raised, it and those inside it are over
            if o is optimizer:
                del _stepping[i:]
                break
        _stepping.append(optimizer)

    def stepped(optimizer, args, kwargs):
        global _optimizer_steps
        while _stepping and _stepping.pop() is not optimizer:
            pass
        if _stepping:  # inside another optimizer's step: counted when that one ends
            return
        _optimizer_steps += 1
        for cache in list(_ahead):
            cache.make_ahead(optimizer)

    if _step_hooks is None:
        _step_hooks = (register_optimizer_step_pre_hook(started), register_optimizer_step_post_hook(stepped))


class WeightCache:
    """The experts' e4m3 weights of one MoE layer, made once while the weights stay the same.

    TorchTitan runs the experts' forward once per microbatch, and again in the backward under
    activation checkpointing; the weights only change at the optimizer step. Quantising them each
    time costs a pass over every local expert weight (0.42 ms forward and 0.28 ms for dgrad's
    transposed codes at the flagship rank's 8 experts on an H200, run 36, about 7% of the FP8
    experts' forward + backward), so where a run's experts run more than once per step
    (`caches_weights`) the copies are kept here.

    A copy is reused only while no optimizer has stepped since it was made (torch's global
    optimizer step hook counts the steps) and every weight is the same tensor, at the same
    storage, with the same version counter. Both, because neither is enough alone: a fused optimizer
    (TorchTitan's AdamW) writes the weights without bumping their versions; FSDP2 writes
    each step's all-gathered weights into the unsharded parameters with their version counters
    preserved, and an optimizer's in-place update of an EP-sharded DTensor weight runs on its
    local tensor below autograd, which leaves the version of what `to_local()` returns as it was;
    so only the optimizer step says that they changed. An in-place write outside an optimizer (a
    checkpoint load at world 1, a test) bumps the version. What a cache holds is
    counted in the memory estimate (`cached_weight_bytes`).

    On CUDA the copies live in a memory pool of their own, and a step's stale copies are dropped
    before its new ones are made. In the allocator's shared pool, copies made at each step's first
    forward and kept to its end had the blocks freed by the last step's copies split up by the
    step's activations in between, so the allocator reserved new ones every step (the one-GPU
    recipe under full AC: +2 GiB reserved per step, out of memory at step 18). In their own pool
    the same sizes come back each step and reuse the same blocks.

    Given `weights` (the layer's w1, w2, w3 as they stay between steps: whole tensors of its own,
    not gathered by FSDP), the cache makes both copies right after each optimizer step, on a
    stream of its own: TorchTitan then reads the loss (the host waits for the GPU), logs the step
    and moves the next batch over, while the GPU would otherwise sit idle (run 47: about 8 ms of
    each step of the one-GPU recipe). The first forward after it waits for that stream. Without
    `weights` the copies are made by the step's first forward and first backward."""

    def __init__(self, weights: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None):
        _count_optimizer_steps()
        self._key: tuple | None = None
        self._forward: tuple | None = None
        self._transposed: dict[str, tuple] = {}
        self._pool = None  # torch.cuda.MemPool, made at the first CUDA copy
        self._weights = weights
        self._stream = None  # where the copies made ahead are made (CUDA)
        self._ready = None  # the event that ends them, until a forward waits for it
        self.made = {"forward": 0, "transposed": 0}  # how often each was quantised (tests, benchmark)
        if weights is not None:
            _ahead.add(self)

    def _in_pool(self, w: torch.Tensor):
        """Allocate what the quantising makes in the cache's own pool (on CUDA)."""
        if not w.is_cuda:
            return contextlib.nullcontext()
        if self._pool is None:
            self._pool = torch.cuda.MemPool()
        return torch.cuda.use_mem_pool(self._pool, w.device)

    @staticmethod
    def _key_of(weights: tuple) -> tuple:
        return (_optimizer_steps,) + tuple((id(w._base if w._base is not None else w), w.data_ptr(), w._version,
                                            tuple(w.shape), w.stride(), w.dtype) for w in weights)

    def _stale(self, weights: tuple) -> bool:
        """Whether the copies held (if any) are not of these weights as they are now."""
        return self._forward is None or self._key_of(weights) != self._key

    def _wait(self) -> None:
        """The current stream waits for the copies made ahead (once per making)."""
        if self._ready is not None:
            torch.cuda.current_stream().wait_event(self._ready)
            self._ready = None

    def forward(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple:
        """((W1|W3 e4m3, row scales), (W2 e4m3, row scales))."""
        self._wait()
        if self._stale((w1, w2, w3)):
            if self._weights is not None:  # all its copies on its stream, whichever makes them
                self._make_ahead(w1, w2, w3)
                self._wait()
            else:
                self._make_forward(w1, w2, w3)
        return self._forward

    def _make_forward(self, w1, w2, w3) -> None:
        key = self._key_of((w1, w2, w3))
        self._key, self._forward, self._transposed = None, None, {}  # the stale copies go first
        with self._in_pool(w1):
            self._forward = (fp8.weights(w1, w3), fp8.weights(w2))
        self._key = key
        self.made["forward"] += 1

    def transposed(self, name: str, q: torch.Tensor) -> torch.Tensor:
        """dgrad's transposed codes `name` ("w2" or "w13") of the forward copy q. Kept only where q
        is a copy this cache holds now: a backward whose forward saw weights since replaced
        (never in TorchTitan's order) gets its own, uncached."""
        self._wait()
        if self._forward is None or not any(q is copy for copy, _ in self._forward):
            return fp8.weights_transposed(q)
        if name not in self._transposed:
            with self._in_pool(q):
                self._transposed[name] = fp8.weights_transposed(q)
            self.made["transposed"] += 1
        return self._transposed[name]

    def make_ahead(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Both copies of the weights as they are now, unless they are already, or `optimizer`
        (the one whose step just ended; the step hook passes it) holds none of them: TorchTitan's
        optimizers in backward (`early_step_in_backward`) step one parameter at a time, and
        each of those steps would otherwise make every layer's copies."""
        w1, w2, w3 = self._weights()
        if any(isinstance(w, DTensor) for w in (w1, w2, w3)):
            raise RuntimeError("the FP8 experts' WeightCache makes copies ahead of whole weights only; these are "
                               "sharded (DTensor) and exist whole only while FSDP gathers them for a forward")
        if optimizer is not None and not _holds(optimizer, (w1, w2, w3)):
            return
        if self._stale((w1, w2, w3)):
            self._make_ahead(w1, w2, w3)

    def _make_ahead(self, w1, w2, w3) -> None:
        """Both copies, on the cache's own stream where the weights are CUDA tensors, after all the
        current stream has queued: the optimizer's writes of the weights, and every read of the
        copies these replace, whose memory the new ones may take (so no record_stream, which
        kept two steps' copies reserved: run 57). The next forward waits for them."""
        self._ready = None
        where = contextlib.nullcontext()
        if w1.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(w1.device)
            self._stream.wait_stream(torch.cuda.current_stream(w1.device))
            where = torch.cuda.stream(self._stream)
        with where, torch.no_grad():
            self._make_forward(w1, w2, w3)
            for name, (q, _) in zip(("w13", "w2"), self._forward):
                self.transposed(name, q)
        if w1.is_cuda:
            self._ready = self._stream.record_event()


def _holds(optimizer: torch.optim.Optimizer, weights: tuple) -> bool:
    """Whether any of `weights` is among the parameters `optimizer` steps."""
    ids = {id(w) for w in weights}
    return any(id(p) in ids for group in optimizer.param_groups for p in group["params"])


_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(like: torch.Tensor) -> torch.cuda.Stream | None:
    """The stream beside the grouped GEMMs of the experts' backward on like's GPU (one per GPU);
    None on CPU."""
    if not like.is_cuda:
        return None
    if like.device.index not in _side_streams:
        _side_streams[like.device.index] = torch.cuda.Stream(like.device)
    return _side_streams[like.device.index]


def _ready(side: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event after all the current stream has queued so far (what the work beside the next
    GEMM reads), or None without a side stream."""
    return None if side is None else torch.cuda.current_stream(side.device).record_event()


@contextlib.contextmanager
def _beside_gemms(side: torch.cuda.Stream | None, ready: torch.cuda.Event | None):
    """Queue the block on `side` after `ready`, to run beside the grouped GEMM the current stream
    queued after `ready`; in place where side is None.

    Each torch._scaled_grouped_mm is one persistent grid of 2-SM clusters that holds 116 of an
    H200's 132 SMs (run 60's profile), and the memory-bound kernels queued here wait for no GEMM
    but their producer's. Memory: the block's outputs come from side's pool, and the current
    stream reads them only after `_join`; side reuses that memory only in a later block, after a
    later `ready`, which follows those reads. What the block reads, and the outputs the current
    stream keeps (allocated on it before `ready`), the caller holds until after `_join`."""
    if side is None:
        yield
        return
    side.wait_event(ready)
    with torch.cuda.stream(side):
        yield


def _join(side: torch.cuda.Stream | None) -> None:
    """The current stream waits for all queued on `side`."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)


def _mark(marks: list | None, name: str) -> None:
    """The benchmark's per-step timing (None in training: nothing recorded)."""
    if marks is None:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stamp = torch.cuda.Event(enable_timing=True)
        stamp.record()
    else:
        import time

        stamp = time.perf_counter()
    marks.append((name, stamp))


class _Fp8Experts(torch.autograd.Function):
    """See the module doc. rows_grad_RD carries the rows' gradient (kernels/ops.py's
    dispatch_fp8_rows says why); x_q/x_scale are the rows."""

    @staticmethod
    def forward(ctx, rows_grad_RD, w1, w2, w3, x_q, x_scale, offsets, wgrad_fp8, cache, marks, beside_gemms):
        # dtypes are this function's own: autocast (TorchTitan's at world 1) must not recast them
        with torch.autocast(x_q.device.type, enabled=False):
            _mark(marks, "start")
            if cache is not None:
                (w13_q, w13_scale), (w2_q, w2_scale) = cache.forward(w1, w2, w3)
            else:
                w13_q, w13_scale = fp8.weights(w1, w3)
                w2_q, w2_scale = fp8.weights(w2)
            _mark(marks, "weights")
            h13 = fp8.scaled_grouped_mm(x_q, w13_q.transpose(-2, -1), x_scale, w13_scale, offsets)
            _mark(marks, "gemm_13")
            h_q, h_scale = fp8.gate(h13, offsets)
            _mark(marks, "gate")
            y = fp8.scaled_grouped_mm(h_q, w2_q.transpose(-2, -1), h_scale, w2_scale, offsets)
            _mark(marks, "gemm_2")
        ctx.save_for_backward(x_q, x_scale, offsets, h13, w13_q, w13_scale, w2_q, w2_scale)
        ctx.wgrad_fp8, ctx.cache, ctx.marks, ctx.inter = wgrad_fp8, cache, marks, w1.shape[1]
        ctx.beside_gemms = beside_gemms
        ctx.weight_dtype = w1.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_q, x_scale, offsets, h13, w13_q, w13_scale, w2_q, w2_scale = ctx.saved_tensors
        marks, inter = ctx.marks, ctx.inter

        def transposed(name, q):
            # the cache's copies are of the forward copy its last forward returned, which is q:
            # the next step's forward comes after this backward
            if ctx.cache is not None:
                return ctx.cache.transposed(name, q)
            return fp8.weights_transposed(q)

        def ones(experts, channels):  # the transposed codes' scales: the forward's moved to the left operand
            return torch.ones(experts, channels, dtype=torch.float32, device=w2_q.device)

        dy = grad_y.to(torch.bfloat16).contiguous()
        # With a side stream (`_beside_gemms`), the order is the one that hides most of the memory-
        # bound work (run 61's probe: beside a dgrad GEMM the transposes hid nothing, beside a
        # wgrad GEMM 24-41%, the widening about half beside either): dy's transpose beside dgrad
        # dh's GEMM (it hides nothing there but waits for nothing), h's on the main stream, x's and
        # dh13's beside dW2's GEMM, each fp32 weight gradient's widening beside the next GEMM, and
        # dgrad dx's GEMM last, beside the last widening. Each `ready` is recorded just before the
        # GEMM its work runs beside, so that work starts with the GEMM, not ahead of it: started
        # first, a memory-bound kernel held the SMs the GEMM's persistent grid waited for (the
        # probe's "kernel first": up to twice the kernel's time added). Without a side stream (CPU,
        # or beside_gemms off) the same work runs in place, each in its own step of the
        # benchmark's breakdown.
        side = _side_stream(dy) if ctx.beside_gemms else None
        widen = ctx.weight_dtype == torch.float32  # fp32 parameters (world 1): widened here, not by autograd
        experts, dim = w2_q.shape[:2]
        with torch.autocast(dy.device.type, enabled=False):  # as in forward
            _mark(marks, "start")
            dy_q, dy_scale, dy_amax = fp8.quantise_grad_rows(dy, offsets, w2_scale)  # dy diag(W2's row scales)
            _mark(marks, "quantise_dy")
            w2t_q = transposed("w2", w2_q)  # [L, I, D]
            _mark(marks, "weights_t_2")
            w2t_scale = ones(*w2t_q.shape[:2])
            ready = _ready(side)  # dy and its columns' amax
            dh = fp8.scaled_grouped_mm(dy_q, w2t_q.transpose(-2, -1), dy_scale, w2t_scale, offsets)
            del dy_q, dy_scale, w2t_q
            if ctx.wgrad_fp8 and side is not None:
                with _beside_gemms(side, ready):
                    dy_t, dy_t_scale = fp8.group_columns(dy, dy_amax, offsets)  # [D, R']
            _mark(marks, "dgrad_h")
            # dh13 for dgrad times W13's row scales; for wgrad (bf16) times x's row scales
            dh13_q, dh13_scale, dh13, h, h_dh13_amax = fp8.gate_backward(h13, dh, offsets, w13_scale, x_scale)
            del dh
            _mark(marks, "gate_backward")

            def x_dh13_operands():  # [D, R'] (x's codes as they are: its row scales are in dh13), [2I, R']
                return fp8.transpose_rows(x_q, offsets), fp8.group_columns(dh13, h_dh13_amax[:, inter:], offsets, 2)
            if ctx.wgrad_fp8:
                if side is None:
                    dy_t, dy_t_scale = fp8.group_columns(dy, dy_amax, offsets)
                    x_t, (dh13_t, dh13_t_scale) = x_dh13_operands()
                h_t, h_t_scale = fp8.group_columns(h, h_dh13_amax[:, :inter], offsets)  # [I, R']: dW2's first
                _join(side)  # dy's
                _mark(marks, "wgrad_operands")  # beside the GEMMs: what the main stream waits for of them

                x_t_scale = ones(len(offsets), dim).view(-1)

                def by_x(a_t, a_scale):  # [L, rows of a_t, D]: a_t against x's codes
                    return fp8.scaled_grouped_mm(a_t, x_t.t(), a_scale, x_t_scale, offsets)
                gemms = (lambda: fp8.scaled_grouped_mm(dy_t, h_t.t(), dy_t_scale[0], h_t_scale[0], offsets),
                         lambda: by_x(dh13_t[:inter], dh13_t_scale[0]),
                         lambda: by_x(dh13_t[inter:], dh13_t_scale[1]))
            else:
                x = x_q.to(torch.bfloat16)  # the codes, exactly: x's row scales are in dh13
                _mark(marks, "wgrad_operands")
                gemms = (lambda: fp8.grouped_mm(dy.t(), h, offsets),
                         lambda: fp8.grouped_mm(dh13[:, :inter].t(), x, offsets),
                         lambda: fp8.grouped_mm(dh13[:, inter:].t(), x, offsets))
            shapes = ((experts, dim, inter), (experts, inter, dim), (experts, inter, dim))
            out = [torch.empty(shape, dtype=torch.float32, device=w2_q.device) for shape in shapes] if widen else []
            grads = []  # the GEMMs' bf16 outputs, held until the main stream has waited for their widening
            for i, gemm in enumerate(gemms):
                ready = _ready(side)  # all before GEMM i: h, dh13 and their amax; GEMM i - 1's output
                grads.append(gemm())
                if i == 0 and ctx.wgrad_fp8 and side is not None:
                    with _beside_gemms(side, ready):
                        x_t, (dh13_t, dh13_t_scale) = x_dh13_operands()
                    _join(side)  # for the GEMMs after this one
                if widen and side is None:
                    fp8.widen(grads[i], out[i])
                elif widen and i > 0:
                    with _beside_gemms(side, ready):
                        fp8.widen(grads[i - 1], out[i - 1])
            _mark(marks, "wgrad_gemm")
            w13t_q = transposed("w13", w13_q)  # [L, D, 2I]
            _mark(marks, "weights_t_13")
            w13t_scale = ones(*w13t_q.shape[:2])
            ready = _ready(side)  # the last weight gradient's GEMM written
            dx = fp8.scaled_grouped_mm(dh13_q, w13t_q.transpose(-2, -1), dh13_scale, w13t_scale, offsets)
            if widen and side is not None:
                with _beside_gemms(side, ready):
                    fp8.widen(grads[-1], out[-1])
            _join(side)
            del dh13_q, dh13_scale, w13t_q
            _mark(marks, "dgrad_x")
            dw2, dw1, dw3 = out if widen else grads
        return dx, dw1, dw2, dw3, None, None, None, None, None, None, None


@torch.compiler.disable  # custom kernels and FP8 GEMMs, eager as TorchTitan's experts run under EP
def grouped_experts(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, rows_grad_RD: torch.Tensor,
                    rows: Fp8Rows, tokens_per_expert_L: torch.Tensor, wgrad_fp8: bool = True,
                    marks: list | None = None, cache: WeightCache | None = None,
                    beside_gemms: bool = True) -> torch.Tensor:
    """y [R, D] bf16 of the local experts (w1, w3 [L, I, D], w2 [L, D, I], fp32 or bf16, local
    tensors) on the FP8 rows; the rows' gradient returns through rows_grad_RD. `marks`: a list
    that collects (step, CUDA event) at each step's end, for the benchmark's breakdown; `cache`:
    the layer's WeightCache where its weights are quantised once per step; `beside_gemms` False:
    the backward's transposes and widening on the current stream, not beside the GEMMs (the layer
    benchmark's per-step breakdown times each step alone so; a comparison)."""
    check_shapes(w1.shape[2], w1.shape[1])
    offsets = torch.cumsum(tokens_per_expert_L, dim=0, dtype=torch.int32)
    return _Fp8Experts.apply(rows_grad_RD, w1.contiguous(), w2.contiguous(), w3.contiguous(), rows.data_RD,
                             rows.scale_R, offsets, wgrad_fp8, cache, marks, beside_gemms)
