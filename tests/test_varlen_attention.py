"""Variable-length MLA attention (moe_comm.titan.attention) on CPU.

FlashAttention's varlen kernel is CUDA only, so here a stand-in with the kernel's contract (one
head dim for q, k and v; window (-1, 0) = causal within each cumulative segment) checks the
wiring: v padded and cut again, the documents handed to the kernel, MLA's layout in and out.
The reference is TorchTitan's own MLA in SDPA causal mode run document by document with each
document's rope positions: block-causal attention by definition. The kernel itself is checked
against FlexAttention block-causal on the GPU (tests/test_varlen_gpu.py). Plus the flavor twins,
the model's masks and the recipe checks that refuse what cannot run."""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moe_comm.titan  # noqa: F401  (CPU adaptations, flavors)
from moe_comm import recipe
from moe_comm.predict import documents
from moe_comm.layout import flavors
from moe_comm.titan import attention

from torchtitan.models.attention import VarlenAttentionWrapper, VarlenMetadata
from torchtitan.models.deepseek_v3 import deepseekv3_args, DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model.model import Attention, precompute_freqs_cis
from torchtitan.models.moe import MoEArgs

EOS, FILLER = 1, 7


def tiny_args(**changes) -> DeepSeekV3ModelArgs:
    a = DeepSeekV3ModelArgs(
        vocab_size=64, dim=64, inter_dim=96, moe_inter_dim=32, n_layers=2, n_dense_layers=1, n_heads=4,
        moe_args=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True,
                         score_before_experts=False),
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        attn_type="varlen", attn_mask_type="block_causal", max_seq_len=48)
    a = dataclasses.replace(a, **changes)
    a.moe_impl = "standard"  # what TorchTitan's update_from_config sets
    return a


