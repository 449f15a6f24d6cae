"""User-facing errors.

Anything a user can cause (a bad config value, a missing file, a corrupt checkpoint) raises a
`DecoderLMError` with a one-line message naming the value and what is allowed. The CLI prints it as
`decoderlm: error: <message>` and exits with status 2, without a traceback.
"""


class DecoderLMError(Exception):
    """An error caused by user input; its message is shown to the user as one line."""


class ConfigError(DecoderLMError, ValueError):
    """A configuration field has a value that is not allowed."""


class NonFiniteLossError(DecoderLMError):
    """Training stopped at `step` (1-based) because its loss was not finite (`loss`)."""

    def __init__(self, message: str, step: int, loss: float) -> None:
        super().__init__(message)
        self.step, self.loss = step, loss
