"""Engine configuration: the one home for defaults, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from engine.checks import Rule, check_rules, int_in, number_in, one_of

DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

QUANTIZATIONS = (None, "auto", "int4", "int8")
KV_DTYPES = ("auto", "float32", "bfloat16", "int8")  # (engine.models.kv_cache reads them)
DRAFT_QUANTIZATIONS = (*QUANTIZATIONS, "dynamic-int8")

# Drafts per request per step from a proposer (and the most a request's k may ask for);
# verification rows are attended in the batched short-query path.
MAX_SPECULATIVE_TOKENS = 15
# Drafts per request per step from a prediction (spec.prediction): once in step with the output
# it runs on for hundreds of tokens and is almost always right, so a longer step spreads the
# step's fixed cost further (15 / 31 / 63 compared: bench/RESULTS.md "Predicted Outputs"). The
# most drafts any step gives a request: what sizes per-step state (grammar rollback, mask rows).
MAX_PREDICTED_DRAFTS = 31


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"  # embedded name, a local HF directory or a .gguf file
    block_size: int = 16
    max_num_seqs: int = 128  # requests running at once
    max_num_batched_tokens: int = 1024  # token budget per step (prefill chunk size)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # While requests are decoding, a step's prompt tokens are limited so the step stays within
    # this many milliseconds (engine.step_budget: step time fitted online); None: only
    # max_num_batched_tokens limits a step.
    max_step_ms: float | None = None
    kv_cache_memory_bytes: int | None = None  # KV budget; default: a fraction of free memory
    kv_cache_memory_fraction: float = 0.1  # on CPU: of the RAM available at start
    gpu_memory_utilization: float = 0.9  # on CUDA: of the GPU memory free after the weights
    # Where the engine runs: "auto" (CUDA when present, else CPU), "cpu", or "cuda" / "cuda:N";
    # weights and KV in dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "float32",
    # "bfloat16" or "float16".
    device: str = "auto"
    dtype: str = "auto"
    # The KV cache: "auto" (in dtype: exact), "float32" / "bfloat16" (dtype's own, named; or
    # bfloat16 beside float32 weights on the C++ CPU layers: 2x the tokens), or "int8" (codes
    # with float32 scales, per 8 values of a key and 32 of a value: ~3x the tokens in the same
    # memory; read by the C++ CPU layers only). Quality rule: engine.models.kv_cache.
    kv_cache_dtype: str = "auto"
    # Weights: "auto" (a GGUF model, as every embedded one, runs its own quantized blocks on
    # CPU: engine.models.quantized; elsewhere dense), None (dense in dtype: the exact reference
    # the HF-parity tests use), "int4" / "int8" (weight-only, quantized from a dense checkpoint).
    quantization: str | None = "auto"
    num_kv_blocks: int | None = None  # exact pool size, overrides the byte budget (tests)
    enable_prefix_caching: bool = True
    # Paged attention: "torch" (the reference, the CPU path), "triton" (kernels/, on CUDA or
    # under TRITON_INTERPRET=1), or "auto" (Triton on CUDA, else torch).
    attention_backend: str = "auto"
    # On CUDA, decode and verification steps replay CUDA graphs captured at start (batch sizes
    # 1, 2, 4, 8, 16, ... max_num_seqs; 1 + num_speculative_tokens query tokens per request);
    # True runs every step eagerly, as on CPU.
    enforce_eager: bool = False
    # Async scheduling: schedule and launch the next step while the device runs this one, the
    # host appending this step's tokens meanwhile (outputs come one step later; a request that
    # stops runs one step more, discarded). Only between steps whose next inputs need nothing
    # from the host: no speculation, grammar, penalties, min_tokens bans or n > 1 forks.
    # None: on with CUDA (where the device runs ahead of the host), off on CPU.
    async_scheduling: bool | None = None
    # Greedy decodes whose tokens nobody sees until they finish (FINAL_ONLY outputs, as
    # LLM.generate asks) run this many steps per scheduling round, embedding to argmax in one
    # C++ call (LayerStack.decode: the same bits as one step at a time) while nothing waits to
    # be admitted; streamed requests always take one step at a time. 1: never.
    num_scheduler_steps: int = 4
    seed: int = 0  # engine generator for unseeded random sampling
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # Speculative decoding: "ngram" (prompt lookup), "suffix" (suffix decoding over the
    # request's own text and its tenant's recent text: spec.suffix) or "draft" (a draft model;
    # setting draft_model alone implies it; with "suffix", suffix drafts where they score and the
    # draft model for the rest). num_speculative_tokens is the default k per request (None: 31
    # for "suffix" (15 beside a draft model), else 4; SamplingParams.num_speculative_tokens
    # overrides it; 0 turns speculation off for one).
    # adaptive_speculation: num_speculative_tokens becomes a cap, and each step every request
    # without its own k gets the k that maximises the expected tokens per second (spec.adaptive).
    speculative_method: str | None = None
    # An embedded name, a local HF directory, or "self": the target's own weights quantized
    # (draft_quantization) draft for the target in its exact dtype.
    draft_model: str | None = None
    # The draft's weights: "auto" (a GGUF draft's own blocks, for "self" the target's GGUF; a
    # draft without a GGUF gets "dynamic-int8"), "int4", "int8" (engine.models.quantized),
    # "dynamic-int8" (per-channel int8 weights, activations quantized per call; CPU float32:
    # engine.models.quant) or None (dense).
    draft_quantization: str | None = "auto"
    num_speculative_tokens: int | None = None
    adaptive_speculation: bool = True
    ngram_min: int = 2
    ngram_max: int = 4
    # Suffix decoding (vLLM's suffix_decoding_* knobs): the longest context matched, the most
    # drafts per matched token, the least probability a draft may have, and the tokens of
    # finished requests' text kept over all tenants (the oldest evicted first).
    suffix_max_tree_depth: int = 24
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_max_cached_tokens: int = 1 << 20
    # Structured outputs (xgrammar): compiled grammars kept (LRU, by count and by bytes), the
    # longest a compile may run (in a worker process, killed past it) and how many run at once,
    # the largest JSON schema accepted (nesting depth, number of JSON values), and whether
    # grammar-forced tokens ride as free drafts (False: the constraint only masks; forced tokens
    # are then generated one per step like any other).
    grammar_cache_size: int = 256
    grammar_cache_bytes: int = 512 << 20
    grammar_compile_timeout: float = 10.0
    grammar_compile_workers: int = 8
    grammar_max_schema_depth: int = 64
    grammar_max_schema_nodes: int = 8192
    grammar_forced_tokens: bool = True
    # Multi-LoRA: adapters per request (lora.LoRARequest). max_loras: distinct adapters in one
    # step (slots); max_cpu_loras: adapters kept loaded (LRU; default 2 x max_loras);
    # max_lora_rank: the largest rank accepted (every slot is padded to it).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Tensor parallelism (engine.distributed.tensor_parallel): the target's attention heads and MLP
    # split over this many ranks, each a process with its heads' share of the KV cache, summed
    # over torch.distributed (gloo, on CPU); quantized weights and LoRA adapters split with their
    # layers; a draft model runs whole on rank 0.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_rules(self, _RULES, lambda _, message: ValueError(message))
        if self.tensor_parallel_size > 1:
            tp = f"tensor_parallel_size={self.tensor_parallel_size}"
            if self.async_scheduling:
                raise ValueError(f"{tp} does not support async_scheduling=True yet")
            if self.torch_device.type != "cpu":
                raise ValueError(f"{tp} runs on CPU (gloo) so far, got device={self.device!r}")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method='draft' needs draft_model")
        if self.draft_model == "self" and self.quantization not in ("auto", None):
            raise ValueError(
                "draft_model='self' drafts with quantized weights for the target in its exact "
                f"dtype: quantization must be 'auto' or None, got {self.quantization!r}"
            )
        if self.draft_model and self.speculative_method == "ngram":
            raise ValueError("draft_model is set but speculative_method is 'ngram'")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min/ngram_max must satisfy 1 <= ngram_min <= ngram_max, "
                f"got {self.ngram_min!r}, {self.ngram_max!r}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                f"got {self.max_cpu_loras!r}"
            )
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but torch sees no CUDA device")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    @property
    def spec_method(self) -> str | None:
        return self.speculative_method or ("draft" if self.draft_model else None)

    def kv_budget_bytes(self) -> int:
        """Call after the weights are loaded: on CUDA the budget is a share of what is free."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        device = self.torch_device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * self.gpu_memory_utilization)
        return int(psutil.virtual_memory().available * self.kv_cache_memory_fraction)


