"""The message pump: admission, scheduling, handler calls, responses, recovery.

Other packages use what is exported here; the modules inside are the pump's own
(see docs/architecture.md, "Module map", for which module owns which decision).
"""

from agentd.pump.batch import DeliverFn
from agentd.pump.message import (
    CORE,
    NO_CAPABILITY,
    IntentOutcome,
    IntentResolver,
    SubmitResult,
)
from agentd.pump.options import PumpOptions
from agentd.pump.pump import Pump

__all__ = [
    "CORE",
    "NO_CAPABILITY",
    "DeliverFn",
    "IntentOutcome",
    "IntentResolver",
    "Pump",
    "PumpOptions",
    "SubmitResult",
]
