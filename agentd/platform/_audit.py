"""The audit seam: `audit(kind, thread, fields)` -> a journal entry in the kernel.

The platform reports every LLM call (with its prompt's SHA-256), budget refusals and
security events through one callable. `kernel_audit(kernel)` journals them: kind
`security` with direction `security`, everything else with direction `audit`; the
fields go in as canonical JSON. The commit is not awaited (the kernel batches); a
failed commit is logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentd.kernel import Kernel

log = logging.getLogger("agentd.platform.audit")


def kernel_audit(kernel: Kernel) -> Callable[[str, str, Mapping[str, Any]], None]:
    def audit(kind: str, thread: str, fields: Mapping[str, Any]) -> None:
        tx = kernel.transaction()
        tx.journal(
            thread=thread,
            direction="security" if kind == "security" else "audit",
            kind=f"llm.{kind}",
            handler=str(fields.get("agent", "")),
            sender="platform",
            tag=str(fields.get("event", kind)),
            payload=json.dumps(dict(fields), sort_keys=True, separators=(",", ":")).encode(),
        )
        kernel.commit(tx).add_done_callback(_logged)

    return audit


def _logged(fut: Any) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("audit record not journaled: %s", fut.exception())
