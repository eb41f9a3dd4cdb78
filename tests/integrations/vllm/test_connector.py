"""HiCacheKVConnector in a real vLLM engine: hits, outputs, other processes, faults.

vLLM's own prefix caching is off in every engine here, so a cached token can only come
from the connector, and every output is compared with the output of an engine without
the connector (greedy sampling, same seed): a loaded block that held other bytes would
change it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import vllm_faults
from vllm_engine import BLOCK, engine, generate, run_streams, totals

WORKERS = Path(__file__).parents[2] / "workers"

# Prompts (token ids; blocks of 32). A: 70 tokens, 2 full blocks and 6 more. B: A's
# first block, then other tokens. C: exactly 2 blocks (a hit may cover only the first:
# vLLM must compute the last token). D, E, F: unrelated 70-token prompts.
A = list(range(10, 80))
B = A[:BLOCK] + list(range(200, 238))
C = list(range(300, 364))
D = list(range(400, 470))
E = list(range(500, 570))
F = list(range(600, 670))
G = list(range(700, 770))
P = list(range(100, 250))  # 150 tokens: 4 full blocks and 22 more
Q = A[: 2 * BLOCK] + list(range(800, 886))  # A's two blocks, then two more and 22 tokens
R = E[: 2 * BLOCK] + list(range(886, 972))  # the same over E
PROMPTS = {"A": A, "B": B, "C": C, "D": D, "E": E, "F": F, "G": G, "P": P, "Q": Q, "R": R}


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> dict[str, list[int]]:
    """Each prompt's greedy output from an engine without the connector."""
    with engine(tiny_model, None) as llm:
        outs = generate(llm, list(PROMPTS.values()))
    return {name: o["tokens"] for name, o in zip(PROMPTS, outs, strict=True)}


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_second_prompt_is_served_from_the_store(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    root = tmp_path / "kv"
    with engine(tiny_model, "file", {"root": str(root)}) as llm:
        first = generate(llm, [A])[0]
        assert first["cached"] == 0 and first["tokens"] == expected["A"]
        t = totals(llm)
        assert t["save_blocks"] == 2 and t["save_failed_blocks"] == 0  # A's 2 full blocks
        assert t["save_partial_blocks"] == 1  # and its last block, partly computed
        assert len(_files(root)) == 3

        again = generate(llm, [A])[0]
        assert again["cached"] == 2 * BLOCK  # the block-aligned prefix, from the store
        assert again["tokens"] == expected["A"]
        t = totals(llm)
        assert t["load_blocks"] == 2 and t["load_failed_blocks"] == 0
        assert t["save_blocks"] == 2  # nothing stored twice

        # Only the first block is shared: only it is loaded; B's own block is stored.
        b = generate(llm, [B])[0]
        assert b["cached"] == BLOCK and b["tokens"] == expected["B"]
        assert totals(llm)["load_blocks"] == 3 and totals(llm)["save_blocks"] == 3

        # A prompt of exactly two blocks, all stored: both are loaded, and the hit is every
        # token but the last, which vLLM computes (one token, not the last block).
        c1, c2 = generate(llm, [C]), generate(llm, [C])
        assert c1[0]["cached"] == 0 and c2[0]["cached"] == 2 * BLOCK - 1
        assert c1[0]["tokens"] == c2[0]["tokens"] == expected["C"]
        assert totals(llm)["save_blocks"] == 5
        assert totals(llm)["load_blocks"] == 5

        # Several requests in one step: hits and misses side by side.
        outs = generate(llm, [A, D, B])
        assert [o["cached"] for o in outs] == [2 * BLOCK, 0, 2 * BLOCK]
        assert [o["tokens"] for o in outs] == [expected["A"], expected["D"], expected["B"]]
        assert totals(llm)["hook_errors"] == 0


# A chat: turn 1's prompt (70 tokens) and 60 generated tokens hold 4 full blocks and one
# token (the KV of all but the last generated token is computed); turn 2 is all of it and
# 10 new tokens.
TURN1 = list(range(40, 110))
TURN1_OUT = 60


def test_the_next_turn_hits_through_the_previous_answer(tiny_model: Path, tmp_path: Path) -> None:
    with engine(tiny_model, None) as llm:
        answer = generate(llm, [TURN1], max_tokens=TURN1_OUT)[0]["tokens"]
        turn2 = TURN1 + answer + list(range(900, 910))
        want = generate(llm, [turn2])[0]["tokens"]
    runs = {}
    for cap in (8192, 0):
        root = tmp_path / f"kv-{cap}"
        opts = {"root": str(root), "store_output_tokens": cap}
        with engine(tiny_model, "file", opts) as llm:
            first = generate(llm, [TURN1], max_tokens=TURN1_OUT)[0]
            assert first["tokens"] == answer
            stored = totals(llm)["save_blocks"]
        with engine(tiny_model, "file", opts) as llm:  # a new engine: only the store helps
            runs[cap] = (stored, generate(llm, [turn2])[0])
    stored, out = runs[8192]
    assert stored == 4  # 2 prompt blocks, and 2 blocks of the answer
    # ... and the answer's last block, whose one token with KV (the 129th) is stored as
    # a partial block: the next turn computes from token 129, not 128.
    assert out["cached"] == 4 * BLOCK + 1 and out["tokens"] == want
    stored, out = runs[0]  # prompt blocks only: the answer is recomputed
    assert stored == 2
    assert out["cached"] == len(TURN1) and out["tokens"] == want  # (its 6-token tail too)


def test_a_full_hit_computes_one_token_and_the_output_is_unchanged(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Every block of a block-aligned prompt in the store: vLLM computes only its last token."""
    prompt = list(range(20, 20 + 4 * BLOCK))
    with engine(tiny_model, None) as llm:
        want = generate(llm, [prompt], max_tokens=16)[0]["tokens"]
    opts = {"root": str(tmp_path / "kv")}
    with engine(tiny_model, "file", opts) as llm:
        assert generate(llm, [prompt], max_tokens=16)[0]["cached"] == 0
    with engine(tiny_model, "file", opts) as llm:
        out = generate(llm, [prompt], max_tokens=16)[0]
        t = totals(llm)
    assert out["cached"] == 4 * BLOCK - 1 and out["tokens"] == want
    assert t["load_blocks"] == 4 and t["load_failed_blocks"] == 0


def test_a_hit_beside_a_running_request_loads_in_the_background(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """A request whose prefix is stored arrives while another decodes: vLLM runs the
    other's steps while the load runs, then the request computes one token."""
    opts = {"root": str(tmp_path / "kv")}
    with engine(tiny_model, "file", opts) as llm:
        assert generate(llm, [C])[0]["cached"] == 0  # C stored
    with engine(tiny_model, None) as llm:
        want_d = generate(llm, [D], max_tokens=40)[0]["tokens"]
    with engine(tiny_model, "file", opts) as llm:
        d, c = run_streams(llm, [(D, 40, 0), (C, 8, 3)])
        t = totals(llm)
    assert d["tokens"] == want_d and d["cached"] == 0
    assert c["tokens"] == expected["C"] and c["cached"] == 2 * BLOCK - 1
    assert t["background_loads"] == 1 and t["load_blocks"] == 2
    assert t["load_failed_blocks"] == 0 and t["hook_errors"] == 0


def _options(
    name: str, tmp_path: Path, redis_url: str | None = None, s3: dict[str, Any] | None = None,
    mooncake: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    if name == "redis":
        return {"url": redis_url, "prefix": f"vllm-{tmp_path.name}:"}
    if name == "s3":
        return {**(s3 or {}), "prefix": f"vllm-{tmp_path.name}"}
    if name == "mooncake":
        return {"master_server_address": mooncake, "global_segment_size": 0,
                "local_buffer_size": "32MiB", "prefix": f"vllm-{tmp_path.name}/"}  # fmt: skip
    local: dict[str, dict[str, Any]] = {
        "file": {"root": str(tmp_path / "file")},
        "shm": {"root": str(tmp_path / "shm")},
        "mmap": {"path": str(tmp_path / "arena"), "max_size": "32MiB", "prefault": False},
        "memory": {"store": f"vllm-{tmp_path.name}"},
    }
    return local[name]


@pytest.mark.parametrize("name", ["shm", "mmap", "memory", "redis", "s3", "mooncake"])
def test_every_backend_serves_vllm(
    name: str, tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]],
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    services = {
        "redis_url": request.getfixturevalue("redis_url") if name == "redis" else None,
        "s3": request.getfixturevalue("s3_options") if name == "s3" else None,
        "mooncake": request.getfixturevalue("mooncake_master") if name == "mooncake" else None,
    }
    with engine(tiny_model, name, _options(name, tmp_path, **services)) as llm:
        outs = [generate(llm, [E])[0], generate(llm, [E])[0]]
        t = totals(llm)
    assert [o["cached"] for o in outs] == [0, 2 * BLOCK]
    assert outs[0]["tokens"] == outs[1]["tokens"] == expected["E"]
    assert t["save_blocks"] == 2 and t["load_blocks"] == 2 and t["hook_errors"] == 0


def in_new_process(model: Path, runs: list[dict[str, Any]], tmp_path: Path) -> Any:
    """Each of ``runs`` (backend, options, prompts) in one new interpreter: its outputs."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": str(model), "runs": runs}))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(WORKERS), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "vllm_engine.py"), str(plan)],
        check=False, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_a_new_engine_process_hits_what_another_stored(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]], redis_url: str
) -> None:
    backends = ["file", "shm", "mmap", "redis"]
    runs = []
    for name in backends:
        options = _options(name, tmp_path, redis_url=redis_url)
        with engine(tiny_model, name, options) as llm:
            assert generate(llm, [F])[0]["cached"] == 0
        # The first run with vLLM's default engine process (the connector is built there).
        runs.append({"backend": name, "options": options, "prompts": [F, G],
                     "multiprocessing": name == "file"})  # fmt: skip
    results = in_new_process(tiny_model, runs, tmp_path)
    for name, (f, g) in zip(backends, results, strict=True):
        assert f["cached"] == 2 * BLOCK, name  # stored by the other process
        assert f["tokens"] == expected["F"], name
        assert g["cached"] == 0 and g["tokens"] == expected["G"], name


def test_a_tp_2_engines_blocks_load_in_a_tp_1_engine(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """Head groups: TP 2 ranks (one KV head each, vLLM's multiprocess executor, ranks
    agreeing on their writer through torch.distributed) store blocks of both heads that
    a TP 1 engine loads, and its output is the uncached one."""
    options = {"root": str(tmp_path / "kv"), "head_groups": 2}
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    [[first]] = in_new_process(
        tiny_model, [{"backend": "file", "options": options, "prompts": [F], "llm_args": tp2}],
        tmp_path,
    )  # fmt: skip
    assert first["cached"] == 0 and first["tokens"] == expected["F"]
    assert sorted({p.name.rpartition(".")[2] for p in _files(tmp_path / "kv")}) == ["h0-0", "h1-1"]
    with engine(tiny_model, "file", options) as llm:
        [again] = generate(llm, [F])
    assert again["cached"] == 2 * BLOCK  # both full blocks, written by the TP 2 ranks
    assert again["tokens"] == expected["F"]


def test_damaged_or_lost_objects_never_change_the_output(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    root = tmp_path / "kv"
    # (partial_blocks off: the test counts and damages the objects of full blocks)
    with engine(tiny_model, "file", {"root": str(root), "partial_blocks": False}) as llm:
        assert generate(llm, [D])[0]["tokens"] == expected["D"]
        objects = _files(root)
        assert len(objects) == 2
        # Flip bytes in the middle of each stored block (the KV, not the header).
        for path in objects:
            data = bytearray(path.read_bytes())
            for i in range(100, len(data) // 2, 97):
                data[i] ^= 0x5A
            path.write_bytes(bytes(data))
        out = generate(llm, [D])[0]
        assert out["tokens"] == expected["D"] and out["finish"] == "length"
        t = totals(llm)
        assert t["load_failed_blocks"] == 2 and t["load_blocks"] == 0

        # The damaged objects were dropped, and the blocks vLLM computed again stored in
        # their place: the next request hits them.
        assert len(_files(root)) == 2
        out = generate(llm, [D])[0]
        assert out["cached"] == 2 * BLOCK and out["tokens"] == expected["D"]
        # A truncated object, then a deleted one: a failed load, then a miss.
        first, _ = _files(root)
        first.write_bytes(first.read_bytes()[:1000])
        out = generate(llm, [D])[0]
        assert out["tokens"] == expected["D"]
        assert totals(llm)["load_failed_blocks"] == 3
        for path in _files(root):
            path.unlink()
        out = generate(llm, [D])[0]
        assert out["cached"] == 0 and out["tokens"] == expected["D"]
        assert totals(llm)["hook_errors"] == 0


def test_a_failing_backend_never_fails_a_request(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    sys.path.insert(0, str(WORKERS))
    options = {"root": str(tmp_path / "kv"), "partial_blocks": False}  # (counts full blocks)
    try:
        with engine(tiny_model, "vllm_faults:FlakyFile", options) as llm:
            runs: list[tuple[str, str]] = [
                ("ok", "ABE"),  # stores A, B, E
                ("torn", "ABE"),  # one block of each fails to load, torn: recomputed
                ("lie", "AF"),  # F was never stored: both of its blocks fail to load
                ("raise", "ABE"),  # lookups miss, stores fail
                ("nosave", "G"),  # G is not stored
                ("ok", "AG"),  # A still hits; G misses
            ]
            for mode, names in runs:
                vllm_faults.MODE[0] = mode
                outs = generate(llm, [PROMPTS[n] for n in names])
                assert [o["tokens"] for o in outs] == [expected[n] for n in names], mode
                assert all(o["finish"] == "length" for o in outs), mode
            t = totals(llm)
    finally:
        vllm_faults.MODE[0] = "ok"
    assert [o["cached"] for o in outs] == [2 * BLOCK, 0]
    assert t["load_failed_blocks"] == 3 + 2
    assert t["save_failed_blocks"] == 6 + 2  # A, B and E's blocks while raising; G's
    assert t["hook_errors"] == 0  # every fault came back as a failure result


def test_fail_policy_is_left_to_vllm(tiny_model: Path, tmp_path: Path) -> None:
    """With vLLM's default policy ("fail"), a block that fails to load fails its request."""
    sys.path.insert(0, str(WORKERS))
    options = {"root": str(tmp_path / "kv")}
    try:
        with engine(tiny_model, "vllm_faults:FlakyFile", options, policy="fail") as llm:
            assert generate(llm, [A])[0]["finish"] == "length"
            vllm_faults.MODE[0] = "torn"
            failed = generate(llm, [A])[0]
    finally:
        vllm_faults.MODE[0] = "ok"
    assert failed["finish"] == "error"


def test_namespaces_keep_deployments_apart(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    root = str(tmp_path / "kv")
    with engine(tiny_model, "file", {"root": root}) as llm:
        generate(llm, [A])
    with engine(tiny_model, "file", {"root": root, "tenant": "other"}) as llm:
        out = generate(llm, [A])[0]
    assert out["cached"] == 0 and out["tokens"] == expected["A"]
    with engine(tiny_model, "file", {"root": root}, block_size=64) as llm:
        out = generate(llm, [A])[0]
    assert out["cached"] == 0 and out["tokens"] == expected["A"]
    with engine(tiny_model, "file", {"root": root}) as llm:  # the first deployment still hits
        assert generate(llm, [A])[0]["cached"] == 2 * BLOCK


def test_chunked_prefill_and_vllms_own_prefix_cache(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """A prompt prefilled in chunks is stored block by block; vLLM's own prefix cache
    serves what it holds, and the store serves a new engine."""
    options = {"root": str(tmp_path / "kv")}
    chunked: dict[str, Any] = {"enable_prefix_caching": True, "max_num_batched_tokens": 48}
    with engine(tiny_model, "file", options, **chunked) as llm:
        first = generate(llm, [P])[0]
        assert first["cached"] == 0 and first["tokens"] == expected["P"]
        assert totals(llm)["save_blocks"] == 4
        again = generate(llm, [P])[0]  # vLLM's prefix cache: nothing loaded
        assert again["cached"] == 4 * BLOCK and again["tokens"] == expected["P"]
        assert totals(llm)["load_blocks"] == 0
    with engine(tiny_model, "file", options, **chunked) as llm:
        out = generate(llm, [P])[0]  # a new engine: from the store
        assert out["cached"] == 4 * BLOCK and out["tokens"] == expected["P"]
        assert totals(llm)["load_blocks"] == 4 and totals(llm)["save_blocks"] == 0


def _a_store_that_dies_mid_run(
    llm: Any, expected: dict[str, list[int]], stop: Any, start: Any
) -> None:
    """The store's server stops under a running engine: requests cost misses, never
    output; the lookups' breaker opens and later lookups answer at once; the server
    back (empty), the probes close the breakers and a prompt stored again hits."""
    assert generate(llm, [E])[0]["cached"] == 0
    assert generate(llm, [E])[0]["cached"] == 2 * BLOCK
    stop()
    down = generate(llm, [E, A])
    assert [o["cached"] for o in down] == [0, 0]  # lookups fail: misses
    assert [o["tokens"] for o in down] == [expected["E"], expected["A"]]
    assert all(o["finish"] == "length" for o in down)
    # More of them: the lookups' circuit breaker opens (5 failed in a row), and
    # later lookups answer at once without the store.
    more = generate(llm, [A, E, A])
    assert [o["tokens"] for o in more] == [expected["A"], expected["E"], expected["A"]]
    lookup = llm.hicache_connectors["SCHEDULER"].connector_scheduler.lookup_backends[0]
    assert lookup.circuit == "open"
    t0 = time.monotonic()
    assert generate(llm, [E])[0]["tokens"] == expected["E"]  # (answered at once)
    assert time.monotonic() - t0 < 30  # (generous: never a store's timeout per call)
    assert lookup.get_stats(reset=False).breaker_rejections >= 1
    start()  # back, empty: a miss that stores again, then a hit
    # The breakers close once their probe finds the store back (1 s, doubling).
    worker = llm.hicache_connectors["WORKER"].connector_worker.backend
    end = time.monotonic() + 90
    while lookup.circuit != "closed" or worker.circuit not in ("closed", "half_open"):
        generate(llm, [A], max_tokens=1)  # (calls that let a trial through)
        assert time.monotonic() < end, (lookup.circuit, worker.circuit)
        time.sleep(0.5)
    first = generate(llm, [E])[0]
    back = generate(llm, [E])[0]
    t = totals(llm)
    assert first["tokens"] == back["tokens"] == expected["E"]
    assert back["cached"] == 2 * BLOCK
    assert t["save_failed_blocks"] >= 2 and t["hook_errors"] == 0


def test_a_redis_server_that_dies_mid_run_costs_only_misses(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    from redis_server import running

    with running(tmp_path / "redis") as server:
        options = {"url": server.url, "prefix": "vllm-dies:", "socket_timeout": 0.5}
        with engine(tiny_model, "redis", options) as llm:
            _a_store_that_dies_mid_run(llm, expected, server.stop, server.start)


def test_an_s3_server_that_dies_mid_run_costs_only_misses(
    tiny_model: Path, expected: dict[str, list[int]]
) -> None:
    """moto killed under the engine, then started again on its port (empty: the bucket
    is made again, as an operator would)."""
    from moto_server import running_moto

    with running_moto() as server:
        server.make_bucket("hicache-dies")

        def start() -> None:
            server.start()
            server.make_bucket("hicache-dies")

        options = {"endpoint_url": server.endpoint, "bucket": "hicache-dies",
                   "key": server.key, "secret": server.secret, "region": "us-east-1",
                   "prefix": "vllm-dies", "connect_timeout": 0.5, "read_timeout": 2.0,
                   "retries": 0, "deadline": 3.0}  # fmt: skip
        with engine(tiny_model, "s3", options) as llm:
            _a_store_that_dies_mid_run(llm, expected, server.stop, start)


def test_a_mooncake_master_that_dies_mid_run_costs_only_misses(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """mooncake_master killed under the engine, then started again on its port (empty:
    the master keeps no metadata; the storage node stays and mounts its segment again).
    A read of a dead master blocks seconds in the client: the lookups stay within
    ``engine_timeout`` and the breaker keeps them off it."""
    from mooncake_master import require_private_network, running_store

    require_private_network()
    with running_store(64 << 20) as (master, _holder):
        options = _options("mooncake", tmp_path, mooncake=master.address)
        with engine(tiny_model, "mooncake", options) as llm:
            _a_store_that_dies_mid_run(llm, expected, master.stop, master.start)


def test_a_failed_load_never_poisons_what_later_requests_load(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """Blocks computed over a block that failed to load are not stored: a later request
    that loads the whole prefix gets the uncached output (a damaged object, then a torn
    read)."""
    sys.path.insert(0, str(WORKERS))
    root = tmp_path / "kv"
    try:
        with engine(tiny_model, "vllm_faults:FlakyFile", {"root": str(root)}) as llm:
            generate(llm, [A, E])  # A's and E's two blocks stored
            for path in _files(root):  # damage them all
                data = bytearray(path.read_bytes())
                for i in range(100, len(data) // 2, 97):
                    data[i] ^= 0x5A
                path.write_bytes(bytes(data))
            outs = [generate(llm, [Q])[0] for _ in range(3)]
            assert [o["tokens"] for o in outs] == [expected["Q"]] * 3
            assert outs[2]["cached"] == 4 * BLOCK  # all four from the store, and right
            t = totals(llm)
            assert t["load_failed_blocks"] == 2 and t["save_skipped_blocks"] == 2

            generate(llm, [E])  # E's damaged blocks dropped, stored again
            vllm_faults.MODE[0] = "torn"  # E's first block fails to load, torn
            assert generate(llm, [R])[0]["tokens"] == expected["R"]
            vllm_faults.MODE[0] = "ok"
            outs = [generate(llm, [R])[0] for _ in range(2)]
            assert [o["tokens"] for o in outs] == [expected["R"]] * 2
            assert outs[1]["cached"] == 4 * BLOCK
            assert totals(llm)["save_skipped_blocks"] >= 4
    finally:
        vllm_faults.MODE[0] = "ok"


def test_two_models_behind_one_relative_path_never_share_blocks(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model="model" from two folders, other weights behind the same config.json: the
    second engine computes its own KV, and its output is its own model's."""
    import shutil

    from vllm_engine import build_tiny_model

    shutil.copytree(tiny_model, tmp_path / "one" / "model")
    build_tiny_model(tmp_path / "two" / "model", seed=1)
    options = {"root": str(tmp_path / "kv")}
    monkeypatch.chdir(tmp_path / "two")
    with engine(Path("model"), None) as llm:
        want_two = generate(llm, [A])[0]["tokens"]
    monkeypatch.chdir(tmp_path / "one")
    with engine(Path("model"), "file", options) as llm:
        assert generate(llm, [A])[0]["cached"] == 0
        assert generate(llm, [A])[0]["cached"] == 2 * BLOCK  # stored, and hit
    monkeypatch.chdir(tmp_path / "two")
    with engine(Path("model"), "file", options) as llm:
        out = generate(llm, [A])[0]
    assert out["cached"] == 0 and out["tokens"] == want_two


def test_a_hung_store_never_stalls_vllm(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """A store whose calls never return: every request still completes with the right
    output (lookups miss, loads fail and are recomputed, stores are dropped), each vLLM
    call waiting at most the deadline."""
    sys.path.insert(0, str(WORKERS))
    options = {"root": str(tmp_path / "kv"), "engine_timeout": 1.0}
    vllm_faults.RELEASE.clear()
    try:
        with engine(tiny_model, "vllm_faults:FlakyFile", options) as llm:
            generate(llm, [A, E])  # stored
            vllm_faults.MODE[0] = "hangread"  # lookups hit, reads never return
            outs = generate(llm, [A, E])
            assert [o["tokens"] for o in outs] == [expected["A"], expected["E"]]
            assert all(o["finish"] == "length" for o in outs)
            vllm_faults.MODE[0] = "hang"  # everything hangs
            outs = generate(llm, [A, B, F])
            assert [o["tokens"] for o in outs] == [expected[n] for n in "ABF"]
            assert [o["cached"] for o in outs] == [0, 0, 0]
            t = totals(llm, settle=False)  # (the stores hang in the background)
            vllm_faults.RELEASE.set()
    finally:
        vllm_faults.MODE[0] = "ok"
        vllm_faults.RELEASE.set()
    assert t["load_timeouts"] >= 1 and t["lookup_timeouts"] >= 1
    assert t["load_failed_blocks"] >= 4 and t["hook_errors"] == 0


def test_flipped_bytes_in_shm_never_change_the_output_by_default(
    tiny_model: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """shm verifies what it reads by default: damaged KV is a failed load, recomputed."""
    options = {"root": str(tmp_path / "shm"), "partial_blocks": False}  # (damages full blocks)
    with engine(tiny_model, "shm", options) as llm:
        assert generate(llm, [D])[0]["tokens"] == expected["D"]
        objects = _files(tmp_path / "shm")
        assert len(objects) == 2
        for path in objects:
            data = bytearray(path.read_bytes())
            for i in range(len(data) // 2, len(data) - 100, 97):
                data[i] ^= 0x5A
            path.write_bytes(bytes(data))
        out = generate(llm, [D])[0]
        t = totals(llm)
    assert out["tokens"] == expected["D"]
    assert t["load_failed_blocks"] == 2 and t["load_blocks"] == 0


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a sliding-window layer (window 16) beside a full one."""
    from vllm_engine import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("swa-model"), seed=5, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"])  # fmt: skip


SWA_PROMPT = list(range(300, 400))  # 100 tokens: 3 full blocks, well past the window


@pytest.fixture(scope="module")
def swa_expected(swa_model: Path) -> list[int]:
    """The sliding-window model's greedy output of ``SWA_PROMPT`` without the connector."""
    with engine(swa_model, None) as llm:
        return generate(llm, [SWA_PROMPT], max_tokens=12)[0]["tokens"]


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid-allocator", "one-group"])
def test_a_sliding_window_model_hits_and_answers_as_without_the_store(
    swa_model: Path, swa_expected: list[int], tmp_path: Path, hybrid: bool
) -> None:
    """A model with a sliding-window layer beside a full one (Gemma's and gpt-oss's kind).

    With vLLM's hybrid allocator (on by default: the connector supports it) the model
    has a KV cache group of each kind, and vLLM keeps only the window's blocks of the
    sliding-window group: a hit loads every full-attention block and only the window's
    sliding-window blocks. With it off, vLLM files every layer as full attention. Either
    way the second identical prompt is a hit, in this process and in a new one, and the
    output is the one vLLM gives without the connector.
    """
    args: dict[str, Any] = {} if hybrid else {"disable_hybrid_kv_cache_manager": True}
    options = {"root": str(tmp_path / "kv")}
    with engine(swa_model, "file", options, **args) as llm:
        settings = llm.hicache_connectors["SCHEDULER"].settings
        assert settings.hybrid == hybrid and len(settings.namespaces) == (2 if hybrid else 1)
        first = generate(llm, [SWA_PROMPT], max_tokens=12)[0]
        assert first["cached"] == 0 and first["tokens"] == swa_expected
        again = generate(llm, [SWA_PROMPT], max_tokens=12)[0]
        assert again["cached"] == 3 * BLOCK and again["tokens"] == swa_expected
        t = totals(llm)
        page = llm.hicache_connectors["WORKER"].connector_worker.pool.page_bytes
    assert t["load_failed_blocks"] == 0 and t["load_blocks"] == 3
    # Hybrid: a page of each group is one layer's block; at a hit of 96 tokens the
    # window (16 tokens) lies in the third block, the only sliding-window one loaded.
    assert t["load_bytes"] == (3 + 1) * page if hybrid else 3 * page
    runs = [{"backend": "file", "options": options, "prompts": [SWA_PROMPT], "max_tokens": 12,
             "llm_args": args}]  # fmt: skip
    ((new,),) = in_new_process(swa_model, runs, tmp_path)
    assert new["cached"] == 3 * BLOCK and new["tokens"] == swa_expected  # from the store


def test_a_model_whose_every_layer_has_a_window_hits_and_answers_as_without_the_store(
    tmp_path: Path,
) -> None:
    """Every layer sliding (window 16): one group, of which vLLM keeps only the window's
    blocks. A hit loads the window's block alone, and the output is vLLM's own; a
    damaged one fails the request's load as a whole (vLLM recomputes it)."""
    from vllm_engine import build_tiny_model

    model = build_tiny_model(tmp_path / "all-swa", seed=6, sliding_window=16,
                             layer_types=["sliding_attention", "sliding_attention"])  # fmt: skip
    with engine(model, None) as llm:
        want = generate(llm, [SWA_PROMPT], max_tokens=12)[0]["tokens"]
    root = tmp_path / "kv"
    with engine(model, "file", {"root": str(root)}) as llm:
        settings = llm.hicache_connectors["SCHEDULER"].settings
        assert settings.groups[0].window == 16 and settings.whole_request_loads
        assert generate(llm, [SWA_PROMPT], max_tokens=12)[0]["tokens"] == want
        again = generate(llm, [SWA_PROMPT], max_tokens=12)[0]
        assert again["cached"] == 3 * BLOCK and again["tokens"] == want
        t = totals(llm)
        page = llm.hicache_connectors["WORKER"].connector_worker.pool.page_bytes
        assert t["load_blocks"] == 1 and t["load_bytes"] == page  # (the window's block)
        for path in _files(root):
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x5A
            path.write_bytes(bytes(data))
        out = generate(llm, [SWA_PROMPT], max_tokens=12)[0]
        assert out["tokens"] == want and totals(llm)["load_failed_blocks"] == 1


def test_a_sliding_window_models_next_turn_hits_through_the_answer(
    swa_model: Path, tmp_path: Path
) -> None:
    """With vLLM's hybrid allocator the blocks of an answer are stored in every group as
    they fill (the sliding-window group's before vLLM frees them, out of the window),
    and the answer's last, partial block too: a new engine serves the next turn up to
    the last token with KV, and its output is vLLM's own."""
    with engine(swa_model, None) as llm:
        answer = generate(llm, [SWA_PROMPT], max_tokens=40)[0]["tokens"]
        turn2 = SWA_PROMPT + answer + list(range(900, 910))
        want = generate(llm, [turn2], max_tokens=12)[0]["tokens"]
    options = {"root": str(tmp_path / "kv")}
    with engine(swa_model, "file", options) as llm:
        assert llm.hicache_connectors["SCHEDULER"].settings.hybrid
        assert generate(llm, [SWA_PROMPT], max_tokens=40)[0]["tokens"] == answer
        t = totals(llm)
    assert t["save_blocks"] == 4 and t["save_partial_blocks"] == 1  # (places, all groups)
    with engine(swa_model, "file", options) as llm:
        out = generate(llm, [turn2], max_tokens=12)[0]
    # 139 tokens have KV: 4 full blocks and 11 tokens of the fifth.
    assert out["cached"] == 4 * BLOCK + 11 and out["tokens"] == want


def test_a_sliding_window_hit_is_a_length_every_group_can_restore(
    swa_model: Path, swa_expected: list[int], tmp_path: Path
) -> None:
    """With vLLM's hybrid allocator, a sliding-window block the store lost shortens the
    hit to where the window does not need it; one outside the window costs nothing; a
    damaged one fails the request's load as a whole (vLLM takes no failed blocks of a
    hybrid model), which vLLM recomputes. The output never changes."""
    root = tmp_path / "kv"
    with engine(swa_model, "file", {"root": str(root)}) as llm:
        sched = llm.hicache_connectors["SCHEDULER"]
        assert generate(llm, [SWA_PROMPT], max_tokens=12)[0]["tokens"] == swa_expected
        totals(llm)
        keys = sched.keys_for(SimpleNamespace(request_id="x", prompt_token_ids=SWA_PROMPT,
                                              lora_request=None, mm_features=[], cache_salt=None,
                                              prompt_embeds=None))  # fmt: skip
        assert keys is not None and len(keys) == 3
        swa = next(i for i, g in enumerate(sched.settings.groups) if g.window is not None)
        backend = sched.connector_scheduler.group_backends[swa][0]
        assert backend.batch_exists_each(keys) == [True, True, True]
        # Outside the window at 96 tokens: the first block. Lost, the hit stays 96.
        backend.delete(keys[0])
        out = generate(llm, [SWA_PROMPT], max_tokens=12)[0]
        assert out["cached"] == 3 * BLOCK and out["tokens"] == swa_expected
        # The window's block at 96 tokens: lost, the hit is 64 (whose window is in the
        # second block, stored).
        backend.delete(keys[2])
        out = generate(llm, [SWA_PROMPT], max_tokens=12)[0]
        assert out["cached"] == 2 * BLOCK and out["tokens"] == swa_expected
        t0 = totals(llm)
        # Damaged: the second block's object flipped in place. The lookup finds it, the
        # load fails its check; the request is recomputed whole.
        ns = sched.settings.namespaces[swa]
        damaged = 0
        for path in _files(root):
            if ns.digest in str(path):
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0x5A
                path.write_bytes(bytes(data))
                damaged += 1
        assert damaged >= 2  # (blocks 2 and 3 of the prompt, the answer's partial block)
        out = generate(llm, [SWA_PROMPT], max_tokens=12)[0]
        t = totals(llm)
    assert out["tokens"] == swa_expected
    assert t["load_failed_blocks"] > t0["load_failed_blocks"]
