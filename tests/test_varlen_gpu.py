"""Variable-length MLA attention (moe_comm.titan.attention) against TorchTitan's FlexAttention
block-causal MLA on the GPU, at the flagship rank's shape: DeepSeek-V3-671B's MLA (128 heads, qk
192 / v 128, hidden 7168), one sequence of 4096 tokens packed from c4-like documents
(moe_comm.predict.documents, seed 0: several documents), bf16 parameters as FSDP runs them.

Tolerance, stated: both kernels compute in bf16 with fp32 accumulation, so they differ by
rounding only. The relative L2 difference (||a - b|| / ||b||) between the varlen and the flex
module's output, input gradient and every parameter gradient must stay below 2e-2 (a block-causal
mask confused with a causal one, or a v padding that leaks, differs by more than 0.1), and the
varlen module's own error against an fp32 reference (TorchTitan's MLA with fp32 weights, SDPA
causal document by document) must stay within 2x flex's error + 2e-3: varlen is as exact as
TorchTitan's own flex path."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

EOS, FILLER = 1, 7
SEQ = 4096


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def test_varlen_equals_flex_block_causal_at_the_flagship_shape():
    from torchtitan.models.deepseek_v3 import deepseekv3_args, DeepSeekV3Model
    from torchtitan.models.deepseek_v3.model.model import Attention, precompute_freqs_cis

    import moe_comm.titan  # noqa: F401  flavors
    from moe_comm.predict import documents
    from moe_comm.titan import attention

    assert torch.cuda.is_available(), "a GPU test: run it on the device"
    device = torch.device("cuda")
    torch.manual_seed(0)
    flex_args = dataclasses.replace(deepseekv3_args["671B"], max_seq_len=SEQ)
    varlen_args = dataclasses.replace(deepseekv3_args["671B_varlen"], max_seq_len=SEQ)
    assert (flex_args.attn_type, flex_args.attn_mask_type) == ("flex", "block_causal")

    pieces = documents.packed(documents.C4_EN, 1, SEQ, seed=0)
    assert len(pieces[0]) >= 4, pieces
    tokens = documents.token_batch(pieces, EOS, FILLER).to(device)
    tokenizer = type("Tokenizer", (), {"eos_id": EOS})()

    with torch.device(device):
        flex = Attention(flex_args)
        varlen = attention.VarlenMLA(varlen_args)
        exact = Attention(dataclasses.replace(flex_args, attn_type="sdpa", attn_mask_type="causal"))
        freqs = precompute_freqs_cis(flex_args)
    with torch.no_grad():
        flex.init_weights(0.02)
    varlen.load_state_dict(flex.state_dict())
    exact.load_state_dict(flex.state_dict())
    flex.to(torch.bfloat16)
    varlen.to(torch.bfloat16)
    exact.to(torch.float32)

    # the masks exactly as TorchTitan's models build them from the token batch
    block_mask = DeepSeekV3Model.get_attention_masks(type("M", (), {"model_args": flex_args})(), tokens, tokenizer)
    varlen_docs = attention.varlen_documents(varlen_args, tokens, tokenizer)
    assert varlen_docs.cu_seq_q.numel() == len(pieces[0]) + 1

    x = torch.randn(1, SEQ, flex_args.dim, device=device)
    grad = torch.randn(1, SEQ, flex_args.dim, device=device)

    def run(module, mask, dtype):
        xx = x.to(dtype).requires_grad_(True)
        module.zero_grad(set_to_none=True)
        if mask is None:  # fp32 reference: document by document, each with its rope positions
            rows, start = [], 0
            for d, _ in pieces[0]:
                rows.append(module(xx[:, start:start + d], freqs[start:start + d], None))
                start += d
            out = torch.cat(rows, dim=1)
        else:
            out = module(xx, freqs, mask)
        out.backward(grad.to(dtype))
        return out.detach(), xx.grad.detach(), {n: p.grad.detach() for n, p in module.named_parameters()}

    out_f, gx_f, gp_f = run(flex, block_mask, torch.bfloat16)
    out_v, gx_v, gp_v = run(varlen, varlen_docs, torch.bfloat16)
    out_e, gx_e, gp_e = run(exact, None, torch.float32)

    report = {"out": (_rel(out_v, out_f), _rel(out_v, out_e), _rel(out_f, out_e)),
              "grad x": (_rel(gx_v, gx_f), _rel(gx_v, gx_e), _rel(gx_f, gx_e))}
    for name in gp_f:
        report[f"grad {name}"] = (_rel(gp_v[name], gp_f[name]), _rel(gp_v[name], gp_e[name]), _rel(gp_f[name], gp_e[name]))
    lines = [f"{k}: varlen vs flex {a:.2e}, varlen vs fp32 {b:.2e}, flex vs fp32 {c:.2e}" for k, (a, b, c) in report.items()]
    print("\n".join(lines))
    bad = [line for line, (a, b, c) in zip(lines, report.values()) if not (a < 2e-2 and b <= 2 * c + 2e-3)]
    assert not bad, "\n".join(bad)
