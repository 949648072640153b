"""Host time per decode step: what an engine spends outside the model, per request.

    python -m bench.host_overhead [--quick]

On a GPU the model's part of a decode step is short (a 1B model at batch 128 reads ~2.5 GB of
weights in ~1 ms on an H100), and everything else, scheduling, building inputs, sampling,
appending tokens, detokenizing and stop checks, building outputs, runs in Python on the host
while the GPU waits. This measures that part on the CPU, where it is the same code: a random
2-layer, 64-wide Llama with SmolLM2's tokenizer and vocabulary, so the model's own time is
small, and timed on its own (the forward and the LM head, through wrappers) to be subtracted:

    host per step = (wall time of the decode steps - model time) / steps

- tandem: `LLMEngine.step` over B requests (prompt 256 random ids, 128 new tokens, greedy, EOS
  ignored), the torch backend; outputs FINAL_ONLY (what `LLM.generate` asks for), DELTA (what
  the server asks for) and CUMULATIVE (what it asked for before).
- hf: `model.generate` on one static batch of the same requests, its forward timed the same
  way: HF's own loop (logits processors, stopping criteria, cache bookkeeping), which does no
  detokenization, stop strings or scheduling.

Batch sizes 1, 32 and 128 (--quick: 1 and 32). One thread. Last line:
    RESULT host_us_per_request_b128=.. final_x_cumulative_b128=.. delta_x_cumulative_b128=..
    tandem_x_hf_host_b128=..
(the largest batch measured; x: the ratio of host times, > 1 when the first is slower;
each figure the best of two runs)
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch

from bench.workload import MODEL

PROMPT_LEN, NEW_TOKENS = 256, 128
# The first ids of SmolLM2's vocabulary (real BPE tokens to detokenize): the argmax over a
# 49152-wide vocabulary alone took ~40 us per request on this CPU, a GPU's work.
VOCAB = 4096


def make_model(root: Path) -> Path:
    """A random-weight 2-layer Llama with the real SmolLM2 tokenizer (and its vocabulary)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.models.registry import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


class ModelClock:
    """Seconds spent in the wrapped callables (forward passes, LM head)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, obj, name: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(obj, name, timed)


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, VOCAB, (batch, PROMPT_LEN), generator=g).tolist()


def tandem_host(path: Path, batch: int, kind) -> tuple[float, list[list[int]]]:
    """Host seconds per decode step, and the output ids (to check against HF's)."""
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine(
        model=str(path),
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * PROMPT_LEN),
        enable_prefix_caching=False,
        num_threads=1,
    )
    clock = ModelClock()
    clock.wrap(engine.runner.model, "forward")
    clock.wrap(engine.runner.model.lm_head, "forward")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, output_kind=kind)
    for i, p in enumerate(prompts(batch)):
        engine.add_request(str(i), p, params)
    finals = {}
    engine.step()  # every prefill in one step (the budget fits them): not a decode step
    clock.seconds, steps = 0.0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        steps += 1
    wall = time.perf_counter() - t0
    assert steps == NEW_TOKENS - 1, steps
    return (wall - clock.seconds) / steps, [finals[str(i)] for i in range(batch)]


def hf_host(path: Path, batch: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts(batch))
    clock = ModelClock()
    clock.wrap(model, "forward")
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=model.config.vocab_size + 1,  # unreachable: EOS ignored
        pad_token_id=0,
    )
    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), **kwargs)
        clock.seconds = 0.0
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        wall = time.perf_counter() - t0
    # NEW_TOKENS forward passes: the prefill one counts as a step here (its host work is the
    # same loop), so per step is over all of them.
    return (wall - clock.seconds) / NEW_TOKENS, out[:, PROMPT_LEN:].tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch sizes 1 and 32 only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from engine import RequestOutputKind

    batches = [1, 32] if args.quick else [1, 32, 128]
    final_only, cumulative_kind = RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp))
        tandem_host(path, 4, RequestOutputKind.FINAL_ONLY)  # warm-up (first shapes, imports)
        for batch in batches:
            # Each the best of two runs: host times of one run vary by ~20% here.
            (final, ids), _ = sorted(tandem_host(path, batch, final_only) for _ in range(2))
            cumulative = min(tandem_host(path, batch, cumulative_kind)[0] for _ in range(2))
            delta = min(tandem_host(path, batch, RequestOutputKind.DELTA)[0] for _ in range(2))
            (hf, hf_ids), _ = sorted(hf_host(path, batch) for _ in range(2))
            same = sum(a == b for a, b in zip(ids, hf_ids, strict=True))
            results[batch] = (final, cumulative, delta, hf)
            print(
                f"batch {batch:>3}: tandem final_only {1e3 * final:.3f} ms/step "
                f"({1e6 * final / batch:.1f} us/request), cumulative {1e3 * cumulative:.3f} ms, "
                f"delta {1e3 * delta:.3f} ms, "
                f"hf generate {1e3 * hf:.3f} ms ({1e6 * hf / batch:.1f} us/request); "
                f"token ids equal HF's {same}/{batch}"
            )
            gc.collect()
    b = batches[-1]
    final, cumulative, delta, hf = results[b]
    print(
        f"RESULT host_us_per_request_b{b}={1e6 * final / b:.1f} "
        f"final_x_cumulative_b{b}={final / cumulative:.2f} "
        f"delta_x_cumulative_b{b}={delta / cumulative:.2f} tandem_x_hf_host_b{b}={final / hf:.2f}"
    )


if __name__ == "__main__":
    main()
