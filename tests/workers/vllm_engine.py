"""A real vLLM engine on a tiny model, for the connector's tests and benchmark.

The model is a random 2-layer Llama built here (offline, about 5 s, under 1 MB): head
size 32 (the smallest the CPU attention backend takes), vocabulary ``w0..w995``. The
engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with a 64 MiB KV
cache, greedy sampling, and vLLM's own prefix caching off, so a cached token can only
come from the connector.

Run as a script, it is the "new engine process" of the cross-process tests: it reads a
JSON plan (``{"model": dir, "runs": [{"backend": name, "options": {...}, "prompts":
[[ids...]]}]}``) from argv[1], generates every run's prompts on an engine of its own,
and prints one JSON line: per run, each prompt's ``cached`` tokens and output ``tokens``.
A run with ``"multiprocessing": true`` has vLLM's default engine: its core in a process
of its own.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the engine's kv_cache_memory_bytes rules

BLOCK = 32  # tokens per block (the CPU attention backend needs a multiple of 32)
MAX_TOKENS = 8  # generated per prompt


def build_tiny_model(out: Path, seed: int = 0, **config: Any) -> Path:
    """Write the tiny Llama and its tokenizer to ``out`` (weights made from ``seed``).

    ``config`` overrides the Llama config (``sliding_window``, ``layer_types``...).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"w{i}": i + 4 for i in range(996)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
    ).save_pretrained(str(out))  # fmt: skip
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
        torch_dtype="bfloat16", **config,
    )  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out))
    return out


def kv_transfer_config(
    backend: str | None, options: dict[str, Any] | None = None, policy: str = "recompute"
) -> dict[str, Any] | None:
    """The ``kv_transfer_config`` that runs ``backend`` with ``options`` (None: no connector).

    Made by ``hicache-storage vllm-args``' own function, so every engine test runs the
    configuration that command prints; the secret options it leaves out are set in this
    process's environment, where the backend reads them.
    """
    if backend is None:
        return None
    from hicache_storage.cli.main import vllm_kv_transfer_config

    config, secret_env = vllm_kv_transfer_config(backend, options or {}, policy=policy)
    # Secret options stay out of the config (vLLM logs it): as the command tells a
    # user, they go to the backend through its environment variables.
    for key, value in (options or {}).items():
        for var in secret_env:
            if var.endswith("_" + key.upper()):
                os.environ[var] = str(value)
    return config


@contextlib.contextmanager
def engine(
    model: Path,
    backend: str | None,
    options: dict[str, Any] | None = None,
    policy: str = "recompute",
    block_size: int = BLOCK,
    **llm_args: Any,
) -> Iterator[Any]:
    """A vLLM ``LLM`` on the tiny model with the connector on ``backend``; shut down after.

    ``llm_args`` override the engine's arguments (``enable_prefix_caching``...).
    """
    from vllm import LLM

    from hicache_storage.integrations import vllm as hv

    before = set(map(id, hv.LIVE))
    args: dict[str, Any] = {
        "model": str(model), "dtype": "bfloat16", "max_model_len": 256, "max_num_seqs": 4,
        "enforce_eager": True, "block_size": block_size, "seed": 0,
        "enable_prefix_caching": False, "kv_cache_memory_bytes": 64 << 20,
        "kv_transfer_config": kv_transfer_config(backend, options, policy),
    }  # fmt: skip
    llm = LLM(**{**args, **llm_args})
    # This engine's connectors (a scheduler's and a worker's), for connectors()/totals().
    llm.hicache_connectors = {c.role.name: c for c in hv.LIVE if id(c) not in before}
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def finish_steps(llm: Any) -> None:
    """Step an in-process engine core while its scheduler still holds finished requests.

    vLLM's engine-core loop (a server's, and LLM's own with its engine core in a process
    of its own, the default) keeps stepping after the last output while a connector has
    delayed a free: that step carries the finished requests' last stores. ``LLM``'s
    loop in this process stops at the last output instead; this runs what the other
    loop would.
    """
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # (in-process only)
    for _ in range(8):
        if core is None or not core.scheduler.has_requests():
            return
        core.step()


def generate(
    llm: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
) -> list[dict[str, Any]]:
    """Greedy outputs of ``prompts``: per prompt ``cached`` tokens, ``tokens``, ``finish``."""
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    finish_steps(llm)
    return [
        {
            "cached": int(o.num_cached_tokens or 0),
            "tokens": list(o.outputs[0].token_ids),
            "finish": o.outputs[0].finish_reason,
        }
        for o in outs
    ]


def run_streams(llm: Any, streams: list[tuple[list[int], int, int]]) -> list[dict[str, Any]]:
    """Requests that arrive while others run: ``(prompt, max_tokens, arrival step)`` each.

    Steps vLLM's engine by hand, adding each request at its step. Per request: its
    output ``tokens``, ``cached`` tokens, and ``times``: when each output token came
    (``time.perf_counter``), from which inter-token latencies follow.
    """
    import time

    from vllm import SamplingParams

    engine_ = llm.llm_engine
    results: dict[str, dict[str, Any]] = {}
    step = 0
    pending = sorted(enumerate(streams), key=lambda x: x[1][2])
    while pending or engine_.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _) = pending.pop(0)
            rid = f"stream-{i}-{id(llm)}"
            results[rid] = {"index": i, "tokens": [], "times": [], "cached": 0}
            engine_.add_request(
                rid,
                {"prompt_token_ids": prompt},
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            )
        for out in engine_.step():
            r = results[out.request_id]
            now = time.perf_counter()
            new = list(out.outputs[0].token_ids)[len(r["tokens"]) :]
            r["tokens"].extend(new)
            r["times"].extend([now] * len(new))
            r["cached"] = int(out.num_cached_tokens or 0)
        step += 1
    return sorted(results.values(), key=lambda r: r["index"])


def totals(llm: Any, settle: bool = True) -> dict[str, float]:
    """The counters of ``llm``'s connectors, scheduler's and worker's together.

    With ``settle`` the stores still running in the background are waited for first, so
    the counters hold every store of the requests generated so far.
    """
    out: dict[str, float] = {}
    for c in llm.hicache_connectors.values():
        if settle and c.connector_worker is not None:
            assert c.connector_worker.flush(60), "a background store is still running"
    for c in llm.hicache_connectors.values():
        for k, v in c.totals.items():
            out[k] = out.get(k, 0) + v
    return out


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    sys.path[:0] = plan.get("sys_path", [])
    results = []
    for run in plan["runs"]:
        # "multiprocessing": vLLM's default, the engine core in a process of its own
        # (the connector's scheduler and worker halves live there, not here).
        mp = "1" if run.get("multiprocessing") else "0"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = mp
        args = run.get("llm_args", {})  # (tensor_parallel_size...)
        with engine(Path(plan["model"]), run["backend"], run.get("options"), **args) as llm:
            results.append(generate(llm, run["prompts"], run.get("max_tokens", MAX_TOKENS)))
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
