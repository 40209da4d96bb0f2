"""experiments/fp8_row_kernels.py's shapes (its timings need a GPU: results/h200x1/raw/run42-44)."""

import pytest
import torch

from experiments import fp8_row_kernels as bench


def test_counts_are_a_draw_of_every_row_padded_to_the_alignment():
    counts, padded = bench.counts_of(65536, 32, 128, seed=0)
    assert sum(counts) == 65536 and len(counts) == 32
    assert all(p % 128 == 0 and c <= p < c + 128 for c, p in zip(counts, padded))
    assert len(set(counts)) > 1  # uneven, as a routing is
    assert bench.counts_of(65536, 32, 128, seed=0) == (counts, padded)


@pytest.mark.parametrize("pad", ["zero", "random"])
def test_rows_are_real_then_padding(pad):
    counts, padded = [3, 0, 5], [16, 0, 16]
    x = bench.rows_tensor(counts, padded, 8, 1.0, torch.device("cpu"), pad)
    assert x.shape == (32, 8) and x.dtype == torch.bfloat16
    real = torch.cat([x[0:3], x[16:21]])
    assert bool((real != 0).any())
    padding = torch.cat([x[3:16], x[21:32]])
    assert bool((padding == 0).all()) == (pad == "zero")


def test_it_says_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main([])
