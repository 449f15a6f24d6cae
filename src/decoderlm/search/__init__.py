"""Test-time compute: search strategies over a language model for the reasoning tasks of
`decoderlm.tasks` (`strategies`), the model as they call it (`lm`), and scoring a strategy on a
task's problems (`evaluate`)."""

STRATEGY_NAMES = ("self-consistency", "best-of-n", "beam", "step-beam", "mcts")
