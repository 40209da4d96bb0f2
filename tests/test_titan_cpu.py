"""The CPU adaptations and the DeepEP install hint."""

import pytest
import torch

import moe_comm.titan  # noqa: F401  applies the CPU adaptations on this CUDA-less machine
from moe_comm.backends import deepep


def test_histc_counts_int64_ids_like_cuda():
    ids = torch.tensor([0, 2, 2, 5, 7, 7, 7], dtype=torch.int64)
    counts = torch.histc(ids, bins=8, min=0, max=8)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [1, 0, 2, 0, 0, 1, 0, 3]


def test_titan_sees_cpu_device():
    import torchtitan.distributed.utils
    import torchtitan.tools.utils

    assert torchtitan.tools.utils.device_type == "cpu"
    assert torchtitan.distributed.utils.device_module.current_device() == 0


def test_train_specs_registered():
    from torchtitan.models.deepseek_v3 import deepseekv3_args
    from torchtitan.protocols.train_spec import get_train_spec

    from moe_comm import metrics
    from moe_comm.titan.model import MoECommDeepSeekV3Model

    spec = get_train_spec("deepseek_v3_moe_comm")
    assert spec.model_cls is MoECommDeepSeekV3Model
    assert spec.build_metrics_processor_fn is metrics.build_metrics_processor
    assert "671B_layers" in spec.model_args and "671B_layers" in deepseekv3_args
    assert get_train_spec("deepseek_v3_titan").model_cls.__name__ == "DeepSeekV3Model"


def test_deepep_missing_says_build_from_source():
    with pytest.raises(ImportError) as e:
        deepep._import_titan_deepep()
    assert "from source" in str(e.value) and "PyPI" in str(e.value)
