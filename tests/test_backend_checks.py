"""Each backend's `check_run`: what it can run, asked with a RunPlan before anything starts
(the one validation `check`, `submit`, `train` and the model build share). No GPU needed."""

import dataclasses
import sys

import pytest

from moe_comm.backends import backend_class
from moe_comm.backends.deepep import DeepEPBackend
from moe_comm.backends.nvshmem import NvshmemBackend
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError
from moe_comm.kernels.limits import LIMITS
from moe_comm.layout import RunPlan

IB_ENV = {"NVSHMEM_REMOTE_TRANSPORT": "ibrc", "NVSHMEM_HCA_LIST": "mlx5_0:1"}


def plan(backend="nvshmem", **kw) -> RunPlan:
    """The flagship's shape by default: EP 32 over 4 nodes of 8 B200s, top-8 of 256 experts."""
    options = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(MoEComm)}}
    base = dict(options=MoEComm(backend=backend, **options), device="cuda", ep=32, ranks_per_node=8, nodes=32,
                num_experts=256, top_k=8, hidden=7168, tokens_per_rank=4096, param_dtype="bfloat16",
                gpu="B200", launch_env=IB_ENV, launch_env_source="[cluster] env_file = 'x.sh'")
    base.update(kw)
    return RunPlan(**base)


def test_limits_come_from_the_kernels_header():
    assert (NvshmemBackend.max_ranks, NvshmemBackend.max_ranks_per_node, NvshmemBackend.max_nodes,
            NvshmemBackend.max_top_k, NvshmemBackend.max_experts) == (
        LIMITS.max_ranks, LIMITS.max_ranks_per_node, LIMITS.max_nodes, LIMITS.max_top_k, LIMITS.max_experts)


@pytest.mark.parametrize("kw", [
    {},  # EP 32 over 4 real nodes
    dict(ep=256, nodes=32, num_experts=256),  # one expert per GPU, 32 nodes
    dict(ep=8, nodes=1, launch_env=None),  # one node: no network settings needed
    dict(ep=4, nodes=1),  # EP inside a node of 8
    dict(ep=8, nodes=1, virtual_node_size=2, launch_env={}),  # 4 virtual nodes on one machine
    dict(ep=8, nodes=1, ranks_per_node=8, virtual_node_size=4, network_sms=10, num_sms=20, launch_env={}),
    dict(num_sms=148),  # a B200's every SM
    dict(dispatch_dtype="fp8"),
    dict(ep=2, nodes=1, ranks_per_node=2, gpu="H200", num_sms=132),
    dict(ep=1, nodes=1, ranks_per_node=1, gpu="H200", launch_env=None),  # one GPU: every expert local
    dict(ep=1, nodes=1, ranks_per_node=8, launch_env=None),  # EP 1 under FSDP 8: a one-rank EP group each
    dict(ep=1, nodes=1, ranks_per_node=1, gpu="H200", dispatch_dtype="fp8", launch_env=None),
    dict(combine_grad_dtype="fp8"),
    dict(ep=1, nodes=1, ranks_per_node=1, gpu="H200", combine_grad_dtype="fp8", launch_env=None),
])
def test_nvshmem_accepts(kw):
    NvshmemBackend.check_run(plan(**kw))


@pytest.mark.parametrize("kw, words", [
    (dict(device="cpu"), ["needs CUDA", 'backend = "nccl"']),
    (dict(ep=512, nodes=64, num_experts=1024), ["expert_parallel_degree = 512", f"1..{LIMITS.max_ranks}"]),
    (dict(ep=12, num_experts=12 * 20), ["expert_parallel_degree = 12", "multiple of the 8 ranks per node"]),
    (dict(ep=3, nodes=1, num_experts=12), ["expert_parallel_degree = 3", "straddle"]),
    (dict(ep=16, ranks_per_node=16, nodes=2), ["16 of them on one node", "at most 8", "virtual_node_size"]),
    (dict(ep=128, ranks_per_node=2, nodes=64), ["spans 64 nodes", f"at most {LIMITS.max_nodes}"]),
    (dict(virtual_node_size=3), ["virtual_node_size = 3", "divide"]),
    (dict(virtual_node_size=-1), ["virtual_node_size = -1"]),
    (dict(top_k=9), ["top_k = 9", "1..8"]),
    (dict(num_experts=2048, ep=32), ["2048 experts", "1024"]),
    (dict(num_experts=100, ep=32), ["expert_parallel_degree = 32 does not divide the 100 experts"]),
    (dict(score_before_experts=True), ["score_before_experts", 'backend = "nccl"']),
    (dict(num_sms=149), ["num_sms = 149", "B200 has 148 SMs"]),
    (dict(num_sms=140, gpu="H200"), ["num_sms = 140", "H200 has 132 SMs"]),
    (dict(num_sms=149, gpu=""), ["num_sms = 149", "no known GPU has more than 148"]),
    (dict(num_sms=0), ["num_sms = 0"]),
    (dict(network_sms=20, num_sms=20), ["network_sms = 20", "below num_sms = 20"]),
    (dict(wait_timeout_s=0.0), ["wait_timeout_s = 0.0", "silent hang"]),
    (dict(dispatch_dtype="fp8", param_dtype="float32"), ['dispatch_dtype = "fp8"', "mixed_precision_param", "bfloat16"]),
    (dict(dispatch_dtype="fp8", hidden=2000), ['dispatch_dtype = "fp8"', "2000", "128"]),
    (dict(launch_env={}), ["spans 4 nodes", "[cluster] env_file = 'x.sh'", "NVSHMEM_REMOTE_TRANSPORT = '(unset)'"]),
    (dict(launch_env={"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_HCA_LIST": "mlx5_0:1"}), ["NVSHMEM_REMOTE_TRANSPORT = 'none'"]),
    (dict(launch_env={"NVSHMEM_REMOTE_TRANSPORT": "ibgda"}), ["NVSHMEM_HCA_LIST = '(unset)'"]),
    (dict(max_tokens_per_rank=100), ["max_tokens_per_rank = 100", "4096"]),
    (dict(recv_capacity_factor=0.5), ["recv_capacity_factor = 0.5"]),
])
def test_nvshmem_refuses_naming_the_field(kw, words):
    with pytest.raises(RecipeError) as e:
        NvshmemBackend.check_run(plan(**kw))
    for word in words:
        assert word in str(e.value), f"{word!r} not in {str(e.value)!r}"


