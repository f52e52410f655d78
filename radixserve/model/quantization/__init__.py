"""Pre-quantized checkpoints (FP8, AWQ, GPTQ, compressed-tensors) and `--quantization fp8`.

Owns: reading `quantization_config` (config.py), turning each format's tensors into one
canonical quantized weight (formats.py, packing.py), the CPU and GPU GEMMs on it (linear.py,
cpu_kernel.py, csrc/quant_gemm.cpp; triton_kernels/quant_gemm.py), and a MoE layer's experts
stacked per layer (experts.py; their kernels: csrc/moe/moe_quant.cpp,
triton_kernels/fused_moe_quant.py). Does not know: the model's
layers beyond a linear layer's checkpoint name, requests, the scheduler.
"""