def _is_device(v) -> bool:
    return v in ("auto", "cpu", "cuda") or (isinstance(v, str) and v.startswith("cuda:"))


_POSITIVE = "must be a positive integer"
_POSITIVE_INTS = """block_size max_num_seqs max_num_batched_tokens max_loras max_lora_rank
grammar_cache_size grammar_cache_bytes grammar_compile_workers grammar_max_schema_depth
grammar_max_schema_nodes suffix_max_tree_depth suffix_max_cached_tokens""".split()  # noqa: SIM905 (names to check alike)
_METHOD = "must be 'ngram', 'suffix', 'draft' or None"
_STEP_MS = "must be a number of milliseconds in (0, 600000] or None"
_RULES: list[Rule] = [
    *((name, int_in(1), _POSITIVE) for name in _POSITIVE_INTS),
    ("max_model_len", int_in(1, optional=True), _POSITIVE + " or None"),
    ("max_step_ms", lambda v: v is None or number_in(0, 6e5, low_open=True)(v), _STEP_MS),
    ("kv_cache_memory_bytes", int_in(1, optional=True), _POSITIVE + " or None"),
    ("num_kv_blocks", int_in(2, optional=True), "must be an integer >= 2 or None"),
    ("num_threads", int_in(1, optional=True), _POSITIVE + " or None"),
    ("num_scheduler_steps", int_in(1, 64), "must be an integer in [1, 64]"),
    ("tensor_parallel_size", int_in(1, 64), "must be an integer in [1, 64]"),
    ("speculative_method", one_of(None, "ngram", "suffix", "draft"), _METHOD),
    ("quantization", one_of(*QUANTIZATIONS), f"must be one of {QUANTIZATIONS}"),
    (
        "draft_quantization",
        one_of(*DRAFT_QUANTIZATIONS),
        f"must be one of {DRAFT_QUANTIZATIONS}",
    ),
    (
        "num_speculative_tokens",
        int_in(0, MAX_SPECULATIVE_TOKENS, optional=True),
        f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] or None",
    ),
    ("suffix_max_spec_factor", number_in(0, 1e3, low_open=True), "must be in (0, 1000]"),
    ("suffix_min_token_prob", number_in(0.0, 1.0), "must be in [0, 1]"),
    ("ngram_min", int_in(1), "must be an integer >= 1 (and <= ngram_max)"),
    ("ngram_max", int_in(1), "must be an integer >= 1 (and >= ngram_min)"),
    ("max_cpu_loras", int_in(1, optional=True), "must be an integer >= max_loras or None"),
    ("grammar_compile_timeout", number_in(0, 3600, low_open=True), "must be in (0, 3600] seconds"),
    ("kv_cache_memory_fraction", number_in(0.0, 0.9, low_open=True), "must be in (0, 0.9]"),
    ("gpu_memory_utilization", number_in(0.0, 0.98, low_open=True), "must be in (0, 0.98]"),
    ("dtype", one_of(*DTYPES), f"must be one of {sorted(DTYPES)}"),
    ("kv_cache_dtype", one_of(*KV_DTYPES), f"must be one of {KV_DTYPES}"),
    ("device", _is_device, "must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
]
