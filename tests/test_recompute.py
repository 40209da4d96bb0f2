"""Activation checkpointing whose recompute never communicates (moe_comm.titan.recompute), on CPU.

One process (a world of one, the nccl backend at EP 1, TorchTitan's debug model of one dense and
two MoE layers in fp32 with the for-loop experts), for full AC, per-layer selective AC and per-op
selective AC, each with overlap "none" and "chunked":
- dispatch and combine are called exactly as often per step with AC as without: counted on the
  backend class, whose calls at EP 1 are the backend's whole local path (sort, gather, padding
  permute); TorchTitan's own apply_ac on the same model calls each twice in the forward (the
  control: the count would see a recompute that communicates);
- the loss and every gradient equal TorchTitan's apply_ac (the same AC mode without the change)
  and no AC at all, bit for bit: the recompute replays the forward's exact results, and every
  other op runs on the same shapes in the same order;
- what the checkpoint keeps equals moe_comm.predict.estimate.comm_kept_bytes.
Under torchrun the EP 2 training with full AC counts the calls too (tests/test_overlap.py).
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moe_comm.titan  # noqa: F401  CPU adaptations, flavors, train specs
from moe_comm.backends import build_backend, MoELayerSpec
from moe_comm.backends.nccl import NcclBackend
from moe_comm.config import MoEComm
from moe_comm.metrics import instrument
from moe_comm.predict.estimate import comm_kept_bytes
from moe_comm.titan import recompute
from moe_comm.titan.model import MoECommDeepSeekV3Model

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))  # the GPU cases' modules, which run on CPU too
from overlap_cases import debug_model_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

AC_MODES = ["full", "selective:1", "selective:op"]


@pytest.fixture
def calls(monkeypatch):
    """Calls of NcclBackend.dispatch and .combine (every backend instance)."""
    counts = {"dispatch": 0, "combine": 0}
    for op in counts:
        real = getattr(NcclBackend, op)

        def counted(self, *args, _real=real, _op=op):
            counts[_op] += 1
            return _real(self, *args)

        monkeypatch.setattr(NcclBackend, op, counted)
    return counts


def _model(ac: str, overlap: str, ours: bool) -> MoECommDeepSeekV3Model:
    """The debug model with every MoE layer on an instrumented nccl backend; AC through
    moe_comm.titan.recompute (`ours`) or TorchTitan's own apply_ac."""
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed import activation_checkpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.deepseek_v3.infra.parallelize import _op_sac_save_list

    torch.manual_seed(0)
    model = MoECommDeepSeekV3Model(debug_model_args())
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    for block in model.layers.values():
        if block.moe_enabled:
            moe = block.moe
            layer = MoELayerSpec(moe.experts.num_experts, moe.router.top_k, moe.experts.w1.shape[-1])
            moe.comm_backend = instrument(build_backend(MoEComm(backend="nccl", overlap=overlap), layer,
                                                        dist.group.WORLD))
    if ac != "none":
        mode, _, option = ac.partition(":")
        config = ActivationCheckpoint(mode=mode, selective_ac_option=option or "2")
        activation_checkpoint._layer_sac_count = 0  # TorchTitan counts layers per process
        if ours:
            recompute.apply_ac(model, config, model_compile_enabled=False, base_folder="")
        else:
            apply_ac(model, config, op_sac_save_list=set(_op_sac_save_list))
    return model


def _step(model, calls):
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    calls.update(dispatch=0, combine=0)
    loss = model(tokens).float().square().mean()
    forward = dict(calls)
    loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads, forward, dict(calls)


@pytest.mark.parametrize("overlap", ["none", "chunked"])
@pytest.mark.parametrize("ac", AC_MODES)
def test_recompute_never_calls_dispatch_or_combine(world_of_one, calls, ac, overlap):
    loss_none, grads_none, _, step_none = _step(_model("none", overlap, ours=True), calls)
    loss, grads, forward, step = _step(_model(ac, overlap, ours=True), calls)
    loss_titan, grads_titan, _, step_titan = _step(_model(ac, overlap, ours=False), calls)

    chunks = 2 if overlap == "chunked" else 1
    assert step_none == {"dispatch": 2 * chunks, "combine": 2 * chunks}  # two MoE layers
    assert step == forward == step_none, "the backward called dispatch or combine"
    # the control: TorchTitan's recompute calls them again (with selective per layer, on the
    # checkpointed layers only: layer 1 of layers 0-2, every one with option 1)
    recomputed = {"full": 2, "selective:1": 2, "selective:op": 2}[ac] * chunks
    assert step_titan == {op: n + recomputed for op, n in step_none.items()}

    assert torch.equal(loss, loss_titan) and torch.equal(loss, loss_none)
    assert grads.keys() == grads_titan.keys() == grads_none.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_titan[name]), f"{name} differs from TorchTitan's {ac}"
        assert torch.equal(grads[name], grads_none[name]), f"{name} differs from no AC"


