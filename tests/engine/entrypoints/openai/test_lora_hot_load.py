"""Adapter hot-load over HTTP: off unless the server has a --lora-dir; names resolve only inside
it; loaded adapters serve at once; unloaded ones keep serving the requests already running."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from web import API_KEY, make_state, serving, wait_idle

from engine import SamplingParams
from engine.entrypoints.openai.server import build_app

MODEL = "smollm2-135m-instruct"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def hot(demo_adapters):
    """A server that may load adapters from the demo adapters' folder; none loaded at start."""
    folder = Path(next(iter(demo_adapters.values())).path).parent
    state = make_state(MODEL, None, quantization=None, num_kv_blocks=256, enable_lora=True)
    state.lora_dir = folder
    with serving(build_app(state)) as url:
        yield url, state, folder
    state.engine.shutdown()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=HEADERS, timeout=60)


def models(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", headers=HEADERS).json()["data"]]


def completion(url: str, model: str, stream: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": "One, two,", "max_tokens": 12, "temperature": 0}
    return post(url, "/v1/completions", body | {"stream": stream})


def test_load_serve_unload(hot, offline, demo_adapters, monkeypatch):
    url, state, folder = hot
    assert models(url) == [MODEL]
    assert completion(url, "demo-lora-a").status_code == 404
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "demo-lora-a"})  # path: the name
    assert r.status_code == 200 and "demo-lora-a" in r.text
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "demo-lora-b"})
    assert r.status_code == 200
    assert models(url) == [MODEL, "demo-lora-a", "b"]
    params = SamplingParams(temperature=0, max_tokens=12)
    for name, adapter in (("demo-lora-a", "demo-lora-a"), ("b", "demo-lora-b")):
        got = completion(url, name).json()["choices"][0]["text"]
        (ref,) = offline.generate(
            "One, two,", params, use_tqdm=False, lora_request=demo_adapters[adapter]
        )
        assert got == ref.outputs[0].text
    base = offline.generate("One, two,", params, use_tqdm=False)[0].outputs[0].text
    assert got != base  # the adapter changes the answer, so the checks above can fail
    # Unloaded while a stream runs: that request finishes with the adapter's weights. A spy on
    # the engine's unload (it runs on the engine loop) records the request's own token count
    # when the unload comes: it must still be running then, short of its max_tokens, or this
    # checks nothing (12 tokens could all be out before the unload lands: 48 here).
    long = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    (ref,) = offline.generate(
        "One, two,", long, use_tqdm=False, lora_request=demo_adapters["demo-lora-b"]
    )
    engine = state.engine.engine
    at_unload: list[tuple[int, bool]] = []
    real_unload = engine.unload_lora

    def unload_lora(name):
        for group in engine.groups.values():
            at_unload.extend((r.num_output_tokens, r.is_finished) for r in group.requests)
        real_unload(name)

    monkeypatch.setattr(engine, "unload_lora", unload_lora)
    body = {"model": "b", "prompt": "One, two,", "max_tokens": 48, "temperature": 0}
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json=body | {"stream": True, "ignore_eos": True},
        headers=HEADERS,
        timeout=60,
    ) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
        rest = [line for line in lines if line.startswith("data: ")]
    ((num_at_unload, finished),) = at_unload  # the stream's request, and nothing else
    assert not finished and 1 <= num_at_unload < 48, at_unload
    chunks = [json.loads(x[6:]) for x in [first, *rest] if x != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ref.outputs[0].text
    assert models(url) == [MODEL, "demo-lora-a"]
    assert completion(url, "b").status_code == 404
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "demo-lora-a"}).status_code == 200
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"lora_name": "x", "lora_path": "../../etc"}, 400, "lora_path", ["--lora-dir"]),
        ({"lora_name": "x", "lora_path": "/etc"}, 400, "lora_path", ["--lora-dir"]),
        ({"lora_name": "x", "lora_path": "."}, 400, "lora_path", ["--lora-dir"]),
        ({"lora_name": "x", "lora_path": "missing"}, 400, "lora_path", ["<lora-dir>/missing"]),
        ({"lora_name": "n" * 65}, 400, "lora_name", ["1 to 64 letters"]),
        ({"lora_name": "a/b"}, 400, "lora_name", ["1 to 64 letters"]),
        ({"lora_name": "a b"}, 400, "lora_name", ["1 to 64 letters"]),
        ({"lora_name": "x", "lora_path": "a\x00b"}, 400, "lora_path", ["not a usable path"]),
        ({"lora_name": MODEL}, 400, "lora_name", ["taken"]),
        ({"lora_path": "demo-lora-a"}, 400, "lora_name", ["required"]),
        ({"lora_name": "x", "path": "y"}, 400, "path", ["unknown"]),
    ],
)
def test_bad_loads_name_the_field(hot, body, status, param, words):
    url, state, folder = hot
    r = post(url, "/v1/load_lora_adapter", body)
    assert r.status_code == status, r.text
    assert str(folder.resolve()) not in r.text  # where adapters live is not the client's business
    error = r.json()["error"]
    assert error["param"] == param
    assert all(w in error["message"] for w in words), error
    assert models(url) == [MODEL]
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


