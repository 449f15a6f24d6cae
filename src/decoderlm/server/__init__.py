"""The OpenAI-compatible HTTP server and the playground, over an `EngineClient`
(`decoderlm.engine`): request JSON → engine parameters → token events → JSON or server-sent events."""
