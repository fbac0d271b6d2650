"""A kernel on the postgres backend in a process of its own, holding (or waiting for)
the organism's lease, committing one journal entry every 20 ms: what a daemon's
kernel does, without the rest of the daemon. Prints `ready EPOCH` once it holds the
lease and `ok SEQ` for each acknowledged commit; exits 3 when it lost the lease.

    python -m tests.lease_kernel DSN STATE_DIR NAME [--standby]
"""

from __future__ import annotations

import asyncio
import sys

from agentd.kernel import Kernel, KernelUnavailable


async def main(dsn: str, state_dir: str, name: str, standby: bool) -> int:
    lost = asyncio.Event()
    kernel = await Kernel.open(state_dir, dsn=dsn, lease="lease-test", standby=standby)
    kernel.on_lease_lost = lambda _why: lost.set()
    print(f"ready {kernel.lease_epoch}", flush=True)
    try:
        while not lost.is_set():
            tx = kernel.transaction()
            seq = tx.journal(thread=name, direction="in", handler="h", sender=name,
                             tag="{urn:t}m", payload=b"<m/>", profile="public")
            try:
                await kernel.commit(tx)
                print(f"ok {seq}", flush=True)
            except KernelUnavailable:
                pass
            await asyncio.sleep(0.02)
    finally:
        await kernel.close()
    print(f"lost {kernel.lease_lost}", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3],
                              "--standby" in sys.argv[4:])))
