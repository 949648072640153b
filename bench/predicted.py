"""Predicted Outputs on a code-edit workload: output tokens/s with and without the prediction.

    python -m bench.predicted [--model qwen2.5-coder-0.5b-instruct] [--batches 1,8]
                              [--max-tokens 512] [--lines 300] [--threads 2]

The workload: the first --lines lines of a real standard-library source file (`string.py`,
read with inspect.getsource), a chat request asking for one small change to it (rename one
identifier; each request of a batch a different one) with the whole file back, and the file
as the prediction. Greedy, EOS honoured, --max-tokens per request; one engine started without
any speculative method (the prediction alone turns speculation on), prefix caching off so that
neither mode reuses the other's prompt. Each batch size: a warm-up of both modes, then plain and
predicted, each timed once as one generate() call over the whole batch; tokens/s = output
tokens / wall seconds of that call (prompt steps included, equal in both modes).

The outputs must be equal token for token, else the script exits 1 (RESULT is printed anyway).
Last line:
    RESULT speedup_b1=.. tps_plain_b1=.. tps_predicted_b1=.. (b8 alike) accepted=.. rejected=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse
import inspect
import string
import time

from engine import LLM, SamplingParams

RENAMES = [
    ("_sentinel_dict", "_empty_mapping"),
    ("delimiter", "marker"),
    ("idpattern", "id_pattern"),
    ("braceidpattern", "brace_id_pattern"),
    ("flags", "regex_flags"),
    ("mapping", "values"),
    ("_ChainMap", "ChainMapType"),
    ("capwords", "capitalize_words"),
]


def source(lines: int) -> str:
    return "\n".join(inspect.getsource(string).splitlines()[:lines]) + "\n"


def ask(code: str, old: str, new: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": f"```python\n{code}```\n\nRename `{old}` to `{new}` everywhere in this "
            "Python file. Answer with the whole file, unchanged otherwise, in one code block.",
        }
    ]


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return outs, seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--lines", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    code = source(args.lines)
    llm = LLM(
        args.model,
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_model_len=8192,
        max_num_seqs=8,
    )
    fence = f"```python\n{code}```"
    ok, result = True, {}
    totals = {"accepted": 0, "rejected": 0}
    for batch in map(int, args.batches.split(",")):
        prompts = [llm.apply_chat_template(ask(code, *RENAMES[i % 8])) for i in range(batch)]
        plain = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        predicted = SamplingParams(temperature=0, max_tokens=args.max_tokens, prediction=fence)
        for params in (plain, predicted):  # warm-up
            short = SamplingParams(**{**vars(params), "max_tokens": 32})
            llm.generate(prompts[:1], short, use_tqdm=False)
        base, t_plain, n_plain = run(llm, prompts, [plain] * batch)
        pred, t_pred, n_pred = run(llm, prompts, [predicted] * batch)
        pairs = zip(base, pred, strict=True)
        same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in pairs]
        ok &= all(same)
        spec = [o.metrics.spec for o in pred]
        accepted = sum(s.num_predicted_accepted for s in spec)
        rejected = sum(s.num_predicted - s.num_predicted_accepted for s in spec)
        totals["accepted"] += accepted
        totals["rejected"] += rejected
        tps_plain, tps_pred = n_plain / t_plain, n_pred / t_pred
        print(
            f"batch {batch}: plain {n_plain} tokens {t_plain:.1f} s {tps_plain:.1f} tok/s; "
            f"predicted {n_pred} tokens {t_pred:.1f} s {tps_pred:.1f} tok/s; "
            f"x{tps_pred / tps_plain:.2f}; prediction drafts accepted {accepted}, rejected "
            f"{rejected}; outputs equal {sum(same)}/{batch}; ended by EOS "
            f"{sum(o.outputs[0].finish_reason == 'stop' for o in base)}/{batch}",
            flush=True,
        )
        result[f"speedup_b{batch}"] = f"{tps_pred / tps_plain:.2f}"
        result[f"tps_plain_b{batch}"] = f"{tps_plain:.1f}"
        result[f"tps_predicted_b{batch}"] = f"{tps_pred:.1f}"
    result |= totals | {"outputs_equal": int(ok)}
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
