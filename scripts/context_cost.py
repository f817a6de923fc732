"""How a forward's time grows with the context it attends over, for the default pair (packed weights, as the
engine runs its forwards).

    .venv/bin/python scripts/context_cost.py --batch 4 --contexts 8,128,320,640

The controller's cost lines (control/costs.py) are timed over an 8-token context; the engine's rounds run over the
prompt and the answer so far. Each forward here runs over a cache filled with random keys and values (what a
forward costs does not depend on their values), so no prefill is needed. With --padded the forward gets the 4-D
float mask the engine passes for a left-padded batch (half of the first row's context masked out). Prints the
median milliseconds of --repeats forwards per context.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache


def random_cache(model, batch: int, context: int) -> DynamicCache:
    """A cache of `context` random keys and values per row in every layer (full attention layers only)."""
    config = model.config.get_text_config()
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = DynamicCache()
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(batch, heads, context, dim), torch.randn(batch, heads, context, dim), layer)
    return cache


def padded_mask(batch: int, n: int, context: int) -> torch.Tensor:
    """[batch, 1, n, context + n] float mask: causal over the new tokens, the first row's first half masked."""
    allowed = torch.ones(batch, 1, n, context + n, dtype=torch.bool)
    allowed[..., context:] = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[0, ..., : context // 2] = False
    return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)


def forward_ms(model, batch: int, context: int, n: int, threads: int, repeats: int, padded: bool) -> float:
    from hf_ssd.kernels.packed_linear import applied, weights_for
    from hf_ssd.runtime.kv import cache_argument

    torch.set_num_threads(threads)
    vocab, cache_kw = model.config.get_text_config().vocab_size, cache_argument(model)
    times = []
    with torch.no_grad(), applied(weights_for(model)):
        for r in range(repeats + 1):  # the first forward warms up
            cache = random_cache(model, batch, context)
            ids = torch.randint(0, vocab, (batch, n))
            positions = torch.arange(context, context + n).expand(batch, n)
            mask = padded_mask(batch, n, context) if padded else torch.ones(batch, context + n, dtype=torch.long)
            start = time.perf_counter()
            model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, **{cache_kw: cache})
            if r:
                times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--contexts", default="8,128,320,640")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from hf_ssd.tools.assets import load_default_pair

    target, draft, _ = load_default_pair()
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"batch {args.batch}; milliseconds per forward at context " + " / ".join(map(str, contexts)))
    for name, model, n, threads in (("target", target, 3, 1), ("target", target, 3, 2), ("draft", draft, 1, 1),
                                    ("draft", draft, 8, 1)):
        for padded in (False, True):
            row = [f"{forward_ms(model, args.batch, c, n, threads, args.repeats, padded):.0f}" for c in contexts]
            mask = "padded 4-D mask" if padded else "no padding"
            print(f"{name}, {n} tokens a row, {threads} thread(s), {mask}: " + " / ".join(row), flush=True)


if __name__ == "__main__":
    main()
