"""Quantization stage: ModelOpt recipes, calibration, quantized-checkpoint export, accuracy and memory."""
