"""The message pump: admission, scheduling, handler calls, responses, recovery.

Other packages use `Pump` (and `SubmitResult`, `CORE`, `DeliverFn`); the modules
inside are the pump's own. See docs/architecture.md, "Module map", for who owns
which decision.
"""

from agentd.pump.batch import DeliverFn
from agentd.pump.message import CORE, Message, MsgKind, SubmitResult
from agentd.pump.pump import Pump

__all__ = ["CORE", "DeliverFn", "Message", "MsgKind", "Pump", "SubmitResult"]
