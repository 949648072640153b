"""A plain-dict snapshot of the engine's memory and scheduling state (playground, metrics)."""

from __future__ import annotations


def kv_utilization(engine) -> tuple[int, int]:
    """(tokens stored, slots allocated) over used blocks; a shared block counts once."""
    bs = engine.kv.block_size
    filled: dict[int, int] = {}
    for request, table in engine.kv.block_tables.items():
        for i, block in enumerate(table):
            n = min(bs, max(0, request.num_computed_tokens - i * bs))
            filled[block] = max(filled.get(block, 0), n)
    return sum(filled.values()), len(filled) * bs


NO_GRAMMAR = dict(num_matchers=0, drafts_cut=0, seconds=0.0, compiled=0, cache_hits=0, cache_size=0)


def grammar_state(grammar) -> dict:
    if grammar is None:
        return dict(NO_GRAMMAR)
    return {
        "num_matchers": grammar.num_matchers,
        "drafts_cut": grammar.num_drafts_cut,
        "seconds": grammar.seconds,
        "compiled": grammar.compiler.num_compiled,
        "cache_hits": grammar.compiler.num_hits,
        "cache_size": grammar.compiler.cache_len,
    }


def lora_state(engine) -> dict:
    """Loaded adapters and which one sits in each slot (target model)."""
    slots = engine.runner.lora_slots
    return {
        "enabled": slots is not None,
        "loaded": list(engine.adapters),
        "slots": [a.name if a else None for a in slots.resident[1:]] if slots else [],
        "slot_loads": slots.num_loads if slots else 0,
    }


def snapshot(engine) -> dict:
    """summary() with every request's block table and the end of its text, and every block in
    use or cached (what the playground draws; a tenant's view: engine.entrypoints.tenancy)."""
    kv, pool = engine.kv, engine.kv.pool
    requests = [
        {
            "request_id": request.request_id,
            "index": request.index,
            "status": request.status.name,
            "num_tokens": request.num_tokens,
            "num_computed_tokens": request.num_computed_tokens,
            "num_cached_tokens": max(0, request.num_cached_tokens),
            "block_table": list(table),
            "spec": engine.speculation.describe_request(request),
            "constraint": request.grammar.kind if request.grammar is not None else None,
            "lora": request.lora.name if request.lora is not None else None,
            "tail_token_ids": request.token_ids[-48:],  # its text's end (prompt, output so far)
        }
        for request, table in kv.block_tables.items()
    ]
    blocks = {
        b: {
            "ref_count": pool.ref_counts[b],
            "hash": pool.block_hashes[b].hex()[:16] if pool.block_hashes[b] else None,
        }
        for b in range(1, pool.num_blocks)
        if pool.ref_counts[b] > 0 or pool.block_hashes[b] is not None
    }
    return summary(engine) | {"requests": requests, "blocks": blocks}


def summary(engine) -> dict:
    """The engine's counters and gauges, without a walk over its requests and blocks (what
    /metrics and a replica's report read)."""
    kv, pool, sched = engine.kv, engine.kv.pool, engine.scheduler
    stored, allocated = kv_utilization(engine)
    return {
        "block_size": kv.block_size,
        "num_blocks": pool.num_usable,
        "num_free_blocks": pool.num_free,
        "num_cached_free_blocks": pool.num_cached_free,
        "num_used_blocks": pool.num_usable - pool.num_free,
        "prefix_cache": {
            "query_tokens": kv.num_query_tokens,
            "hit_tokens": kv.num_hit_tokens,
            "hit_rate": kv.num_hit_tokens / kv.num_query_tokens if kv.num_query_tokens else 0.0,
            "evictions": pool.num_evictions,
        },
        "num_waiting": len(sched.waiting),
        "num_running": len(sched.running),
        "num_preemptions": sched.num_preemptions,
        "kv_tokens_stored": stored,
        "kv_slots_allocated": allocated,
        "kv_utilization": stored / allocated if allocated else 1.0,
        "kv_cache_dtype": str(engine.runner.kv_caches.dtype).removeprefix("torch."),
        "kv_bytes_per_token": engine.kv_bytes_per_token,  # target and draft, scales included
        "num_steps": engine.num_steps,
        "num_overlapped_steps": engine.pipeline.num_overlapped_steps,
        "num_request_errors": engine.num_request_errors,
        "num_generated_tokens": engine.num_generated_tokens,
        "grammar": grammar_state(engine.grammar),
        "lora": lora_state(engine),
        "speculation": engine.speculation.describe(engine.config.spec_method),
    }
