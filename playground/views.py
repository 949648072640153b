"""HTML views of the engine's snapshot for the playground: pure functions of plain dicts.

Blocks (pool bars, the physical grid coloured by owner, each request's block table), prefix
sharing, speculation (tokens by kind, acceptance by position and over time) and adapters.
"""

from __future__ import annotations

import hashlib
import html
import time
from collections import deque

from engine.detokenizer import ExactDecoder, IncrementalDetokenizer

KIND_STYLE = {  # token kind -> (label, colour)
    "p": ("plain", "transparent"),
    "f": ("forced (grammar)", "#d8c7ff"),
    "a": ("accepted draft", "#b9f0c0"),
    "b": ("bonus", "#a9d8ff"),
    "r": ("resampled", "#ffd59e"),
}
_REJECTED = "#ffb3b3"


def owner_colour(request_id: str, index: int = 0) -> str:
    hue = int(hashlib.sha1(f"{request_id}/{index}".encode()).hexdigest()[:4], 16) % 360
    return f"hsl({hue},70%,62%)"


def _esc(text: str) -> str:
    return html.escape(text).replace("\n", "↵<br>")


# ---- tokens ---------------------------------------------------------------------------------
class TokenPieces:
    """Each output token's text, decoded incrementally (a piece is what that token added; a
    token that ends inside a character adds nothing until a later one completes it). The
    engine's IncrementalDetokenizer: a short window per token, not the whole output again."""

    def __init__(self, tokenizer):
        self._detok = IncrementalDetokenizer(ExactDecoder(tokenizer), [], True, [], False)
        self.num_ids = 0
        self.pieces: list[str] = []

    def update(self, token_ids: list[int]) -> list[str]:
        for token in token_ids[self.num_ids :]:
            before = len(self._detok.text)
            self._detok.add_token(token, check_stop=False)
            self.pieces.append(self._detok.text[before:])
        self.num_ids = len(token_ids)
        return self.pieces


def render_tokens(pieces: list[str], kinds: str, rejected: list[tuple[int, str]]) -> str:
    """Output text with each token shaded by where it came from; rejected drafts struck out
    just before the token that replaced them."""
    struck = dict(rejected)
    spans = []
    for i, piece in enumerate(pieces):
        if i in struck:
            spans.append(
                f'<s class="tk-rejected" style="background:{_REJECTED}" '
                f'title="rejected drafts">{_esc(struck[i])}</s>'
            )
        kind = kinds[i] if i < len(kinds) else "p"
        label, colour = KIND_STYLE[kind]
        spans.append(
            f'<span class="tk tk-{kind}" style="background:{colour}" title="{label}">'
            f"{_esc(piece)}</span>"
        )
    return f'<div class="tandem-output" style="white-space:normal">{"".join(spans)}</div>'


def legend() -> str:
    items = [
        f'<span style="background:{c};padding:0 4px;border:1px solid #ccc">{label}</span>'
        for label, c in KIND_STYLE.values()
    ]
    items.append(f'<s style="background:{_REJECTED};padding:0 4px">rejected draft</s>')
    return '<div style="font-size:12px">' + " ".join(items) + "</div>"


