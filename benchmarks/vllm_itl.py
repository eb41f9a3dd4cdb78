"""Other requests' inter-token latency while one request loads a long prefix, in real vLLM.

The 96M-parameter random Llama of ``vllm_ttft.py`` on vLLM's CPU backend
(``OMP_NUM_THREADS=1``). ``--streams`` requests of 256 prompt tokens decode
``--decode`` tokens each; at step 8 a request arrives whose ``--tokens``-token prompt
is in the store (filled by another process first). vLLM's engine is stepped by hand and
each output token timed; the inter-token latencies of the decoding requests (p50, p99,
max) are compared, in a new engine process each:

* **no load**: the decoding requests alone (the baseline);
* **load in the step**: the hit loaded before the forward pass (``async_loads: false``);
  every decoding request waits for it;
* **load in the background**: the hit loaded while vLLM runs the others
  (``async_loads`` unset: the default beside running requests); the request joins once
  its load is reported;
* **hit in vLLM's memory**: no connector; the long prompt ran once before the others
  started, so it arrives as a hit of vLLM's own prefix cache. It joins the batch as the
  loaded request does (its context attended to in the same steps) with nothing to load:
  the steps' cost without the load, which the loads are also compared with.

Every output is checked against the baseline's (the long request's against a run of it
alone). Medians over ``--rounds`` rounds of each percentile.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_itl.py --tokens 8192 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "workers"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

ARRIVAL = 8  # the step the long request arrives at


def run_engine(plan: dict[str, Any]) -> dict[str, Any]:
    import vllm_engine

    args = {
        "max_model_len": plan["max_len"], "max_num_batched_tokens": plan["max_len"],
        "kv_cache_memory_bytes": plan["kv_bytes"], "max_num_seqs": plan["streams"] + 1,
    }  # fmt: skip
    if plan.get("prefix_cache"):
        args["enable_prefix_caching"] = True
    with vllm_engine.engine(
        Path(plan["model"]), plan.get("backend"), plan.get("options"), **args
    ) as llm:
        vllm_engine.generate(llm, [list(range(900, 940))], max_tokens=1)  # warm-up
        for prompt in plan.get("before", []):  # (into vLLM's prefix cache)
            vllm_engine.generate(llm, [prompt], max_tokens=1)
        out = vllm_engine.run_streams(llm, [tuple(s) for s in plan["streams_plan"]])
        totals = vllm_engine.totals(llm) if plan.get("backend") else {}
    return {"streams": out, "totals": totals}


def _spawn(plan: dict[str, Any]) -> dict[str, Any]:
    from vllm_ttft import spawn_engine

    return spawn_engine(__file__, plan)


def _itls(streams: list[dict[str, Any]], n: int) -> list[float]:
    out: list[float] = []
    for s in streams[:n]:
        t = s["times"]
        out += [b - a for a, b in itertools.pairwise(t)]
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="the loaded prefix")
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-mib", type=int, default=1024)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        print("RESULT " + json.dumps(run_engine(json.loads(Path(args.engine).read_text()))))
        return 0

    if args.decode <= ARRIVAL + 4:
        raise SystemExit(f"--decode must exceed {ARRIVAL + 4}: the requests must still run "
                         "when the long one arrives")  # fmt: skip
    from vllm_ttft import build_model

    long = [10 + (i * 7) % 980 for i in range(args.tokens)]
    decoders = [[100 + s + (i * 13) % 800 for i in range(256)] for s in range(args.streams)]
    max_len = args.tokens + 64
    modes = {"no load": None, "load in the step": False, "load in the background": None,
             "hit in vLLM's memory": None}  # fmt: skip
    rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="hicache-itl-") as tmp, \
            tempfile.TemporaryDirectory(prefix="hicache-itl-kv-", dir="/dev/shm") as kv:  # fmt: skip
        model = build_model(Path(tmp) / "model", max_len)
        base = {"model": str(model), "max_len": max_len, "kv_bytes": args.kv_mib << 20,
                "streams": args.streams}  # fmt: skip
        conn = {**base, "backend": "shm", "options": {"root": kv}}
        fill = _spawn({**conn, "streams_plan": [(long, 4, 0)]})  # stores the long prompt
        want_long = fill["streams"][0]["tokens"]
        decode_plan = [(d, args.decode, 0) for d in decoders]
        for r in range(args.rounds):
            want: list[list[int]] | None = None
            for mode, choice in modes.items():
                plan = list(decode_plan)
                if mode != "no load":
                    plan.append((long, 4, ARRIVAL))
                options = {"root": kv, **({} if choice is None else {"async_loads": choice})}
                if mode == "hit in vLLM's memory":
                    got = _spawn({**base, "prefix_cache": True, "before": [long],
                                  "streams_plan": plan})  # fmt: skip
                else:
                    got = _spawn({**conn, "options": options, "streams_plan": plan})
                streams = got["streams"]
                toks = [s["tokens"] for s in streams[: args.streams]]
                want = want or toks
                if toks != want:
                    raise SystemExit(f"{mode}: the decoding requests' outputs changed")
                if mode != "no load":
                    last = streams[-1]
                    floor = args.tokens - 1 if mode.startswith("load") else args.tokens - 32
                    if last["tokens"] != want_long or last["cached"] < floor:
                        raise SystemExit(f"{mode}: the long request {last['cached']} cached")
                if mode.startswith("load"):
                    bg = got["totals"].get("background_loads", 0)
                    if (mode == "load in the background") != (bg > 0):
                        raise SystemExit(f"{mode}: {bg} background loads")
                itl = _itls(streams, args.streams)
                rows[mode].append((_pct(itl, 0.5), _pct(itl, 0.99), max(itl)))
            print(f"round {r + 1}: " + ", ".join(
                f"{m} p50 {v[-1][0] * 1e3:.1f} p99 {v[-1][1] * 1e3:.1f} max {v[-1][2] * 1e3:.1f}"
                for m, v in rows.items()), file=sys.stderr)  # fmt: skip

    print(f"{args.streams} requests decoding {args.decode} tokens; a {args.tokens}-token "
          f"prefix loaded from shm at step {ARRIVAL}; median of {args.rounds} rounds (ms)")  # fmt: skip
    meds = {m: [statistics.median(x[i] for x in v) for i in range(3)] for m, v in rows.items()}
    none, mem = meds["no load"], meds["hit in vLLM's memory"]
    print(f"  {'':26} {'p50':>7} {'p99':>7} {'max':>7}   p50, p99 / no load;"
          " / hit in vLLM's memory")  # fmt: skip
    for mode, med in meds.items():
        print(f"  {mode:26} {med[0] * 1e3:7.1f} {med[1] * 1e3:7.1f} {med[2] * 1e3:7.1f}"
              f"   {med[0] / none[0]:.2f} {med[1] / none[1]:.2f};"
              f"  {med[0] / mem[0]:.2f} {med[1] / mem[1]:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
