#!/usr/bin/env bash
# Ran on 2026-12-05 (session 25) on the tree eb1d9fa (branch row-kernels, merged into main after), carrying [".whl"]; what it printed: results/h200x1/README.md, twenty-fifth session.
# Device call prepared in session 21 (2026-12-04, no device lent that session): the layer bench's
# FP8 experts parts at the flagship rank's rows again, with what ships since run 39 measured them
# (the work beside the grouped GEMMs in the backward, dispatch's backward without zero-filled
# gradients, group_columns in chunks, and run 64's row kernels if merged), so that the flagship's
# and the MXFP8 recipe's predictions are regenerated from them (issue 35, "Done when"). As run 39:
# the file's flagship experts.moe_comm_fp8* parts removed first, bf16's beside them in the same run
# (the prelude's fp8_experts_bench). Then (added in session 22) the flagship's output projection +
# loss again, eager and with the loss compiled as TorchTitan's [compile] components "loss" compiles
# it, in the same run (bench_again): what compiling the loss would give the flagship's last stage.
# About 4 minutes. Afterwards, on the CPU machine: copy layer_bench.json over
# results/model_inputs/layer_bench_h200x1.json, append the command to its MANIFEST.json entry, and
# regenerate the recipes' PREDICTED lines and results/scale_model.md (experiments/scale_model.py).
source experiments/device_prelude.sh run66
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
if [ $rc -ne 0 ]; then pack; exit 1; fi
fp8_experts_bench $o/layer_bench.json
pack
bench_again $o/layer_bench.json output_loss
grep -E "output_loss" $o/layer_bench.md | cut -c1-200
pack
