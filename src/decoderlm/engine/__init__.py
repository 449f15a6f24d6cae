"""The continuous-batching inference engine over a paged KV pool, after vLLM's engine: requests in,
token events out (`Engine`; `EngineProcess` runs one in a child process; both are `EngineClient`s).
The HTTP server (`decoderlm.server`) and the searches (`decoderlm.search`) use it from above."""
