"""Test-time compute: search strategies that spend a budget of generated tokens on one prompt.

They live by family, each module naming its papers; this module gathers them:

- `self_consistency` and `best_of_n` (`decoderlm.search.sampling`): sample N whole solutions, take
  the majority answer (Wang et al., 2022) or the best by a scorer or a verifier (Cobbe et al., 2021);
- `beam_search` (`decoderlm.search.beam`): beam search over tokens, length-normalised (Wu et al.,
  2016), by the generated tokens or, as vLLM and the server, by the whole sequence;
- `step_beam_search` and `mcts` (`decoderlm.search.steps`): beam search and Monte Carlo tree search
  over reasoning steps (lines), guided by a verifier of partial solutions (Yao et al., 2023; Snell
  et al., 2024; Hao et al., 2023).

Every strategy takes a `budget` of generated tokens and never spends more, and returns a
`SearchResult` whose `tokens` is what it spent, exactly, so strategies compare at equal compute;
what they share (the solution format, candidates and results, `Budget`, the verifiers) is
`decoderlm.search.base`.
"""

from decoderlm.search.base import (
    SOLUTION_END,
    STEP_END,
    Budget,
    Candidate,
    Extract,
    SearchResult,
    Top,
    Verifier,
    oracle,
    process_oracle,
)
from decoderlm.search.beam import beam_search
from decoderlm.search.sampling import (
    Scorer,
    best_of_n,
    by_verifier,
    mean_logprob,
    sample_solutions,
    self_consistency,
)
from decoderlm.search.steps import mcts, step_beam_search

__all__ = [
    "SOLUTION_END",
    "STEP_END",
    "Budget",
    "Candidate",
    "Extract",
    "Scorer",
    "SearchResult",
    "Top",
    "Verifier",
    "beam_search",
    "best_of_n",
    "by_verifier",
    "mcts",
    "mean_logprob",
    "oracle",
    "process_oracle",
    "sample_solutions",
    "self_consistency",
    "step_beam_search",
]
