"""Time to first token inside real vLLM: what the connector saves a user, side by side.

A random Llama of 96M parameters (8 layers, 8 KV heads of 64: 16 KiB of KV per token,
bf16), vLLM's CPU backend, ``OMP_NUM_THREADS=1``. TTFT is the wall time of
``LLM.generate`` of one prompt with ``max_tokens=1``, after a short warm-up request in
the same engine. Every warm figure is taken in a **new engine process**, whose only
help is the store (vLLM's own prefix cache is off where the connector is on). One round:

* **A** (no connector, vLLM's prefix cache on): ``cold``, the prompt computed; then
  ``vllm prefix hit``, the same prompt again in the same process (vLLM recomputes its
  last block).
* **B** (connector, empty store): ``cold, storing``, the prompt computed and stored;
  then the first turn of a chat: the prompt and ``--answer`` generated tokens.
* **C1** (new process): ``full hit``, the prompt from the store.
* **C1'** (new process): ``one token``, the prompt and one more token: every block of
  the prompt from the store, one token computed (the floor of a full hit).
* **C2** (new process): ``second turn``, the first turn's prompt, its answer and
  ``--new`` more tokens, from the store (the answer's blocks were stored as it grew).
* **D** (new process): ``second turn, all stored``, the same prompt again once every
  block of it is stored (C2 stored the rest): the floor of a second turn.
* **B0, C0** (another store, ``store_output_tokens: 0``): the first turn storing its
  prompt blocks only, then ``second turn, prompt blocks only`` in a new process (what
  the connector did before generated blocks were stored).
* **E0, E** (a third store): the first turn's prompt and answer sent as one prompt
  (stored as prompt blocks), then ``second turn, answer sent as a prompt`` in a new
  process: the same tokens to compute as C2 but for the answer's last block (whose
  last token's KV vLLM never computes), so C2 / E says whether generated blocks hit as
  prompt blocks do.

Medians over ``--rounds`` rounds (a fresh store each round); the ratios are the issue's
targets (second turn / all stored; full hit / one token; full hit / vLLM prefix hit;
cold storing / cold), and second turn / prompt blocks only.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_ttft.py --tokens 4096 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests" / "workers"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

BLOCK = 32


def build_model(out: Path, max_len: int) -> Path:
    """The 96M-parameter random Llama and the tiny models' word tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm_engine import build_tiny_model

    build_tiny_model(out)  # the tokenizer (and a tiny model, overwritten below)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=max_len,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out))
    return out


def _ttft(llm: Any, prompt: list[int], max_tokens: int = 1) -> tuple[float, dict[str, Any]]:
    from vllm import SamplingParams
    from vllm_engine import finish_steps

    t0 = time.perf_counter()
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )[0]
    seconds = time.perf_counter() - t0
    finish_steps(llm)  # (the step a server's engine loop runs after the last output)
    return seconds, {
        "cached": int(out.num_cached_tokens or 0),
        "tokens": list(out.outputs[0].token_ids),
    }


def run_engine(plan: dict[str, Any]) -> dict[str, Any]:
    """One engine process: a warm-up, then the plan's prompts in order."""
    import vllm_engine

    backend = plan.get("backend")
    args: dict[str, Any] = {
        "max_model_len": plan["max_len"], "max_num_batched_tokens": plan["max_len"],
        "kv_cache_memory_bytes": plan["kv_bytes"],
        "enable_prefix_caching": bool(plan.get("prefix_cache")),
    }  # fmt: skip
    out: dict[str, Any] = {}
    with vllm_engine.engine(Path(plan["model"]), backend, plan.get("options"), **args) as llm:
        _ttft(llm, list(range(900, 900 + 40)))  # warm-up: another prompt
        for name, prompt, max_tokens in plan["steps"]:
            seconds, result = _ttft(llm, prompt, max_tokens)
            out[name] = {"seconds": seconds, **result}
    return out


