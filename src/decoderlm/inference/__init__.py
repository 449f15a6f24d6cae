"""Inference: sampling, generation over a KV cache, streaming text, evaluation."""
