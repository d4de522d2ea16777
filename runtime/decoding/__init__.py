"""Decoding over an Engine: sampling, generation, continuous batching, speculative decoding, chat sessions."""
