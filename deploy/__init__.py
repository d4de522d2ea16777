"""Deployment: TensorRT lint, Triton Inference Server model repositories, Jetson presets."""
