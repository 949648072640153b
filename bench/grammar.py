"""Grammar-constrained decoding: what the masks cost, and what grammar-forced drafts save.

    python -m bench.grammar [--batches 1,16] [--max-tokens 160] [--repeats 3] [--no-hf]

SmolLM2-135M-Instruct, exact weights, one thread, greedy, prefix caching off, JSON-schema
prompts whose schemas have long fixed keys (the model is asked for one JSON object; the schema's
keys are also listed in the prompt, as users usually do). At batch 1 four requests run one at a
time; at batch b, b distinct requests run together. Modes, each its own engine:

- constrained: xgrammar masks only (no speculation, forced tokens off);
- unconstrained: the same prompts without a constraint, EOS ignored, each request generating
  exactly as many tokens as its constrained output had (same batch shapes, same token count);
- forced: constrained, grammar-forced tokens as free drafts (no proposer);
- forced+ngram: constrained, forced tokens plus n-gram prompt lookup (adaptive speculation);
- hf (batch 1, unless --no-hf): HF transformers `generate()` at its fastest measured setting
  (bench/hf_baselines.py's HF_FASTEST) with xgrammar's own HF logits processor, same grammars.

Fair by construction (bench/harness.py): constraints are compiled before any timing, every mode
is warmed up once on the same requests as its timed runs (the constrained warm-up also gives
unconstrained its token counts), then --repeats rounds alternate the modes; figures are medians
with their spread. forced, forced+ngram and hf must equal constrained token for token, else the
script exits 1 (RESULT is printed anyway). Counters are summed over each mode's own timed runs.

grammar_overhead = the share of the constrained runs' wall time spent in grammar work (masks,
commits; timed inside the engine, `engine.grammar.seconds`), worst batch size. The wall-time
A/B against unconstrained is printed too, but back-to-back runs of one mode on a shared machine
differ by more than the 1-2% the grammar costs; grammar_spec_speedup = median constrained /
median forced+ngram seconds (worst batch size); forced_token_share = forced tokens accepted /
output tokens in the forced+ngram runs. Last line:
    RESULT grammar_overhead=.. grammar_spec_speedup=.. forced_token_share=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import json
import time
from collections.abc import Callable

import torch

from bench.harness import Run, Timings, alternate, summary, unequal
from bench.hf_baselines import generate, load_hf_model

MODEL = "smollm2-135m-instruct"


def schema(keys: dict[str, dict]) -> dict:
    return {
        "type": "object",
        "properties": keys,
        "required": list(keys),
        "additionalProperties": False,
    }


SHORT = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "order": schema(
        {
            "customer_full_name": SHORT,
            "shipping_address_line": SHORT,
            "order_identifier": {"type": "integer", "minimum": 0},
            "requires_express_delivery": {"type": "boolean"},
            "number_of_items_ordered": {"type": "integer", "minimum": 1, "maximum": 99},
        }
    ),
    "profile": schema(
        {
            "user_display_name": SHORT,
            # A bounded pattern, not format "email": SmolLM2 loops inside an unbounded email
            # ("Dana@DreamDreamDream...") until max_tokens, and one such request sets the
            # length of a whole batch.
            "primary_email_address": {
                "type": "string",
                "pattern": "^[a-z0-9.]{1,16}@[a-z]{2,12}\\.(com|org|net)$",
            },
            "preferred_language_code": {"enum": ["en", "fr", "de", "es"]},
            "newsletter_subscription_enabled": {"type": "boolean"},
        }
    ),
    "server": schema(
        {
            "server_host_name": SHORT,
            "listening_port_number": {"type": "integer", "minimum": 1, "maximum": 65535},
            "maximum_concurrent_connections": {"type": "integer", "minimum": 1},
            "transport_layer_security_enabled": {"type": "boolean"},
            "log_verbosity_level": {"enum": ["debug", "info", "warning", "error"]},
        }
    ),
    "review": schema(
        {
            "reviewed_product_name": SHORT,
            "overall_star_rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "reviewer_would_recommend": {"type": "boolean"},
            "short_review_summary": {"type": "string", "maxLength": 60},
        }
    ),
}
SUBJECTS = ["Alice in Paris", "Bob in Berlin", "Chen in Shanghai", "Dana in Toronto"]


def requests(n: int) -> list[tuple[str, str]]:
    """n distinct (schema name, user message) pairs."""
    out = []
    for i in range(n):
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        subject = SUBJECTS[(i // len(SCHEMAS)) % len(SUBJECTS)]
        keys = ", ".join(SCHEMAS[name]["properties"])
        variant = i // (len(SCHEMAS) * len(SUBJECTS))
        out.append(
            (
                name,
                f"Write one JSON object for a {name} about {subject} (example {variant + 1}) "
                f"with the keys {keys}.",
            )
        )
    return out


MODES = {  # engine arguments (every engine: exact weights, one thread, prefix caching off)
    "constrained": {"grammar_forced_tokens": False},
    "unconstrained": {"grammar_forced_tokens": False},
    "forced": {"grammar_forced_tokens": True},
    "forced+ngram": {"grammar_forced_tokens": True, "speculative_method": "ngram"},
}
EXACT = ["forced", "forced+ngram", "hf"]  # must equal constrained token for token
COUNTERS = ("steps", "drafts", "accepted", "forced", "forced_accepted", "grammar_seconds")


def engines(max_batch: int) -> dict:
    from engine import LLM

    # 16 MiB a request holds ~350 tokens of SmolLM2 (46 KiB each): a prompt (< 100 tokens), the
    # output (160 by default) and the lookahead slots of its drafts.
    kv = (64 << 20) + max_batch * (16 << 20)
    common = dict(quantization=None, num_threads=1, enable_prefix_caching=False)
    return {m: LLM(MODEL, kv_cache_memory_bytes=kv, **common, **kw) for m, kw in MODES.items()}


def counters(llm) -> dict[str, float]:
    """The engine's running totals: speculation counters and seconds of grammar work."""
    s, grammar = llm.engine.speculation.stats, llm.engine.grammar
    return {
        "steps": s.num_steps,
        "drafts": s.num_drafts,
        "accepted": s.num_accepted,
        "forced": s.num_forced,
        "forced_accepted": s.num_forced_accepted,
        "grammar_seconds": grammar.seconds if grammar is not None else 0.0,
    }


