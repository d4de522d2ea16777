"""The engines: ONNX Runtime (CPU/CUDA), the CUDA GQA and paged engines, TensorRT."""
