"""The playground's HTML views: pure functions of snapshot dicts."""

from __future__ import annotations

from models import byte_tokenizer
from playground import views


def snap(requests, blocks, num_blocks=8):
    used = len({b for r in requests for b in r["block_table"]})
    return {
        "num_blocks": num_blocks,
        "num_free_blocks": num_blocks - used,
        "num_cached_free_blocks": 1,
        "num_used_blocks": used,
        "requests": requests,
        "blocks": blocks,
        "prefix_cache": {"query_tokens": 10, "hit_tokens": 5, "hit_rate": 0.5, "evictions": 0},
    }


def request(rid, table):
    return {
        "request_id": rid,
        "index": 0,
        "block_table": table,
        "num_tokens": 40,
        "num_computed_tokens": 39,
        "num_cached_tokens": 16,
    }


def test_shared_blocks_show_their_reference_count():
    s = snap(
        [request("a", [1, 2, 3]), request("b", [1, 2, 4])],
        {
            1: {"ref_count": 2, "hash": "x"},
            2: {"ref_count": 2, "hash": "y"},
            3: {"ref_count": 1, "hash": None},
            4: {"ref_count": 1, "hash": None},
            5: {"ref_count": 0, "hash": "z"},
        },
    )
    html = views.render_blocks(s)
    assert html.count('class="blk blk-shared"') == 2 + 4  # grid + both block tables
    assert html.count('class="blk-row"') == 2
    assert "cached" in html and "block 5: cached z" in html
    sharing = views.render_sharing(s, views.History())
    assert "2 blocks (1, 2)" in sharing and "a/0, b/0" in sharing


def test_block_tables_show_the_end_of_each_requests_text():
    """A request's row shows its decoded tail_token_ids, escaped (the text is a user's); a
    key's view (engine.entrypoints.tenancy, marked by the playground) draws the blocks it does
    not list as possibly another key's, not as free."""
    tok = byte_tokenizer()
    r = request("a", [1])
    r["tail_token_ids"] = tok.encode("<b>hi</b>\nthere")
    s = snap([r], {1: {"ref_count": 1, "hash": None}}, num_blocks=3)
    views.add_text(s, tok)
    html = views.render_blocks(s)
    assert '<td class="blk-text">…&lt;b&gt;hi&lt;/b&gt;↵there</td>' in html
    assert "block 2: free" in html and "another key" not in html
    html = views.render_blocks(s | {"is_tenant_view": True})
    assert "block 2: free, or another key&#x27;s" in html


def test_rejected_drafts_are_struck_before_the_token_that_replaced_them():
    html = views.render_tokens(["A", "B", "C"], "pab", [(2, "xy")])
    assert html.index("<s class") > html.index(">B<") and html.index("<s class") < html.index(">C<")
    assert 'tk-a"' in html and 'title="bonus"' in html


def test_token_pieces_wait_for_whole_characters():
    tok = byte_tokenizer()
    ids = tok.encode("é!")  # two byte tokens for é, then !
    assert len(ids) == 3
    pieces = views.TokenPieces(tok)
    assert pieces.update(ids[:1]) == [""]
    assert pieces.update(ids) == ["", "é", "!"]


def test_token_pieces_join_to_the_whole_decoding():
    """Pieces fed a few tokens at a time (as a stream grows) join to the exact decoding of all
    of them, special tokens skipped: SmolLM2's tokenizer over random ids, multi-byte pieces
    included."""
    import random

    from transformers import AutoTokenizer

    from engine.models.registry import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
    rng = random.Random(0)
    ids = tok.encode("naïve café, 你好 🙂 ") + [rng.randrange(len(tok)) for _ in range(300)]
    pieces = views.TokenPieces(tok)
    for end in range(0, len(ids) + 5, 5):
        got = pieces.update(ids[: min(end, len(ids))])
    assert len(got) == len(ids)
    whole = tok.backend_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(got).rstrip("\ufffd") == whole.rstrip("\ufffd")


def test_history_holds_rates_between_prompts():
    h = views.History(period=0)
    for i, (q, hit) in enumerate([(0, 0), (10, 5), (10, 5), (20, 5)]):
        h.observe(
            {
                "speculation": {"num_drafts": 0, "num_accepted": 0},
                "prefix_cache": {"query_tokens": q, "hit_tokens": hit},
                "num_generated_tokens": 4 * i,
                "num_used_blocks": 0,
                "num_running": 0,
            },
            now=float(i),
        )
    assert h.windowed("hit", "query") == [0.5, 0.5, 0.0]
    assert h.windowed("accepted", "drafted") == [None, None, None]
    assert h.rate("tokens") == [4.0, 4.0, 4.0]
    assert "<polyline" in views.sparkline(h.windowed("hit", "query"), 1.0)
