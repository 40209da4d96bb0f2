"""Model flavors this project adds to TorchTitan's `deepseekv3_args`.

"671B_layers" is DeepSeek-V3-671B's layer shape (hidden 7168, MLA with q_lora 1536, 128 heads,
sigmoid top-8 routing with node-limited groups, one shared expert, moe_inter_dim 2048) cut to
fit two H200s: 1 dense + 2 MoE layers with 64 routed experts instead of 58 + 256, and SDPA
causal attention instead of FlexAttention. Its training runs on 2xH200 (4 x 4096 tokens per
GPU, EP=2, no AC): results/README.md, "Training, 2×H200".

The one-GPU flavors keep the same layers and cut the expert count so that fp32 parameters,
AdamW moments and gradients (16 bytes per parameter, the bulk of a one-GPU step's memory) fit:
"671B_layers_1gpu" (an H200, 141 GB): 1 dense + 2 MoE layers of 32 experts, 5.7B parameters;
each expert then gets 2,048 rows of an 8,192-token batch, about half the 4,096 a flagship rank's
expert gets at EP 32. "671B_layers_1gpu_80gb" (an 80 GB H100): 1 dense + 1 MoE layer of 16.

"671B_layers_4gpu" (four H200s, recipes/deepseek_v3_671b_layers_h200x4.toml): 1 dense + 5 MoE
layers of 32 experts, so that at EP 4 a rank holds 8 routed experts per layer, as a flagship rank
does at EP 32, and the 6 layers with the embedding and the output make 8 pipeline units: PP 2
splits them as 2 stages of 4 (1F1B) or 4 of 2 (Interleaved1F1B, 2 per rank).
"""

import dataclasses

from torchtitan.models.deepseek_v3 import deepseekv3_args, DeepSeekV3ModelArgs
from torchtitan.models.moe import MoEArgs

FLAVORS = {
    "671B_layers": DeepSeekV3ModelArgs(
        vocab_size=129280,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=3,
        n_dense_layers=1,
        n_heads=128,
        moe_args=MoEArgs(
            num_experts=64,
            num_shared_experts=1,
            top_k=8,
            num_expert_groups=8,
            num_limited_groups=4,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            score_before_experts=False,
        ),
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        attn_type="sdpa",
        attn_mask_type="causal",
    ),
}


_LAYERS = FLAVORS["671B_layers"]
FLAVORS["671B_layers_1gpu"] = dataclasses.replace(
    _LAYERS, n_layers=3, moe_args=dataclasses.replace(_LAYERS.moe_args, num_experts=32)
)
FLAVORS["671B_layers_1gpu_80gb"] = dataclasses.replace(
    _LAYERS, n_layers=2, moe_args=dataclasses.replace(_LAYERS.moe_args, num_experts=16)
)
FLAVORS["671B_layers_4gpu"] = dataclasses.replace(
    _LAYERS, n_layers=6, moe_args=dataclasses.replace(_LAYERS.moe_args, num_experts=32)
)


VARLEN_SUFFIX = "_varlen"


def varlen_twin(args: DeepSeekV3ModelArgs) -> DeepSeekV3ModelArgs:
    """The flavor with block-causal variable-length attention (moe_comm.titan.attention): each
    token attends within its own document, as the flex flavors' block_causal mask does."""
    return dataclasses.replace(args, attn_type="varlen", attn_mask_type="block_causal")


def register() -> None:
    """Our flavors, and a "<flavor>_varlen" twin of every DeepSeek-V3 flavor (TorchTitan's and
    ours): "671B_varlen" is TorchTitan's 671B with variable-length instead of FlexAttention
    block-causal attention. A twin of an SDPA causal flavor (ours, "debugmodel") also changes its
    mask to block-causal. They run on our model ([model] name = "deepseek_v3_moe_comm") on GPUs."""
    for name, args in FLAVORS.items():
        deepseekv3_args.setdefault(name, args)
    for name, args in list(deepseekv3_args.items()):
        if not name.endswith(VARLEN_SUFFIX) and args.attn_type != "varlen":
            deepseekv3_args.setdefault(name + VARLEN_SUFFIX, varlen_twin(args))
