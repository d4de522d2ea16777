"""enginesmith: Hugging Face causal LM -> ONNX -> inference engine."""
__version__ = "0.1.0"