# ---- history --------------------------------------------------------------------------------
class History:
    """Recent samples of the engine's counters, at most one every `period` seconds, so windowed
    rates (hit rate, acceptance, tokens/s) can be drawn over time."""

    def __init__(self, length: int = 120, period: float = 0.5):
        self.samples: deque[dict] = deque(maxlen=length)
        self.period = period

    def observe(self, snap: dict, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.samples and now - self.samples[-1]["t"] < self.period:
            return
        spec = snap["speculation"]
        pc = snap["prefix_cache"]
        self.samples.append(
            {
                "t": now,
                "query": pc["query_tokens"],
                "hit": pc["hit_tokens"],
                "drafted": spec["num_drafts"],
                "accepted": spec["num_accepted"],
                "tokens": snap["num_generated_tokens"],
            }
        )

    def windowed(self, num: str, den: str) -> list[float | None]:
        """Per interval: d(num) / d(den); where den did not move, the last value holds (None
        before the first)."""
        s = list(self.samples)
        out: list[float | None] = []
        for a, b in zip(s, s[1:], strict=False):
            d = b[den] - a[den]
            out.append((b[num] - a[num]) / d if d > 0 else (out[-1] if out else None))
        return out

    def rate(self, key: str) -> list[float]:
        s = list(self.samples)
        return [
            (b[key] - a[key]) / (b["t"] - a["t"]) if b["t"] > a["t"] else 0.0
            for a, b in zip(s, s[1:], strict=False)
        ]


def sparkline(values: list[float | None], top: float | None = None, w: int = 260, h: int = 48):
    """An inline SVG polyline; gaps where a value is None."""
    real = [v for v in values if v is not None]
    top = top if top is not None else max(real, default=1.0) or 1.0
    n = max(len(values) - 1, 1)
    segments, current = [], []
    for i, v in enumerate(values):
        if v is None:
            if current:
                segments.append(current)
            current = []
            continue
        current.append(f"{i * w / n:.1f},{h - 2 - min(v, top) / top * (h - 4):.1f}")
    if current:
        segments.append(current)
    lines = "".join(
        f'<polyline fill="none" stroke="#3b6fd8" stroke-width="1.5" points="{" ".join(p)}"/>'
        for p in segments
    )
    return (
        f'<svg width="{w}" height="{h}" style="background:#f6f7fb;border:1px solid #dde">'
        f"{lines}</svg>"
    )


# ---- blocks ---------------------------------------------------------------------------------
def add_text(snap: dict, tokenizer) -> None:
    """Each request's `text`: its tail_token_ids decoded (the end of its prompt and output)."""
    for r in snap["requests"]:
        r["text"] = tokenizer.decode(r["tail_token_ids"]) if r.get("tail_token_ids") else ""


def _bar(parts: list[tuple[str, int, str]], total: int) -> str:
    cells = "".join(
        f'<div title="{label}: {n}" style="width:{100 * n / total:.2f}%;background:{c}"></div>'
        for label, n, c in parts
        if n
    )
    text = " · ".join(f"{label} {n}" for label, n, _ in parts)
    return (
        f'<div style="display:flex;height:14px;border:1px solid #999;width:100%">{cells}</div>'
        f'<div style="font-size:12px">{text} (of {total} blocks)</div>'
    )


def owners_by_block(snap: dict) -> dict[int, list[tuple[str, int]]]:
    owners: dict[int, list[tuple[str, int]]] = {}
    for r in snap["requests"]:
        for b in r["block_table"]:
            owners.setdefault(b, []).append((r["request_id"], r["index"]))
    return owners


def render_blocks(snap: dict, max_cells: int = 1024) -> str:
    total = snap["num_blocks"]
    cached = snap["num_cached_free_blocks"]
    used = snap["num_used_blocks"]
    pool = _bar(
        [
            ("used", used, "#4f7cff"),
            ("cached (free, reusable)", cached, "#9aa4b5"),
            ("free", snap["num_free_blocks"] - cached, "#e8ebf2"),
        ],
        total,
    )
    owners = owners_by_block(snap)
    blocks = snap["blocks"]
    other = "free, or another key's" if snap.get("is_tenant_view") else "free"
    cells = []
    for b in range(1, min(total, max_cells) + 1):
        info = blocks.get(b) or blocks.get(str(b))
        who = owners.get(b, [])
        ref = info["ref_count"] if info else 0
        if who:
            colour = owner_colour(*who[0])
            title = f"block {b}: ref {ref}, " + ", ".join(f"{r}/{i}" for r, i in who)
        elif info and info["hash"]:
            colour, title = "#9aa4b5", f"block {b}: cached {info['hash']}"
        else:  # (a key's view lists its own blocks alone: the pool bar counts the rest)
            colour, title = "#e8ebf2", f"block {b}: {other}"
        shared = ref > 1
        border = "2px solid #111" if shared else "1px solid #fff"
        label = str(ref) if shared else ""
        cells.append(
            f'<div class="blk{" blk-shared" if shared else ""}" title="{html.escape(title)}" '
            f'style="background:{colour};border:{border}">{label}</div>'
        )
    more = f"<div>… {total - max_cells} more blocks not drawn</div>" if total > max_cells else ""
    grid = f'<div class="blk-grid">{"".join(cells)}</div>{more}'
    return (
        _BLOCK_CSS
        + f"<h4>KV pool</h4>{pool}<h4>Physical blocks (number = reference count)</h4>{grid}"
        + "<h4>Block tables of running requests</h4>"
        + render_block_tables(snap)
    )


def render_block_tables(snap: dict) -> str:
    if not snap["requests"]:
        return "<div><i>no running requests</i></div>"
    blocks = snap["blocks"]
    rows = []
    for r in snap["requests"]:
        cells = []
        for b in r["block_table"]:
            info = blocks.get(b) or blocks.get(str(b)) or {"ref_count": 1}
            shared = info["ref_count"] > 1
            cells.append(
                f'<div class="blk{" blk-shared" if shared else ""}" '
                f'style="background:{owner_colour(r["request_id"], r["index"])};'
                f"border:{'2px solid #111' if shared else '1px solid #fff'};width:auto;"
                f'padding:0 3px" title="ref {info["ref_count"]}">{b}</div>'
            )
        name = html.escape(f"{r['request_id']}/{r['index']}")
        detail = (
            f"{r['num_computed_tokens']}/{r['num_tokens']} tokens, "
            f"{r['num_cached_tokens']} from cache"
        )
        text = html.escape(r.get("text", "")).replace("\n", "↵")
        rows.append(
            f'<tr class="blk-row"><td style="white-space:nowrap">{name}</td><td>{detail}</td>'
            f'<td class="blk-text">…{text}</td>'
            f'<td><div class="blk-grid">{"".join(cells)}</div></td></tr>'
        )
    return '<table class="blk-tables">' + "".join(rows) + "</table>"


_BLOCK_CSS = """<style>
.blk-grid{display:flex;flex-wrap:wrap;gap:1px}
.blk{width:15px;height:15px;font-size:9px;line-height:13px;text-align:center;box-sizing:border-box;
 color:#111}
.blk-tables td{padding:2px 6px;font-size:12px;vertical-align:top}
.blk-text{max-width:22em;font-family:monospace;font-size:11px;color:#444;word-break:break-all}
</style>"""


# ---- prefix sharing ------------------------------------------------------------------------
def render_sharing(snap: dict, history: History) -> str:
    owners = owners_by_block(snap)
    groups: dict[tuple, list[int]] = {}
    for b, who in owners.items():
        if len(who) > 1:
            groups.setdefault(tuple(sorted(set(who))), []).append(b)
    rows = "".join(
        f"<tr><td>{len(bs)} blocks ({', '.join(map(str, sorted(bs)[:12]))}"
        f"{'…' if len(bs) > 12 else ''})</td><td>"
        + ", ".join(html.escape(f"{r}/{i}") for r, i in who)
        + "</td></tr>"
        for who, bs in sorted(groups.items(), key=lambda kv: -len(kv[1]))
    )
    table = (
        f'<table class="share"><tr><th>shared blocks</th><th>requests</th></tr>{rows}</table>'
        if rows
        else "<div><i>no blocks shared right now</i></div>"
    )
    pc = snap["prefix_cache"]
    return (
        f"<div>prefix-cache hit rate: <b>{pc['hit_rate']:.1%}</b> of "
        f"{pc['query_tokens']} prompt tokens ({pc['hit_tokens']} hit), "
        f"{pc['evictions']} evictions</div>"
        "<div>hit rate over time (per interval, held while no prompt arrives)</div>"
        f"{sparkline(history.windowed('hit', 'query'), 1.0)}"
        f"{table}"
    )


# ---- speculation -----------------------------------------------------------------------------
def render_speculation(snap: dict, history: History) -> str:
    spec = snap["speculation"]
    by_pos = spec["acceptance_by_position"]
    bars = "".join(
        f'<div title="position {j}: {a:.0%} of {d}" style="display:flex;align-items:end;'
        f'height:60px;width:22px;margin-right:2px"><div style="width:100%;height:{a * 100:.0f}%;'
        f'background:#5cb85c"></div></div>'
        for j, (a, d) in enumerate(zip(by_pos, spec["drafted_at"], strict=True))
    )
    labels = "".join(
        f'<div style="width:22px;margin-right:2px;font-size:10px;text-align:center">{j}</div>'
        for j in range(len(by_pos))
    )
    per_request = "".join(
        f"<tr><td>{html.escape(r['request_id'])}/{r['index']}</td><td>k={r['spec']['k']}</td>"
        f"<td>{r['spec']['acceptance_rate']:.0%} of {r['spec']['num_drafts']}</td>"
        f"<td>{r['spec']['mean_accepted_length']:.2f}</td></tr>"
        for r in snap["requests"]
    )
    return (
        f"<div>method: <b>{spec['method'] or 'none'}</b> · drafted {spec['num_drafts']} · "
        f"accepted {spec['num_accepted']} (<b>{spec['acceptance_rate']:.1%}</b>) · forced "
        f"{spec['num_forced']} · mean accepted length "
        f"<b>{spec['mean_accepted_length']:.2f}</b> tokens/step · "
        f"{snap.get('tokens_per_second', 0.0):.1f} tokens/s</div>"
        f'<div>acceptance by draft position</div><div style="display:flex">{bars}</div>'
        f'<div style="display:flex">{labels}</div>'
        f"<div>acceptance over time (per interval)</div>"
        f"{sparkline(history.windowed('accepted', 'drafted'), 1.0)}"
        f"<div>tokens/s over time</div>{sparkline(history.rate('tokens'))}"
        + (
            "<table><tr><th>request</th><th>k</th><th>acceptance</th><th>tokens/step</th></tr>"
            f"{per_request}</table>"
            if per_request
            else ""
        )
    )


# ---- adapters --------------------------------------------------------------------------------
def render_adapters(snap: dict) -> str:
    lora = snap["lora"]
    if not lora["enabled"]:
        return "<div><i>LoRA is off (start with --lora NAME=PATH)</i></div>"
    slots = "".join(
        f'<div class="slot" style="border:1px solid #888;padding:4px 8px;margin:2px;'
        f'background:{owner_colour(name) if name else "#eee"}">slot {i + 1}: '
        f"{html.escape(name) if name else '<i>empty</i>'}</div>"
        for i, name in enumerate(lora["slots"])
    )
    rows = "".join(
        f"<tr><td>{html.escape(r['request_id'])}/{r['index']}</td>"
        f"<td>{html.escape(r['lora'] or '(base model)')}</td>"
        f"<td>{r['constraint'] or ''}</td></tr>"
        for r in snap["requests"]
    )
    return (
        f"<div>loaded: {html.escape(', '.join(lora['loaded']) or 'none')} · slot loads "
        f"{lora['slot_loads']}</div>"
        f'<div style="display:flex;flex-wrap:wrap">{slots}</div>'
        "<table><tr><th>request</th><th>adapter</th><th>constraint</th></tr>"
        f"{rows}</table>"
    )
