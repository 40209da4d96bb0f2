"""Everything that touches TorchTitan internals; recipes import it with
`[experimental] custom_import = "moe_comm.titan"`.

TorchTitan's trainer imports this module before it reads the device or starts the process
group, so importing it:
  0. routes TorchTitan's log: one console line per step, everything else in a per-rank log
     file (moe_comm.console);
     and starts the rank's heartbeat (moe_comm.heartbeat) when `moe_comm train` launched it;
  1. applies the CPU adaptations (moe_comm.titan.cpu) when CUDA is absent;
  2. adds our flavors ("671B_layers") to TorchTitan's deepseekv3_args, and a "<flavor>_varlen"
     twin of each with variable-length block-causal attention (moe_comm.titan.attention);
  3. registers two train specs:
     - "deepseek_v3_moe_comm": TorchTitan's deepseek_v3 spec with our model (token-level MoE),
       parallelize_fn (EP through the [moe_comm] backend), pipelining_fn (TorchTitan's, whose
       schedule overlaps microbatches under [moe_comm] overlap = "microbatch") and
       moe_comm.metrics' processor;
     - "deepseek_v3_titan": TorchTitan's own deepseek_v3 path, untouched except that on CPU FSDP
       reduces with SUM (gloo has no PREMUL_SUM), with moe_comm.metrics' processor (it only
       observes: its JSONL holds the exact losses). The bitwise test of the nccl backend compares against it.
"""

import dataclasses

import torch

from moe_comm import console, heartbeat

console.setup()
heartbeat.start()  # a rank of `moe_comm train`: liveness for hang reports, and die with torchrun

if not torch.cuda.is_available():
    from moe_comm.titan import cpu

    cpu.apply()

from torchtitan.models.deepseek_v3 import get_train_spec as _titan_dsv3_train_spec
from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
from torchtitan.protocols.train_spec import register_train_spec, TrainSpec

from moe_comm import metrics
from moe_comm.layout import flavors
from moe_comm.titan import data, pipeline
from moe_comm.titan.model import MoECommDeepSeekV3Model
from moe_comm.titan.parallelize import parallelize_deepseekv3_moe_comm

TRAIN_SPEC_NAME = "deepseek_v3_moe_comm"
REFERENCE_TRAIN_SPEC_NAME = "deepseek_v3_titan"


def _parallelize_titan_reference(model, parallel_dims, job_config):
    model = parallelize_deepseekv3(model, parallel_dims, job_config)
    if not torch.cuda.is_available():
        cpu.force_sum_reduction(model)
    return model


def get_train_spec() -> TrainSpec:
    return dataclasses.replace(
        _titan_dsv3_train_spec(),
        model_cls=MoECommDeepSeekV3Model,
        parallelize_fn=parallelize_deepseekv3_moe_comm,
        pipelining_fn=pipeline.pipeline_llm,
        build_metrics_processor_fn=metrics.build_metrics_processor,
        build_dataloader_fn=data.build_dataloader,  # TorchTitan's, naming a bad record (moe_comm.titan.data)
    )


def get_reference_train_spec() -> TrainSpec:
    return dataclasses.replace(_titan_dsv3_train_spec(), parallelize_fn=_parallelize_titan_reference,
                               build_metrics_processor_fn=metrics.build_metrics_processor)


# Python imports a module once, so this runs once per process.
flavors.register()
register_train_spec(TRAIN_SPEC_NAME, get_train_spec())
register_train_spec(REFERENCE_TRAIN_SPEC_NAME, get_reference_train_spec())