H200_EP = dict(gpu="H200", ranks_per_node=8, nodes=1, ep=8, launch_env=None)


@pytest.mark.parametrize("kw", [
    dict(ep=1, nodes=1, ranks_per_node=1, gpu="H200", launch_env=None),  # the one-GPU recipe
    H200_EP,  # EP 8 inside a node
    dict(H200_EP, ep=8, virtual_node_size=2, launch_env={}),  # 2x... virtual nodes: the network hop
    dict(H200_EP, dispatch_dtype="fp8"),  # rows quantised once, at the sender
    dict(H200_EP, dispatch_dtype="fp8", combine_grad_dtype="fp8"),
    dict(H200_EP, gpu="NVIDIA H100 80GB HBM3", num_sms=20),
    dict(H200_EP, converters=("quantize.linear.float8",)),  # the dense linears' converter is another matter
])
def test_fp8_experts_run_on_hopper_through_nvshmem(kw):
    assert NvshmemBackend.check_run(plan(expert_dtype="fp8", **kw)) == []


def test_fp8_experts_on_an_unknown_gpu_is_a_note():
    notes = NvshmemBackend.check_run(plan(expert_dtype="fp8", **dict(H200_EP, gpu="")))
    assert any('expert_dtype = "fp8"' in n and "Hopper" in n for n in notes)


@pytest.mark.parametrize("kw, words", [
    (dict(gpu="B200"), ['expert_dtype = "fp8"', "Hopper", "B200", "quantize.grouped_mm.mx", 'expert_dtype = "bf16"']),
    (dict(H200_EP, converters=("quantize.grouped_mm.float8",)), ["quantize.grouped_mm.float8", "choose one"]),
    (dict(H200_EP, converters=("quantize.grouped_mm.mx",)), ["quantize.grouped_mm.mx", "choose one"]),
    (dict(H200_EP, overlap="chunked"), ['overlap = "chunked"', 'overlap = "none"']),
    (dict(H200_EP, dual_pipe_v=True), ["DualPipeV", 'overlap = "none"']),
    (dict(H200_EP, param_dtype="float32"), ["mixed_precision_param", "bfloat16"]),
    (dict(H200_EP, hidden=7000), ["hidden", "7000", "multiple of 16"]),
    (dict(H200_EP, hidden=9216), ["9216", "8192"]),
])
def test_fp8_experts_refused_naming_the_field(kw, words):
    with pytest.raises(RecipeError) as e:
        NvshmemBackend.check_run(plan(expert_dtype="fp8", **kw))
    for word in words:
        assert word in str(e.value), f"{word!r} not in {str(e.value)!r}"


def test_fp8_experts_refused_on_cpu_and_by_backends_that_cannot_feed_them():
    from moe_comm import fp8_experts

    cpu = plan(expert_dtype="fp8", **dict(H200_EP, device="cpu", gpu=""))
    with pytest.raises(RecipeError, match='needs CUDA'):  # the nvshmem backend's own rule comes first
        NvshmemBackend.check_run(cpu)
    with pytest.raises(RecipeError, match=r'expert_dtype = "fp8".*on cpu.*expert_dtype = "bf16"'):
        fp8_experts.check_run(cpu)
    for name in ("nccl", "deepep"):
        with pytest.raises(RecipeError, match=r'backend = "{}" cannot feed them: set backend = "nvshmem"'.format(name)):
            backend_class(name).check_run(plan(name, expert_dtype="fp8", num_sms=20,
                                               python_env="[cluster] container_image = 'img'"))


