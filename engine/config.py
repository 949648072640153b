"""Engine configuration: the one home for defaults, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

QUANTIZATIONS = (None, "auto", "int4", "int8")
DRAFT_QUANTIZATIONS = (*QUANTIZATIONS, "dynamic-int8")

# Drafts per request per step; verification rows are attended in the batched short-query path.
MAX_SPECULATIVE_TOKENS = 15


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"  # embedded name or a local HF directory
    block_size: int = 16
    max_num_seqs: int = 128  # requests running at once
    max_num_batched_tokens: int = 1024  # token budget per step (prefill chunk size)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = None  # KV budget; default: a fraction of free memory
    kv_cache_memory_fraction: float = 0.1  # on CPU: of the RAM available at start
    gpu_memory_utilization: float = 0.9  # on CUDA: of the GPU memory free after the weights
    # Where the engine runs: "auto" (CUDA when present, else CPU), "cpu", or "cuda" / "cuda:N";
    # weights and KV in dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "float32",
    # "bfloat16" or "float16".
    device: str = "auto"
    dtype: str = "auto"
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
    seed: int = 0  # engine generator for unseeded random sampling
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # Speculative decoding: "ngram" (prompt lookup) or "draft" (a draft model; setting
    # draft_model alone implies it). num_speculative_tokens is the default k per request
    # (SamplingParams.num_speculative_tokens overrides it; 0 turns speculation off for one).
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
    num_speculative_tokens: int = 4
    adaptive_speculation: bool = True
    ngram_min: int = 2
    ngram_max: int = 4
    # Structured outputs (xgrammar): compiled grammars kept (LRU), the longest a submission
    # waits for a compile, and whether grammar-forced tokens ride as free drafts (False: the
    # constraint only masks; forced tokens are then generated one per step like any other).
    grammar_cache_size: int = 256
    grammar_compile_timeout: float = 10.0
    grammar_forced_tokens: bool = True
    # Multi-LoRA: adapters per request (lora.LoRARequest). max_loras: distinct adapters in one
    # step (slots); max_cpu_loras: adapters kept loaded (LRU; default 2 x max_loras);
    # max_lora_rank: the largest rank accepted (every slot is padded to it).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_model_len", "kv_cache_memory_bytes", "num_kv_blocks", "num_threads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(
                "speculative_method must be 'ngram', 'draft' or None, "
                f"got {self.speculative_method!r}"
            )
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method='draft' needs draft_model")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(
                f"draft_quantization must be one of {DRAFT_QUANTIZATIONS}, "
                f"got {self.draft_quantization!r}"
            )
        if self.draft_model == "self" and self.quantization not in ("auto", None):
            raise ValueError(
                "draft_model='self' drafts with quantized weights for the target in its exact "
                f"dtype: quantization must be 'auto' or None, got {self.quantization!r}"
            )
        if self.draft_model and self.speculative_method == "ngram":
            raise ValueError("draft_model is set but speculative_method is 'ngram'")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}"
            )
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int)) or not (
            1 <= self.ngram_min <= self.ngram_max
        ):
            raise ValueError(
                f"ngram_min/ngram_max must satisfy 1 <= ngram_min <= ngram_max, "
                f"got {self.ngram_min!r}, {self.ngram_max!r}"
            )
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_cpu_loras is not None and (
            not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras
        ):
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                f"got {self.max_cpu_loras!r}"
            )
        if not isinstance(self.grammar_cache_size, int) or self.grammar_cache_size < 1:
            raise ValueError(
                f"grammar_cache_size must be a positive integer, got {self.grammar_cache_size!r}"
            )
        t = self.grammar_compile_timeout
        if not isinstance(t, int | float) or not 0 < t <= 3600:
            raise ValueError(f"grammar_compile_timeout must be in (0, 3600] seconds, got {t!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.9:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 0.9], got {self.kv_cache_memory_fraction}"
            )

        if not 0.0 < self.gpu_memory_utilization <= 0.98:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 0.98], got {self.gpu_memory_utilization}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        device = self.device
        if device not in ("auto", "cpu") and not (
            isinstance(device, str) and (device == "cuda" or device.startswith("cuda:"))
        ):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but torch sees no CUDA device")

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
