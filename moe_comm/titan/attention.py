"""Variable-length (block-causal) attention for DeepSeek-V3's MLA, from TorchTitan's own pieces.

TorchTitan 0.2.2 runs block-causal attention over packed documents two ways for llama3:
FlexAttention with a document mask, and variable-length attention - `VarlenAttentionWrapper`
(torch's `varlen_attn`, FlashAttention's varlen kernel, compiled) over the cumulative document
boundaries `create_varlen_metadata_for_document` cuts at each EOS and at each sequence's end.
Its deepseek_v3 model has sdpa and flex only (its `Attention` refuses "varlen"). Both kernels
compute the same thing: each token attends to the tokens of its own document up to itself.
Which is faster depends on the document lengths (experiments/layer_bench.py measures both at a
recipe's; moe_comm.predict.documents has the lengths).

`VarlenMLA` is TorchTitan's MLA `Attention` - same parameters, init, projections and rope, its
forward runs unchanged - whose attention kernel is `DocumentVarlenAttention`. Two things MLA needs
that llama3 does not:
  * v's head dim (128) is not q's and k's (192); FlashAttention's varlen kernel needs them equal,
    so v is zero-padded to q's head dim and the output's extra columns (zeros) cut off again;
  * TorchTitan's MLA forward hands a mask to its kernel only for flex, so `VarlenMLA.forward`
    gives the kernel the documents for the length of the call.

A flavor selects it with attn_type = "varlen" (moe_comm.layout.flavors registers a "_varlen"
twin of every flavor); `MoECommDeepSeekV3Model` builds its attention modules with
`use_varlen` and its masks with `varlen_documents`. What it cannot run is refused before launch
(moe_comm.layout.check_layout): CPU (FlashAttention is CUDA only), context parallelism, a mask
other than block_causal, TorchTitan's own deepseek_v3 model.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.attention import (
    create_varlen_metadata_for_document,
    VarlenAttentionWrapper,
    VarlenMetadata,
)
from torchtitan.models.deepseek_v3.model.model import Attention

VARLEN = "varlen"


def buildable_args(model_args):
    """Model args TorchTitan's DeepSeekV3Model can build from: attn_type "varlen" (which its
    `Attention` refuses) built as "sdpa", whose modules `use_varlen` then replaces. The field
    TorchTitan's update_from_config adds (moe_impl) is kept."""
    if model_args.attn_type != VARLEN:
        return model_args
    built = dataclasses.replace(model_args, attn_type="sdpa")
    if hasattr(model_args, "moe_impl"):
        built.moe_impl = model_args.moe_impl
    return built


class DocumentVarlenAttention(VarlenAttentionWrapper):
    """TorchTitan's VarlenAttentionWrapper as MLA's kernel: takes q, k, v as MLA lays them out
    ([batch, heads, seq, head dim]), pads v to q's head dim, and returns [batch, heads, seq, v's
    head dim] as MLA's forward expects. `documents` (VarlenMetadata) is set by VarlenMLA.forward
    for each call."""

    def __init__(self):
        super().__init__()
        self.documents: VarlenMetadata | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None):
        if self.documents is None:
            raise RuntimeError("DocumentVarlenAttention called without documents: VarlenMLA.forward sets them")
        bsz, _, seqlen, v_dim = v.shape
        qk_dim = q.shape[-1]
        if v_dim < qk_dim:  # FlashAttention's varlen kernel takes one head dim for q, k and v
            v = F.pad(v, (0, qk_dim - v_dim))
        out = super().forward(q, k, v, self.documents, scale=scale)  # [batch * seq, heads, qk_dim]
        return out[..., :v_dim].unflatten(0, (bsz, seqlen)).transpose(1, 2)


class VarlenMLA(Attention):
    """TorchTitan's MLA with variable-length block-causal attention (see the module docstring)."""

    def __init__(self, model_args):
        super().__init__(buildable_args(model_args))
        self.attn_type = VARLEN
        self.inner_attention = DocumentVarlenAttention()

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_masks, positions=None):
        if not isinstance(attention_masks, VarlenMetadata):
            raise TypeError(f"VarlenMLA needs the documents as VarlenMetadata (varlen_documents), got "
                            f"{type(attention_masks).__name__}")
        self.inner_attention.documents = attention_masks
        try:
            return super().forward(x, freqs_cis, None, positions)
        finally:
            self.inner_attention.documents = None


def use_varlen(model: nn.Module, model_args) -> None:
    """Replace every block's attention of a DeepSeekV3Model built from `buildable_args` with
    VarlenMLA, in the same slot (parameter names and order unchanged)."""
    for block in model.layers.values():
        block.attention = VarlenMLA(model_args)


def varlen_documents(model_args, input_batch: torch.Tensor, tokenizer) -> VarlenMetadata:
    """TorchTitan's document boundaries for a token batch (as its llama3 get_attention_masks)."""
    if model_args.attn_mask_type != "block_causal":
        raise ValueError(f'attn_type "varlen" is block-causal attention: it needs attn_mask_type "block_causal", '
                         f"not {model_args.attn_mask_type!r}")
    if tokenizer.eos_id is None:
        raise ValueError("varlen attention cuts documents at EOS, but the tokenizer has no eos_id")
    return create_varlen_metadata_for_document(input_batch, tokenizer.eos_id)
