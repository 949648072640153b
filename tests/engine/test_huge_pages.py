"""Weights and KV cache in transparent huge pages (engine.models.huge_pages)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages")


def mapping_at(address: int) -> dict[str, int]:
    """Rss and AnonHugePages (bytes) of the mapping of this process that holds address."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            found = {} if lo <= address < hi else None
        elif found is not None and fields[0] in ("Rss:", "AnonHugePages:"):
            found[fields[0][:-1]] = int(fields[1]) * 1024
            if len(found) == 2:
                return found
    raise AssertionError(f"no mapping holds {address:#x}")


def huge_bytes_at(address: int) -> int:
    return mapping_at(address)["AnonHugePages"]


def all_huge(address: int) -> bool:
    """Whether the memory resident in address's mapping is in huge pages (but the unaligned
    ends: under 2 huge pages' worth)."""
    m = mapping_at(address)
    return m["AnonHugePages"] > 0 and m["Rss"] - m["AnonHugePages"] < 2 * huge_pages.HUGE


@needs_thp
def test_zeros_are_zero_and_backed_by_huge_pages():
    kv = huge_pages.zeros(2, 3, 1024, 256, dtype=torch.float32)  # 6 MiB
    assert kv.shape == (2, 3, 1024, 256) and kv.dtype == torch.float32
    assert kv.data_ptr() % huge_pages.HUGE == 0
    assert torch.count_nonzero(kv) == 0
    kv.fill_(1.0)  # touched: the kernel backs it in 2 MiB pages
    assert huge_bytes_at(kv.data_ptr()) >= kv.nbytes  # all of it (6 MiB: 3 huge pages)
    plain = torch.zeros(2, 3, 1024, 256)
    plain.fill_(1.0)
    assert not all_huge(plain.data_ptr())  # what torch gives without the advice


@needs_thp
def test_moved_storages_keep_values_views_and_sizes():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, 1000, generator=g)
    rows = a[10:20]  # a view: must follow its base
    small = torch.randn(5, generator=g)  # below MIN_BYTES: stays
    p = torch.nn.Parameter(torch.randn(200, 200, generator=g), requires_grad=False)
    before = [t.clone() for t in (a, rows, small, p)]
    small_at = small.data_ptr()
    moved = huge_pages.move_storages([a, rows, small, p])
    assert moved == 300 * 1000 * 4 + 200 * 200 * 4
    for t, ref in zip((a, rows, small, p), before, strict=True):
        assert torch.equal(t, ref)
    assert small.data_ptr() == small_at
    assert a.data_ptr() % huge_pages.HUGE == 0  # the first storage starts the arena
    assert a.untyped_storage().nbytes() == 300 * 1000 * 4  # a storage of its own size
    assert rows.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    a[10:20] += 1  # still one memory
    assert torch.equal(rows, before[1] + 1)
    assert huge_bytes_at(a.data_ptr()) >= huge_pages.HUGE


@pytest.mark.parametrize("nbytes", [1, 1_360_000, 2 << 20, (2 << 20) + 1, (6 << 20) + 4096])
def test_a_region_holds_its_bytes_in_whole_huge_pages_wherever_the_mapping_starts(nbytes):
    """The kernel backs only huge pages that lie inside the mapping: from any huge-page boundary
    the mapping can start before (a page-aligned address up to HUGE - 4 KiB before it), the
    huge pages covering nbytes end inside it."""
    whole = -(-nbytes // huge_pages.HUGE) * huge_pages.HUGE
    for skip in range(0, huge_pages.HUGE, 4096):
        assert skip + whole <= huge_pages._span(nbytes), skip
    region, skip = huge_pages._region(nbytes)
    assert skip + whole <= len(region)


def test_without_huge_pages_nothing_moves(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    a = torch.randn(300, 1000)
    at = a.data_ptr()
    assert huge_pages.move_storages([a]) == 0 and a.data_ptr() == at
    z = huge_pages.zeros(1024, 1024, dtype=torch.float32)
    assert torch.count_nonzero(z) == 0


@needs_thp
def test_the_default_path_reads_its_weights_and_kv_from_huge_pages(monkeypatch):
    """SmolLM2 on its GGUF: every projection's codes sit in huge pages after the load, and
    moving them changed no output (greedy tokens equal to a load that kept 4 KiB pages)."""
    from engine import LLM, SamplingParams
    from engine.models.quantized import QuantizedLinear

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = "def fibonacci(n):\n    "

    def run():
        llm = LLM("smollm2-135m-instruct", num_threads=1, num_kv_blocks=64)
        model = llm.engine.runner.model
        return llm, model, llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    llm, model, tokens = run()
    projections = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert projections and all(all_huge(m.codes.data_ptr()) for m in projections)
    assert all_huge(llm.engine.runner.kv_caches.data_ptr())  # the blocks the prompt touched
    del llm, model
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    plain_llm, plain, plain_tokens = run()
    first = next(m for m in plain.modules() if isinstance(m, QuantizedLinear))
    assert not all_huge(first.codes.data_ptr())  # torch's memory: 4 KiB pages (mostly)
    assert tokens == plain_tokens
