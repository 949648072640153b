"""HF transformers baselines for the throughput benchmark: sequential `generate`, static padded
batches, and transformers' own continuous batching (`generate_batch` and the manager behind it).
"""

from __future__ import annotations

import time

import torch

from bench.workload import MODEL, ModeResult, Workload

EOS_DISABLED = -1  # transformers continuous batching: no EOS token


def load_hf_model():
    from transformers import AutoModelForCausalLM

    from engine.models.registry import resolve_model

    path = resolve_model(MODEL)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model


def _unreachable_eos(model) -> int:
    """An EOS id the model can never emit: `generate` then runs exactly max_new_tokens and, unlike
    min_new_tokens, never masks the real EOS out of the argmax (the engine's ignore_eos). The
    attention mask is always passed explicitly, so HF does not infer one from pad != eos."""
    return int(model.config.vocab_size)


def eos_id(model) -> int:
    eos = model.generation_config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    return int(eos if eos is not None else model.config.eos_token_id)


@torch.inference_mode()
def run_hf_seq(model, wl: Workload, limit: int | None) -> ModeResult:
    res = ModeResult("hf_seq")
    eos = eos_id(model)

    def gen(prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=_unreachable_eos(model),
            pad_token_id=eos,
        )
        return out[0, len(prompt) :].tolist()

    gen(wl.prompts[0][:16], 4)  # warm-up
    n = len(wl.prompts) if limit is None else min(limit, len(wl.prompts))
    t0 = time.perf_counter()
    for i in range(n):
        res.outputs[i] = gen(wl.prompts[i], wl.out_lens[i])
    res.seconds = time.perf_counter() - t0
    res.tally(wl)
    if n < len(wl.prompts):
        res.extrapolated = True
        res.notes.append(
            f"timed the first {n} of {len(wl.prompts)} requests; tokens/s extrapolated to all"
        )
    return res


@torch.inference_mode()
def run_hf_static(model, wl: Workload, batch_size: int) -> ModeResult:
    res = ModeResult("hf_static")
    eos = eos_id(model)
    computed = 0
    t0 = None
    for warm in (True, False):
        if not warm:
            t0 = time.perf_counter()
        indices = list(range(len(wl.prompts)))
        batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
        if warm:
            batches = [[0, 1]]
        for batch in batches:
            prompts = [wl.prompts[i][:16] if warm else wl.prompts[i] for i in batch]
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), eos, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for row, p in enumerate(prompts):  # left padding
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            new = 4 if warm else max(wl.out_lens[i] for i in batch)
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                eos_token_id=_unreachable_eos(model),
                pad_token_id=eos,
            )
            if warm:
                continue
            computed += len(batch) * new
            for row, i in enumerate(batch):
                res.outputs[i] = out[row, width : width + wl.out_lens[i]].tolist()
    res.seconds = time.perf_counter() - t0
    res.tally(wl)
    res.notes.append(
        f"batch {batch_size}, left padding; {computed} tokens generated, "
        f"{res.output_tokens} useful ({res.output_tokens / computed:.0%})"
    )
    return res


@torch.no_grad()  # not inference_mode: the CB thread updates its static tensors in place
def run_hf_cb(model, wl: Workload) -> ModeResult:
    """transformers' continuous batching. `generate_batch` takes one max_new_tokens for all
    requests, so the manager behind it is driven directly: one `add_request` per request with its
    own max_new_tokens and EOS disabled. Falls back to `generate_batch` with the longest length
    (extra tokens discarded, not counted) when that API is missing."""
    from transformers import GenerationConfig

    res = ModeResult("hf_cb")
    eos = eos_id(model)
    max_new = max(wl.out_lens)
    gen_cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max_new, eos_token_id=EOS_DISABLED, pad_token_id=eos
    )
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(
            max_prompt_length=max(len(p) for p in wl.prompts),
            max_generated_length=max_new,
            num_requests=len(wl.prompts),
        )
        t_setup = time.perf_counter()
        manager = model.init_continuous_batching(generation_config=gen_cfg, workload_hints=hints)
        manager.warmup()
        manager.start()
    except (ImportError, AttributeError, TypeError) as e:
        res.notes.append(f"manager API unavailable ({e!r}); generate_batch, uniform length")
        return _run_hf_cb_generate_batch(model, wl, gen_cfg, res)
    cfg = manager.continuous_batching_config
    setup = time.perf_counter() - t_setup
    try:
        # Warm-up request, not timed.
        manager.add_request(wl.prompts[0][:16], "warm", max_new_tokens=4, eos_token_id=EOS_DISABLED)
        _collect(manager, {"warm"})
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(wl.prompts, wl.out_lens, strict=True)):
            manager.add_request(prompt, f"r{i}", max_new_tokens=n, eos_token_id=EOS_DISABLED)
        results = _collect(manager, {f"r{i}" for i in range(len(wl.prompts))})
        res.seconds = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
        manager.destroy()
    for i in range(len(wl.prompts)):
        res.outputs[i] = list(results[f"r{i}"].generated_tokens)
    res.tally(wl)
    res.notes.append(
        f"per-request max_new_tokens via the generate_batch manager; attn "
        f"{model.config._attn_implementation}, page_size={cfg.page_size} "
        f"num_blocks={cfg.num_blocks} max_batch_tokens={cfg.max_batch_tokens} "
        f"max_requests_per_batch={cfg.max_requests_per_batch}; "
        f"setup+warmup {setup:.1f}s (excluded)"
    )
    if res.output_tokens != wl.num_output_tokens:
        res.notes.append(f"WARNING: generated {res.output_tokens}, wanted {wl.num_output_tokens}")
    return res


def _collect(manager, wanted: set[str], timeout_s: float = 3600.0) -> dict:
    results = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(wanted):
        if time.monotonic() > deadline:
            raise TimeoutError(f"continuous batching: {len(results)}/{len(wanted)} finished")
        r = manager.get_result(timeout=1)
        if r is None:
            if not manager.is_running():
                raise RuntimeError("continuous batching thread stopped")
            continue
        if r.is_finished() and r.request_id in wanted:
            if r.error is not None:
                raise RuntimeError(f"request {r.request_id} failed: {r.error}")
            results[r.request_id] = r
    return results


def _run_hf_cb_generate_batch(model, wl: Workload, gen_cfg, res: ModeResult) -> ModeResult:
    model.generate_batch(inputs=[wl.prompts[0][:16]], generation_config=gen_cfg)  # warm-up
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=wl.prompts, generation_config=gen_cfg)
    res.seconds = time.perf_counter() - t0
    for i, r in enumerate(out.values()):
        res.outputs[i] = list(r.generated_tokens)[: wl.out_lens[i]]
    res.tally(wl)
    return res


# ---- correctness -------------------------------------------------------------------------
