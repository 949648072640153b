"""What one tenant sees of the engine's snapshot (issue 41). On a server with API keys each key
is a tenant, and a viewer (the playground's live views, /v1/snapshot) sees its own requests
whole (ids, block tables, the tail of their text, speculation, adapter) and, of the state all
tenants share, counts only: the pool's used / cached / free blocks, the prefix cache's hit
rate, the speculation, grammar and adapter totals. Another tenant's request is not there at
all, and no block is listed but those the viewer's own requests hold (a cached block's hash is
of whoever computed it). Without keys (one local user) the snapshot is shown whole."""

from __future__ import annotations

from collections.abc import Container


def tenant_view(snap: dict, owned: Container[str]) -> dict:
    """`snap` (engine.introspection.snapshot, or a summary without requests) as the tenant whose
    request ids are `owned` may see it."""
    requests = [r for r in snap.get("requests", ()) if r["request_id"] in owned]
    held = {b for r in requests for b in r["block_table"]}
    blocks = {b: info for b, info in snap.get("blocks", {}).items() if b in held}
    return snap | {"requests": requests, "blocks": blocks}
