"""Pre-quantized checkpoints (FP8, AWQ, GPTQ, compressed-tensors) and `--quantization fp8`.

Owns: reading `quantization_config` (config.py), turning each format's tensors into one
canonical quantized weight (formats.py, packing.py), the CPU and GPU GEMMs on it (linear.py,
cpu_kernel.py, csrc/quant_gemm.cpp; triton_kernels/quant_gemm.py). Does not know: the model's
layers beyond a linear layer's checkpoint name, requests, the scheduler.
"""
