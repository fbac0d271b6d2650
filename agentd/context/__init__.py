"""Context as virtual memory: an agent task's segments in tiers, the librarian that
moves them, fold summaries, durable long-term memory and the vectors both use.

- `Segment`, `Tier`, `Part`: the units of working memory (layer 5) and their tiers;
- `plan_tiers` (pure): the librarian's decision for the next call;
- `extract`, `facts`, `complete_with_facts` (pure): fold summaries that keep facts;
- `WorkingMemory`, `KernelSegmentLog`: a task's segments, written through;
- `replan`: the librarian's pass for one call, planned again while the measured
  request is over budget;
- `LongTermMemory`: layer 6, durable per agent, recalled by similarity;
- `TextVectors`, `ProviderVectors`, `HashedTerms`, `text_vectors`, `VectorIndex`:
  storable vectors (from `agentd.embeddings` or hashed terms) and exact search;
- `TokenCalibration`: token estimates per backend.
"""

from agentd.context._extract import complete_with_facts, extract, facts
from agentd.context._librarian import (
    EVICTED,
    EXPANDED,
    FOLDED,
    TIERS,
    Costs,
    LibrarianRules,
    Plan,
    plan_tiers,
)
from agentd.context._memory import LongTermMemory, MemoryRecord
from agentd.context._replan import Arrangement, Planned, replan
from agentd.context._segments import (
    ASSISTANT_PART,
    KINDS,
    NOTICE,
    NOTICE_PART,
    REPLY,
    RESULT_PART,
    TOOL,
    IntegrityError,
    Part,
    Segment,
    Tier,
    decode_parts,
    encode_parts,
    estimate_tokens,
)
from agentd.context._tokens import TokenCalibration
from agentd.context._vectors import (
    HashedTerms,
    ProviderVectors,
    TextVectors,
    VectorIndex,
    text_vectors,
)
from agentd.context._working import (
    KernelSegmentLog,
    NoSegmentLog,
    SegmentLog,
    WorkingMemory,
)

__all__ = [
    "ASSISTANT_PART",
    "EVICTED",
    "EXPANDED",
    "FOLDED",
    "KINDS",
    "NOTICE",
    "NOTICE_PART",
    "REPLY",
    "RESULT_PART",
    "TIERS",
    "TOOL",
    "Arrangement",
    "Costs",
    "HashedTerms",
    "IntegrityError",
    "KernelSegmentLog",
    "LibrarianRules",
    "LongTermMemory",
    "MemoryRecord",
    "NoSegmentLog",
    "Part",
    "Plan",
    "Planned",
    "ProviderVectors",
    "Segment",
    "SegmentLog",
    "TextVectors",
    "Tier",
    "TokenCalibration",
    "VectorIndex",
    "WorkingMemory",
    "complete_with_facts",
    "decode_parts",
    "encode_parts",
    "estimate_tokens",
    "extract",
    "facts",
    "plan_tiers",
    "replan",
    "text_vectors",
]