def spawn_engine(script: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Run ``script --engine PLAN`` in a new process; its ``RESULT`` line, parsed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(plan, f)
    try:
        proc = subprocess.run(
            [sys.executable, script, "--engine", f.name],
            capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
    finally:
        os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"engine process failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def _spawn(plan: dict[str, Any]) -> dict[str, Any]:
    return spawn_engine(__file__, plan)


def _location(backend: str, root: Path) -> dict[str, Any]:
    return {"root": str(root)}


def one_round(
    args: argparse.Namespace, model: Path, root: Path, root0: Path, root_e: Path
) -> dict[str, dict[str, Any]]:
    n = args.tokens
    prompt = [10 + (i * 7) % 980 for i in range(n)]
    max_len = n + args.answer + args.new + 64
    base = {"model": str(model), "max_len": max_len, "kv_bytes": args.kv_mib << 20}
    conn = {**base, "backend": args.backend, "options": _location(args.backend, root)}
    prompt_only = {
        **base, "backend": args.backend,
        "options": {**_location(args.backend, root0), "store_output_tokens": 0},
    }  # fmt: skip
    a = _spawn({**base, "prefix_cache": True, "steps": [
        ("cold", prompt, 1), ("vllm prefix hit", prompt, 1),
    ]})  # fmt: skip
    b = _spawn({**conn, "steps": [("cold, storing", prompt, 1), ("turn 1", prompt, args.answer)]})
    answer = b["turn 1"]["tokens"]
    turn2 = prompt + answer + [20 + i for i in range(args.new)]
    c1 = _spawn({**conn, "steps": [("full hit", prompt, 1)]})
    c1b = _spawn({**conn, "steps": [("one token", [*prompt, 5], 1)]})
    c2 = _spawn({**conn, "steps": [("second turn", turn2, 1)]})
    d = _spawn({**conn, "steps": [("second turn, all stored", turn2, 1)]})
    _spawn({**prompt_only, "steps": [("turn 1, prompt blocks only", prompt, args.answer)]})
    c0 = _spawn({**prompt_only, "steps": [("second turn, prompt blocks only", turn2, 1)]})
    as_prompt = {**base, "backend": args.backend, "options": _location(args.backend, root_e)}
    _spawn({**as_prompt, "steps": [("turn 1 as a prompt", prompt + answer, 1)]})
    e = _spawn({**as_prompt, "steps": [("second turn, answer sent as a prompt", turn2, 1)]})
    got = {**a, **b, **c1, **c1b, **c2, **d, **c0, **e}
    if got["full hit"]["tokens"] != got["cold"]["tokens"]:
        raise SystemExit("the full hit changed the first token")
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="prompt tokens (first turn)")
    p.add_argument("--answer", type=int, default=256, help="tokens generated in turn 1")
    p.add_argument("--new", type=int, default=64, help="new tokens in turn 2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="shm", choices=["shm", "file"])
    p.add_argument("--kv-mib", type=int, default=1024, help="vLLM's KV cache, MiB")
    p.add_argument("--json", action="store_true")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        plan = json.loads(Path(args.engine).read_text())
        print("RESULT " + json.dumps(run_engine(plan)), flush=True)
        return 0

    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="hicache-ttft-") as tmp:
        model = build_model(Path(tmp) / "model", args.tokens + args.answer + args.new + 64)
        store_dir = "/dev/shm" if args.backend == "shm" else tmp
        for i in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="hicache-ttft-kv-", dir=store_dir) as kv:
                name = "kv"
                root, root0 = Path(kv) / name, Path(kv) / "prompt-only" / name
                root_e = Path(kv) / "as-prompt" / name
                rounds.append(one_round(args, model, root, root0, root_e))
            print(f"round {i + 1}: " + ", ".join(
                f"{k} {v['seconds'] * 1e3:.0f} ms" for k, v in rounds[-1].items()
                if k != "turn 1"), file=sys.stderr)  # fmt: skip

    names = [k for k in rounds[0] if k != "turn 1"]
    med = {k: statistics.median(r[k]["seconds"] for r in rounds) for k in names}
    cached = {k: rounds[-1][k]["cached"] for k in names}
    ratios = {
        "second turn / second turn, all stored": med["second turn"]
        / med["second turn, all stored"],
        "full hit / one token": med["full hit"] / med["one token"],
        "full hit / vllm prefix hit": med["full hit"] / med["vllm prefix hit"],
        "cold, storing / cold": med["cold, storing"] / med["cold"],
        "second turn / second turn, prompt blocks only": med["second turn"]
        / med["second turn, prompt blocks only"],
        "second turn / second turn, answer sent as a prompt": med["second turn"]
        / med["second turn, answer sent as a prompt"],
    }
    if args.json:
        print(json.dumps({"ttft_ms": {k: round(v * 1e3, 1) for k, v in med.items()},
                          "cached": cached, "ratios": {k: round(v, 3) for k, v in
                                                       ratios.items()}}))  # fmt: skip
        return 0
    print(f"{args.tokens}-token prompt, answer {args.answer}, {args.new} new; {args.backend}; "
          f"median of {args.rounds} rounds (TTFT, ms; cached tokens)")  # fmt: skip
    for k in names:
        print(f"  {k:28} {med[k] * 1e3:9.1f}   {cached[k]:6d}")
    for k, v in ratios.items():
        print(f"  {k:40} {v:6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