def engine_mode(llm, prompts, params: Callable[[], list], one_at_a_time: bool, schemas=None):
    """One run: every prompt, one request at a time (batch 1) or all together. Metrics: wall
    seconds and this run's counter deltas; info: tokens, and valid JSON outputs when `schemas`."""

    def run() -> Run:
        sampling = params()
        before = counters(llm)
        gc.collect()
        t0 = time.perf_counter()
        if one_at_a_time:
            pairs = zip(prompts, sampling, strict=True)
            outs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in pairs]
        else:
            outs = llm.generate(prompts, sampling, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = counters(llm)
        ids = [o.outputs[0].token_ids for o in outs]
        info = {"tokens": sum(map(len, ids)), "requests": len(ids)}
        if schemas is not None:
            texts = [o.outputs[0].text for o in outs]
            info["valid_json"] = sum(map(_valid, texts, schemas))
        return Run({"seconds": seconds, **{k: after[k] - before[k] for k in after}}, ids, info)

    return run


def _valid(text: str, sch: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), sch, format_checker=jsonschema.FormatChecker())
        return True
    except Exception:  # noqa: BLE001
        return False


def hf_mode(model, tokenizer, prompts, schemas, max_tokens: int) -> Callable[[], Run]:
    """HF generate() + xgrammar's HF logits processor, one prompt at a time, grammars compiled
    here (outside the timings, as the engine's are)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    grammars = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False) for s in schemas]

    def run() -> Run:
        outs = []
        t0 = time.perf_counter()
        for ids, grammar in zip(prompts, grammars, strict=True):
            processor = xgr.contrib.hf.LogitsProcessor(grammar)  # one per request
            outs += generate(
                model, [ids], max_tokens, ignore_eos=False, logits_processor=[processor]
            )
        seconds = time.perf_counter() - t0
        return Run(
            {"seconds": seconds}, outs, {"tokens": sum(map(len, outs)), "requests": len(outs)}
        )

    return run


def measure_batch(llms, batch: int, max_tokens: int, repeats: int, num_requests=None, hf=None):
    """Every mode on the same requests (4 one at a time at batch 1, else `batch` together;
    num_requests overrides the count), alternated. hf: an HF model to add the hf mode."""
    from engine import SamplingParams
    from engine.grammar import StructuredOutputs

    items = requests(num_requests or (4 if batch == 1 else batch))
    schemas = [SCHEMAS[name] for name, _ in items]
    llm = llms["constrained"]
    prompts = [llm.apply_chat_template([{"role": "user", "content": m}]) for _, m in items]
    constrained = [
        SamplingParams(
            temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputs(json=s)
        )
        for s in schemas
    ]
    for engine_llm in llms.values():  # compile once per engine, outside the timings
        for p in constrained:
            engine_llm.engine.compile_constraint(p.structured_outputs)
    lengths: list[int] = []  # constrained outputs' token counts, set by its warm-up run

    def unconstrained() -> list:
        assert lengths, "constrained runs before unconstrained (MODES' order)"
        return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]

    modes = {}
    for mode, engine_llm in llms.items():
        if mode == "unconstrained":
            modes[mode] = engine_mode(engine_llm, prompts, unconstrained, batch == 1)
        else:
            modes[mode] = engine_mode(engine_llm, prompts, lambda: constrained, batch == 1, schemas)
    timed_constrained = modes["constrained"]

    def constrained_run() -> Run:
        run = timed_constrained()
        lengths[:] = [len(ids) for ids in run.outputs]
        return run

    modes["constrained"] = constrained_run
    if hf is not None and batch == 1:
        modes["hf"] = hf_mode(hf, llm.tokenizer, prompts, schemas, max_tokens)
    return alternate(modes, repeats, threads=1)


def measure(batches, max_tokens: int, repeats: int, num_requests=None, hf: bool = False):
    """{batch: {mode: Timings}}, the engines built once for every batch size."""
    torch.set_num_threads(1)
    llms = engines(max(batches))
    model = load_hf_model() if hf and 1 in batches else None
    return {b: measure_batch(llms, b, max_tokens, repeats, num_requests, model) for b in batches}


def problems(timings: dict[str, Timings]) -> dict[str, str]:
    """Modes whose outputs break their rule: EXACT modes equal to constrained token for token,
    unconstrained exactly as many tokens per request as constrained."""
    found = unequal(timings, "constrained", [m for m in EXACT if m in timings])
    want = [len(ids) for ids in timings["constrained"].outputs]
    got = [len(ids) for ids in timings["unconstrained"].outputs]
    if got != want:
        found["unconstrained"] = f"token counts {got} against constrained's {want}"
    return found


def grammar_summary(t: Timings) -> dict:
    """Throughput at the median time; for engine modes, over this mode's own timed runs:
    grammar_share = grammar seconds / wall seconds; forced_share = forced drafts accepted /
    output tokens; forced_acceptance = forced accepted / forced drafted; acceptance (all
    drafts) = accepted / drafted; accepted_per_step = accepted drafts per verification step."""
    tokens = t.info["tokens"]
    out = {"tokens_per_s": round(tokens / t.median("seconds"), 2)}
    if "drafts" not in t.runs[0].metrics:
        return out
    n = {m: sum(t.values(m)) for m in COUNTERS}

    def ratio(a: float, b: float) -> float:
        return round(a / b, 4) if b else 0.0

    out.update(
        grammar_share=ratio(n["grammar_seconds"], sum(t.values("seconds"))),
        forced_share=ratio(n["forced_accepted"], tokens * len(t.runs)),
        forced_acceptance=ratio(n["forced_accepted"], n["forced"]),
        acceptance=ratio(n["accepted"], n["drafts"]),
        accepted_per_step=ratio(n["accepted"], n["steps"]),
    )
    return out


def report(batch: int, timings: dict[str, Timings]) -> None:
    base = timings["constrained"]
    tokens, requests_ = base.info["tokens"], base.info["requests"]
    print(f"-- batch {batch}: {requests_} requests, {tokens} tokens, wall seconds per run")
    print(summary(timings, "seconds"))
    for mode, t in timings.items():
        s, seconds = grammar_summary(t), t.median("seconds")
        line = f"[batch {batch}/{mode}] {1e3 * seconds / tokens:.1f} ms/token, "
        line += f"{base.median('seconds') / seconds:.2f}x constrained"
        if "grammar_share" in s:
            line += (
                f"; grammar work {s['grammar_share']:.1%}, forced share {s['forced_share']:.2f}, "
                f"forced accepted {s['forced_acceptance']:.2f}, all drafts accepted "
                f"{s['acceptance']:.2f}"
            )
        if "valid_json" in t.info:
            line += f"; valid JSON {t.info['valid_json']}/{requests_}"
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    ap.add_argument("--no-hf", action="store_true", help="skip HF at batch 1")
    args = ap.parse_args(argv)
    print(f"# grammar bench: {MODEL}, fp32, torch threads=1, torch {torch.__version__}")
    batches = [int(b) for b in args.batches.split(",")]
    results = measure(batches, args.max_tokens, args.repeats, hf=not args.no_hf)
    overheads, speedups, forced, tokens, failed = [], [], 0.0, 0, False
    for batch, timings in results.items():
        report(batch, timings)
        for mode, where in problems(timings).items():
            print(f"MISMATCH batch {batch}: {mode}: {where}", flush=True)
            failed = True
        constrained, spec = timings["constrained"], timings["forced+ngram"]
        overheads.append(grammar_summary(constrained)["grammar_share"])
        speedups.append(constrained.median("seconds") / spec.median("seconds"))
        forced += sum(spec.values("forced_accepted"))
        tokens += spec.info["tokens"] * len(spec.runs)
    print(
        f"RESULT grammar_overhead={max(overheads):.3f} grammar_spec_speedup={min(speedups):.2f} "
        f"forced_token_share={forced / tokens:.3f}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
