"""What the project predicts before anything runs, and how it knows.

The modules, bottom to top (each imports only modules listed before it):
  assumptions   read figures (datasheets, public measurements), each with its source
  documents     the document lengths of a recipe's dataset, and the pairs block-causal attention keeps
  schedule      the pipeline schedules: stages per rank, bubble, microbatch-stages in flight
  routing_plan  which rows a dispatch moves over NVLink and the network, and their bytes
  estimate      parameters, flops per token, per-GPU memory
  layer_compute one rank's compute per microbatch from the one-GPU layer benchmark
  calibration   the measured constants, fitted from the files in results/model_inputs
  scale_model   the step model: MoE transfers per backend, the step's terms, tokens/s and MFU
  validation    the model against every measured figure (results/model_inputs/scale_model_validation.json)
  plan          the layouts a recipe could run on a cluster, ranked per backend (`python -m moe_comm plan`)
"""