def stand_in_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **_):
    """The FlashAttention varlen kernel's contract, in SDPA per segment."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FlashAttention varlen needs one head dim for q, k and v"
    assert window_size == (-1, 0), "TorchTitan's wrapper asks for causal windows"
    assert torch.equal(cu_q, cu_k)
    bounds = cu_q.tolist()
    assert max(b - a for a, b in zip(bounds, bounds[1:])) == max_q
    out = []
    for a, b in zip(bounds, bounds[1:]):
        seg = [t[a:b].transpose(0, 1) for t in (q, k, v)]  # [heads, tokens, dim]
        out.append(F.scaled_dot_product_attention(*seg, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(out)


@pytest.fixture
def fake_kernel(monkeypatch):
    monkeypatch.setattr(VarlenAttentionWrapper, "_compiled_varlen_attn", staticmethod(stand_in_varlen))


def _pieces(seq_len: int, sequences: int):
    dist = documents.DocumentLengths("test", "test", lengths=(3, 5, 11, 17, 29))
    return documents.packed(dist, sequences, seq_len, seed=1)


def test_varlen_mla_equals_mla_run_document_by_document(fake_kernel):
    torch.manual_seed(0)
    a = tiny_args()
    B, S = 2, a.max_seq_len
    varlen = attention.VarlenMLA(a)
    with torch.no_grad():
        varlen.init_weights(0.02)
    ref = Attention(dataclasses.replace(a, attn_type="sdpa", attn_mask_type="causal"))
    ref.load_state_dict(varlen.state_dict())
    freqs = precompute_freqs_cis(a)
    pieces = _pieces(S, B)
    assert any(len(p) > 2 for p in pieces)  # several documents per sequence
    meta = attention.varlen_documents(a, documents.token_batch(pieces, EOS, FILLER), type("T", (), {"eos_id": EOS}))
    x = torch.randn(B, S, a.dim, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad = torch.randn(B, S, a.dim)

    out = varlen(x, freqs, meta)
    out.backward(grad)
    rows = []
    for b, p in enumerate(pieces):
        start = 0
        for d, _ in p:
            rows.append(ref(x_ref[b:b + 1, start:start + d], freqs[start:start + d], None))
            start += d
    out_ref = torch.cat(rows, dim=1).view(B, S, a.dim)
    out_ref.backward(grad)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(varlen.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert varlen.inner_attention.documents is None  # handed over for the call only


def test_varlen_mla_refuses_a_call_without_documents(fake_kernel):
    a = tiny_args()
    m = attention.VarlenMLA(a)
    with pytest.raises(TypeError, match="VarlenMetadata"):
        m(torch.randn(1, a.max_seq_len, a.dim), precompute_freqs_cis(a), None)
    with pytest.raises(RuntimeError, match="without documents"):
        m.inner_attention(torch.randn(1, 4, 8, 24), torch.randn(1, 4, 8, 24), torch.randn(1, 4, 8, 16))


def test_model_builds_varlen_attention_with_torchtitans_parameters(fake_kernel):
    from moe_comm.titan.model import MoECommDeepSeekV3Model

    a = tiny_args()
    model = MoECommDeepSeekV3Model(a)
    plain = MoECommDeepSeekV3Model(tiny_args(attn_type="flex"))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(isinstance(b.attention, attention.VarlenMLA) for b in model.layers.values())
    assert model.model_args.attn_type == "varlen"
    tokens = documents.token_batch(_pieces(a.max_seq_len, 2), EOS, FILLER)
    meta = model.get_attention_masks(tokens, type("T", (), {"eos_id": EOS}))
    assert isinstance(meta, VarlenMetadata) and meta.cu_seq_q[-1].item() == tokens.numel()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    logits = model(tokens, attention_masks=meta)  # TorchTitan's MoE forward (no backend attached)
    assert logits.shape == (2, a.max_seq_len, a.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="block_causal"):
        attention.varlen_documents(tiny_args(attn_mask_type="causal"), tokens, type("T", (), {"eos_id": EOS}))


def test_flavor_twins():
    flavors.register()
    base, twin = deepseekv3_args["671B"], deepseekv3_args["671B_varlen"]
    assert (twin.attn_type, twin.attn_mask_type) == ("varlen", "block_causal")
    assert dataclasses.replace(twin, attn_type=base.attn_type) == base  # nothing else differs
    ours = deepseekv3_args["671B_layers_1gpu_varlen"]
    assert (ours.attn_type, ours.attn_mask_type) == ("varlen", "block_causal")
    assert not any(name.endswith("_varlen_varlen") for name in deepseekv3_args)


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "r.toml"
    path.write_text(text)
    return str(path)


def _recipe(flavor: str, name: str = "deepseek_v3_moe_comm") -> str:
    text = (Path(__file__).resolve().parents[1] / "recipes" / "debug_cpu.toml").read_text()
    assert 'flavor = "debugmodel"' in text and 'name = "deepseek_v3_moe_comm"' in text
    return text.replace('flavor = "debugmodel"', f'flavor = "{flavor}"').replace(
        'name = "deepseek_v3_moe_comm"', f'name = "{name}"')


def test_recipe_refuses_varlen_where_it_cannot_run(tmp_path):
    from moe_comm.layout import check_layout

    with pytest.raises(recipe.RecipeError, match="CUDA only") as e:
        recipe.load(_write(tmp_path, _recipe("debugmodel_varlen")), device="cpu", check_paths=False)
    assert "[model] flavor" in str(e.value)
    with pytest.raises(recipe.RecipeError, match="has sdpa and flex") as e:
        recipe.load(_write(tmp_path, _recipe("debugmodel_varlen", "deepseek_v3_titan")), device="cuda",
                    check_paths=False)
    assert "[model] name" in str(e.value)
    config = recipe.load(_write(tmp_path, _recipe("debugmodel")), device="cpu", check_paths=False)
    layout = config.layout
    causal_varlen = dataclasses.replace(deepseekv3_args["debugmodel_varlen"], attn_mask_type="causal")
    with pytest.raises(recipe.RecipeError, match="attn_mask_type is 'causal'"):
        check_layout(config.config, layout, causal_varlen, "cuda")
    with pytest.raises(recipe.RecipeError, match="context_parallel_degree"):
        check_layout(config.config, dataclasses.replace(layout, cp=2), deepseekv3_args["debugmodel_varlen"], "cuda")