def test_the_benchmark_switch_gives_torchtitans_recompute(world_of_one, calls, monkeypatch):
    """MOE_COMM_RECOMPUTE_COMM=1 (experiments/emulated_link.py's baseline) leaves TorchTitan's
    checkpointing as it is: its recompute calls dispatch and combine again."""
    monkeypatch.setenv(recompute.RECOMPUTE_COMM_ENV, "1")
    _, _, forward, step = _step(_model("full", "none", ours=True), calls)
    assert forward == {"dispatch": 2, "combine": 2} and step == {"dispatch": 4, "combine": 4}


def test_layer_selective_keeps_only_checkpointed_layers(world_of_one, calls):
    """With selective_ac_option 2 TorchTitan checkpoints layers 1 (an MoE layer) only: only its
    block gets the keeping checkpoint, and the counts hold."""
    model = _model("selective:2", "none", ours=True)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapped = [i for i, b in model.layers.items() if isinstance(b, CheckpointWrapper)]
    assert wrapped == ["1"]
    _, _, forward, step = _step(model, calls)
    assert step == forward == {"dispatch": 2, "combine": 2}


def test_kept_bytes_match_the_estimate(world_of_one, calls, monkeypatch):
    """What a frame keeps (the results it replays, and every tensor the backend's autograd saved
    outside the checkpoint: distinct storages) is what comm_kept_bytes prices for nccl."""
    frames, saved = [], []
    init, pack = recompute.Frame.__init__, recompute._pack

    def new_frame(self):
        init(self)
        frames.append(self)

    def spy(t):
        saved.append((frames[-1], t))
        return pack(t)

    monkeypatch.setattr(recompute.Frame, "__init__", new_frame)
    monkeypatch.setattr(recompute, "_pack", spy)
    model = _model("full", "none", ours=True)
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    model(tokens)
    moe_frames = [f for f in frames if f.kept]
    assert len(moe_frames) == 2  # the two MoE blocks
    from torchtitan.models.moe import utils

    for frame in moe_frames:
        tensors = [t for f, t in saved if f is frame]
        for _, result in frame.kept:
            if isinstance(result, torch.Tensor):
                tensors.append(result)
            else:
                tensors += [result.recv_x_RD, result.tokens_per_expert_L]
                tensors += [v for v in vars(result.handle).values() if isinstance(v, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        kept = sum(storages.values())
        # fp32 model, EP 1 (the rows and counts are tiny: 18 tokens, top 3, 8 experts)
        a = model.model_args
        want = comm_kept_bytes(a, 18, 1, "nccl", act_bytes=4, align=utils.TOKEN_GROUP_ALIGN_SIZE_M)
        assert abs(kept - want) <= 0.02 * want, (kept, want)


def test_comm_kept_bytes_per_backend():
    """The flagship's layer (7168 wide, top 8 of 256, EP 32 on 8-GPU nodes, a microbatch of 4096
    tokens, bf16): each backend keeps about two expert-row tensors and combine's output; nvshmem's
    rows are its buffer capacity (recv_capacity_factor 2: twice the balanced load)."""
    from moe_comm.layout.flavors import register

    register()
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a = deepseekv3_args["671B"]
    T, K, D = 4096, 8, 7168
    rows = T * K * D * 2
    out = T * D * 2
    nccl = comm_kept_bytes(a, T, 32, "nccl")
    assert 3 * rows + out < nccl < 3.1 * rows + out  # bf16 rows + fp32 (token, k) rows
    nvshmem = comm_kept_bytes(a, T, 32, "nvshmem", recv_capacity_factor=2.0, ranks_per_node=8)
    assert 4 * rows + out < nvshmem < 4.05 * rows + out
    deepep = comm_kept_bytes(a, T, 32, "deepep")
    assert 2 * rows + out < deepep < 2.1 * rows + out
    chunked = comm_kept_bytes(a, T, 32, "nvshmem", recv_capacity_factor=2.0, ranks_per_node=8, overlap="chunked")
    assert chunked == pytest.approx(nvshmem, rel=0.01)
    with pytest.raises(ValueError, match="backend"):
        comm_kept_bytes(a, T, 32, "gloo")
