"""Semantic routing: core `intent` {text} -> the best permitted listener -> its
payload filled by a model -> dispatched as the sender's own output.

- `permitted`, `select`, `Ranker`, `Ranking` (`_ranking`): mask, then rank;
- `fill_prompt`, `read_fill` (`_filler`): the form filler's prompt and how its
  reply is read;
- `evaluate` (`_evaluation`): a labelled file of intents -> accuracy and abstain
  rate per profile (`agentd eval-routes`);
- `SemanticRouter` (`_router`): the pump's intent resolver and the ranking behind
  `agentctl introspect route`.
"""

from agentd.semantic._evaluation import (
    Labelled,
    ProfileScore,
    evaluate,
    read_labelled,
    routing_for_evaluation,
)
from agentd.semantic._filler import Filled, fill_prompt, read_fill
from agentd.semantic._ranking import Ranker, Ranking, candidate_text, permitted, select
from agentd.semantic._router import SemanticRouter, settings_of

__all__ = [
    "Filled",
    "Labelled",
    "ProfileScore",
    "Ranker",
    "Ranking",
    "SemanticRouter",
    "candidate_text",
    "evaluate",
    "fill_prompt",
    "permitted",
    "read_fill",
    "read_labelled",
    "routing_for_evaluation",
    "select",
    "settings_of",
]
