"""Serving: a continuous-batching engine over a paged KV pool, and an OpenAI-compatible HTTP app."""