def test_off_without_a_lora_dir(smol):
    url, _ = smol
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 404 and "--lora-dir" in r.json()["error"]["message"]
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "demo-lora-a"})
    assert r.status_code == 404
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 401


def test_concurrent_loads_of_one_name(hot):
    """Loads run on the engine loop one at a time: of four racing loads of one name, one
    wins and the others hear that the name is taken."""
    from concurrent.futures import ThreadPoolExecutor

    url, state, _ = hot
    body = {"lora_name": "race", "lora_path": "demo-lora-a"}
    with ThreadPoolExecutor(4) as pool:
        codes = sorted(
            r.status_code
            for r in pool.map(lambda _: post(url, "/v1/load_lora_adapter", body), range(4))
        )
    assert codes == [200, 400, 400, 400]
    assert models(url) == [MODEL, "race"]
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "race"}).status_code == 200
    assert models(url) == [MODEL]


def test_unload_of_an_adapter_the_registry_evicted(demo_adapters):
    """With room for one adapter in memory, loading a second evicts the first from the
    registry; the server still lists it (a request reloads it), and unloading it works."""
    folder = Path(next(iter(demo_adapters.values())).path).parent
    state = make_state(
        MODEL,
        None,
        quantization=None,
        num_kv_blocks=64,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
    )
    state.lora_dir = folder
    with serving(build_app(state)) as url:
        for name in ("demo-lora-a", "demo-lora-b"):
            assert post(url, "/v1/load_lora_adapter", {"lora_name": name}).status_code == 200
        assert completion(url, "demo-lora-a").status_code == 200  # reloaded on use
        assert (
            post(
                url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "demo-lora-a"}
            ).status_code
            == 200
        )
        for name in ("demo-lora-b", "demo-lora-a", "x"):
            r = post(url, "/v1/unload_lora_adapter", {"lora_name": name})
            assert r.status_code == 200, r.text
        assert models(url) == [MODEL]
    state.engine.shutdown()


def test_adapters_served_are_bounded_and_listed_without_paths(hot):
    """A server lists at most max_adapters names (a load past them is refused), and
    /v1/models' root is an adapter's name, never its path on the server's machine."""
    url, state, folder = hot
    state.max_adapters = 2
    try:
        for name in ("p", "q"):
            body = {"lora_name": name, "lora_path": "demo-lora-a"}
            assert post(url, "/v1/load_lora_adapter", body).status_code == 200
        r = post(url, "/v1/load_lora_adapter", {"lora_name": "r", "lora_path": "demo-lora-a"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        assert "2 adapters are loaded" in r.json()["error"]["message"]
        listed = httpx.get(url + "/v1/models", headers=HEADERS)
        assert [(m["id"], m["root"]) for m in listed.json()["data"]] == [
            (MODEL, MODEL),
            ("p", "p"),
            ("q", "q"),
        ]
        assert str(folder.resolve()) not in listed.text and str(folder) not in listed.text
    finally:
        state.max_adapters = 64
        for name in ("p", "q"):
            post(url, "/v1/unload_lora_adapter", {"lora_name": name})
    assert models(url) == [MODEL]


def test_a_symlink_out_of_the_lora_dir_is_refused(hot, demo_adapters, tmp_path):
    """A link inside --lora-dir to a valid adapter elsewhere does not load it: names resolve
    (links followed) before the containment check."""
    import shutil

    url, state, folder = hot
    outside = tmp_path / "adapter"  # a real adapter, outside the folder
    shutil.copytree(next(iter(demo_adapters.values())).path, outside)
    link = folder / f"escape-{tmp_path.name}"
    link.symlink_to(outside, target_is_directory=True)
    try:
        r = post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": link.name})
    finally:
        link.unlink()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_path" and "--lora-dir" in error["message"]
    assert str(tmp_path) not in r.text
    assert models(url) == [MODEL]