def test_fp8_combine_backward_is_the_nvshmem_backends_only():
    for name in ("nccl", "deepep"):
        with pytest.raises(RecipeError, match='combine_grad_dtype = "fp8" is the nvshmem backend'):
            backend_class(name).check_run(plan(name, combine_grad_dtype="fp8", num_sms=20,
                                               python_env="[cluster] container_image = 'img'"))
    for kw, word in ((dict(param_dtype="float32"), "mixed_precision_param"), (dict(hidden=2000), "2000")):
        with pytest.raises(RecipeError, match=word):
            NvshmemBackend.check_run(plan(combine_grad_dtype="fp8", **kw))


def test_unknown_gpu_is_checked_against_the_largest_and_said_so():
    notes = NvshmemBackend.check_run(plan(gpu="", num_sms=140))
    assert any("148 SMs" in n for n in notes)
    assert NvshmemBackend.check_run(plan(gpu_sms=132, gpu="NVIDIA H200")) == []


def test_unknown_launch_environment_is_a_note_not_a_pass():
    notes = NvshmemBackend.check_run(plan(launch_env=None))
    assert any("InfiniBand settings not checked" in n for n in notes)


def test_fp8_dispatch_is_the_nvshmem_backends_only():
    for name in ("nccl", "deepep"):
        with pytest.raises(RecipeError, match='dispatch_dtype = "fp8" is the nvshmem backend'):
            backend_class(name).check_run(plan(name, dispatch_dtype="fp8", num_sms=20, python_env="[cluster] container_image = 'img'"))


def test_nccl_runs_anywhere():
    assert backend_class("nccl").check_run(plan("nccl", device="cpu", ep=2, ranks_per_node=2, nodes=1, num_experts=8)) == []


@pytest.fixture
def deep_ep_package(tmp_path, monkeypatch):
    """Put a stand-in `deep_ep` package on sys.path: V1 (Buffer.get_dispatch_layout) or V2."""
    def make(source: str):
        pkg = tmp_path / "deep_ep"
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    yield make
    sys.modules.pop("deep_ep", None)


def test_deepep_missing_says_how_to_build_the_pin():
    with pytest.raises(RecipeError) as e:
        DeepEPBackend.check_run(plan("deepep"))
    assert "from source" in str(e.value) and "v1.2.1" in str(e.value) and "python -m moe_comm build-deepep" in str(e.value)


def test_deepep_v2_is_refused_naming_the_pin(deep_ep_package):
    deep_ep_package("class ElasticBuffer:\n    pass\n")
    with pytest.raises(RecipeError, match=r"DeepEP V2 \(ElasticBuffer\).*get_dispatch_layout.*v1\.2\.1"):
        DeepEPBackend.check_run(plan("deepep"))


def test_deepep_v1_passes(deep_ep_package):
    deep_ep_package("class Buffer:\n    def get_dispatch_layout(self):\n        pass\n")
    assert DeepEPBackend.check_run(plan("deepep")) == []


def test_deepep_in_a_container_is_not_imported_here():
    notes = DeepEPBackend.check_run(plan("deepep", python_env="[cluster] container_image = 'nvcr.io#nvidia/pytorch:25.10-py3'"))
    assert any("container_image" in n and "not checked here" in n for n in notes)


@pytest.mark.parametrize("kw, words", [
    (dict(device="cpu"), ["needs CUDA"]),
    (dict(param_dtype="float32"), ['mixed_precision_param = "float32"', "fp32 rows"]),
    (dict(num_sms=21), ["num_sms = 21", "even"]),
    (dict(converters=("quantize.grouped_mm.mx",)), ["does not pad", "quantize.grouped_mm.mx"]),
    (dict(num_sms=150), ["num_sms = 150", "148"]),
    (dict(ep=1, nodes=1, ranks_per_node=1), ["expert_parallel_degree = 1", "no one-rank configuration", '"nvshmem"']),
    (dict(ep=12, nodes=2, ranks_per_node=6, num_experts=240), ["expert_parallel_degree = 12", "2, 4, 8, 16"]),
])
def test_deepep_refuses_what_its_kernels_assert_on(kw, words):
    with pytest.raises(RecipeError) as e:
        DeepEPBackend.check_run(plan("deepep", python_env="[cluster] container_image = 'img'", **kw))
    for word in words:
        assert word in str(e.value), f"{word!r} not in {str(e.value)!r}"


def test_deepep_refuses_non_bf16_rows_at_the_call():
    """fp32 rows at the layer API reached DeepEP's device assert (intranode.cu:235), which kills
    the CUDA context; the call is refused first, naming the dtype (no GPU or DeepEP needed: the
    check runs before DeepEP is touched)."""
    import torch

    backend = object.__new__(DeepEPBackend)  # no process group, no deep_ep: only the check runs
    x_TD = torch.zeros(4, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"deepep backend dispatch: rows are torch.float32; .* torch.bfloat16 only"):
        backend.dispatch(x_TD, torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"deepep backend combine: rows are torch.float16"):
        backend.combine(torch.zeros(8, 16, dtype=torch.float16), handle=None)
