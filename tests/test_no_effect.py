"""`check`, `submit` and `train` say when a [moe_comm] setting has no effect (issue 25 item 5):
each backend class says which options it ignores for a run (`ignored_options`), and a recipe
that sets one gets a warning naming the backends that read it. A setting that would make the
run mislead (FP8 dispatch on a backend that sends bf16) is refused instead."""

from pathlib import Path

import pytest

from moe_comm import recipe
from moe_comm.__main__ import main
from moe_comm.backends.deepep import DeepEPBackend
from moe_comm.backends.nccl import NcclBackend
from moe_comm.backends.nvshmem import NvshmemBackend
from moe_comm.errors import RecipeError
from test_backend_checks import plan

REPO = Path(__file__).resolve().parents[1]
DEBUG = "recipes/debug_cpu.toml"
GPU = dict(device="cuda", check_paths=False)


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def test_what_each_backend_reads():
    assert set(NcclBackend.ignored_options(plan("nccl"))) == set(NcclBackend.OPTIONS)
    assert set(DeepEPBackend.ignored_options(plan("deepep"))) == set(DeepEPBackend.OPTIONS) - {"num_sms"}
    assert NvshmemBackend.ignored_options(plan()) == {}  # EP 32 over 4 nodes: every option counts
    one_node = NvshmemBackend.ignored_options(plan(ep=8, nodes=1, virtual_node_size=8))
    assert set(one_node) == {"network_sms", "virtual_node_size"}
    assert NvshmemBackend.ignored_options(plan(ep=8, nodes=1, virtual_node_size=4)) == {}  # 2 virtual nodes
    # EP 1: the backend serves the layers' local layout, so its SM budget, buffers and dtype count
    assert set(NvshmemBackend.ignored_options(plan(ep=1, nodes=1, ranks_per_node=1))) == {"network_sms"}


def test_an_option_the_backend_ignores_is_a_warning_naming_who_reads_it():
    r = recipe.load(DEBUG, ["--moe_comm.num_sms", "24", "--moe_comm.wait_timeout_s", "5"], device="cpu")
    assert r.warnings == [
        '[moe_comm] num_sms = 24 has no effect here: backend "nccl" is TorchTitan\'s own path, which has no '
        "such setting; nvshmem and deepep read it",
        '[moe_comm] wait_timeout_s = 5.0 has no effect here: backend "nccl" is TorchTitan\'s own path, which has '
        "no such setting; nvshmem reads it",
    ]
    deepep = recipe.load(DEBUG, ["--moe_comm.backend", "deepep", "--moe_comm.max_tokens_per_rank", "1024",
                                 "--training.mixed_precision_param", "bfloat16", "--cluster.container_image", "img"],
                         **GPU)
    (warning,) = deepep.warnings
    assert warning.startswith("[moe_comm] max_tokens_per_rank = 1024 has no effect here: backend \"deepep\"")
    nvshmem = recipe.load(DEBUG, ["--moe_comm.backend", "nvshmem", "--moe_comm.network_sms", "4"], **GPU)
    (warning,) = nvshmem.warnings
    assert "network_sms = 4 has no effect here: the EP group of 2 rank(s) stays within one node" in warning
    # on virtual nodes the network hop exists, and network_sms drives it
    assert recipe.load(DEBUG, ["--moe_comm.backend", "nvshmem", "--moe_comm.network_sms", "4",
                               "--moe_comm.virtual_node_size", "1"], **GPU).warnings == []


def test_unset_options_and_read_options_say_nothing():
    assert recipe.load(DEBUG, device="cpu").warnings == []
    assert recipe.load(DEBUG, ["--moe_comm.backend", "nvshmem", "--moe_comm.num_sms", "24",
                               "--moe_comm.dispatch_dtype", "fp8", "--training.mixed_precision_param", "bfloat16"],
                       **GPU).warnings == []


def test_fp8_dispatch_on_a_bf16_backend_is_refused():
    """A run named and compared as FP8 dispatch that sends bf16 would mislead: refused."""
    with pytest.raises(RecipeError, match=r'dispatch_dtype = "fp8" is the nvshmem backend\'s'):
        recipe.load(DEBUG, ["--moe_comm.dispatch_dtype", "fp8"], device="cpu")


def test_fp8_experts_and_combine_backward_on_a_bf16_backend_are_refused():
    """The recipe's own check (before any process starts) says which field and what to set."""
    with pytest.raises(RecipeError, match=r'expert_dtype = "fp8".*backend = "nccl" cannot feed them'):
        recipe.load(DEBUG, ["--moe_comm.expert_dtype", "fp8"], device="cpu")
    with pytest.raises(RecipeError, match=r'combine_grad_dtype = "fp8" is the nvshmem backend\'s'):
        recipe.load(DEBUG, ["--moe_comm.combine_grad_dtype", "fp8"], device="cpu")


@pytest.mark.parametrize("verb,prefix", [("check", "warning     "), ("train", "moe_comm: warning: "),
                                         ("submit", "submit: warning: ")])
def test_every_verb_prints_the_warning(verb, prefix, capsys, tmp_path):
    extra = [] if verb == "check" else ["--dry-run"]
    assert main([verb, DEBUG, *extra, "--job.dump_folder", str(tmp_path), "--moe_comm.num_sms", "24"]) == 0
    out = capsys.readouterr()
    assert f"{prefix}[moe_comm] num_sms = 24 has no effect here" in out.out + out.err
