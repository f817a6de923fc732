"""A model plus its KV cache, addressed by slots that may hold holes.

Rows of a batch accept different numbers of tokens per round, and tree drafting appends scratch branches that
are dropped later. Rather than moving KV around, every slot keeps a validity bit and the logical position of its
token; each forward gets an explicit 4D mask built from them (and from the sliding window, in logical positions),
so holes, left padding and per-row lengths never change what a token attends to. Trailing slots no row needs
are cropped; rows that finished are dropped from the batch.
"""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_ssd.kernels.packed_linear import applied as packed_linear_applied
from hf_ssd.kernels.packed_linear import weights_for as packed_linear_weights

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# model families whose unpadded prefill of an empty cache runs with no mask (SDPA's causal kernel: a 716-token
# prompt's masked attention cost 1.5x the causal one); each is checked against the masked prefill in tests
CAUSAL_PREFILL_MODELS = ("llama", "qwen2", "qwen3", "gpt2", "gpt_neox")


def input_device(model: PreTrainedModel) -> torch.device:
    """Where inputs go: the input embeddings' device (model.device can be `meta` under offload)."""
    return model.get_input_embeddings().weight.device


def cache_argument(model: PreTrainedModel) -> str:
    """The forward() keyword for the KV cache: `cache` from transformers 5.24 on (`past_key_values` deprecated)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prefill_logits_argument(model: PreTrainedModel) -> dict:
    """forward() keywords that skip the LM head for all but the last position (`logits_to_keep=1`), where the model
    takes them. A prompt's prefill needs no logits at all; over a batch of long prompts the full-vocabulary head (and
    its float32 copy) cost a third of the prefill or more, and gigabytes."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def causal_prefill_family(model: PreTrainedModel, window: int | None, layer_types: list[str] | None) -> bool:
    """Is `model` one whose prompt may be prefilled with no mask (SDPA's causal kernel) when it is unpadded: full
    attention in every layer and a family checked against the masked path (CAUSAL_PREFILL_MODELS)."""
    return (window is None and layer_types is None
            and getattr(model.config, "model_type", None) in CAUSAL_PREFILL_MODELS)


def layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's keys and values of a DynamicCache, on transformers with cache layers (4.56 on) or without."""
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def attention_layout(model: PreTrainedModel) -> tuple[list[str] | None, int | None]:
    """(layer types if the model mixes full and sliding layers, sliding window applied to all others)."""
    text = model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is not None:
        unknown = sorted(set(types) - set(ATTENTION_LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"{type(model).__name__} has layers of type {unknown}, whose state cannot be rolled back after a "
                "rejected draft; ssd=True supports attention layers (full or sliding window) only."
            )
        if "sliding_attention" not in types or not window:
            return None, None
        if "full_attention" in types:
            return list(types), window
        return None, window
    return None, window if isinstance(window, int) and window > 0 else None


POSITION_TABLE_NAMES = ("wpe", "embed_positions", "position_embeddings", "pos_embed", "position_embedding")


def position_limit(model: PreTrainedModel) -> int | None:
    """How many positions a model with learned absolute position embeddings (a table: GPT-2's `wpe`, OPT's
    `embed_positions`, ...) can address; None for rotary, ALiBi and other models without such a table."""
    table = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLE_NAMES:
            table = module
            break
    if table is None:
        return None
    text = model.config.get_text_config()
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return min(value, table.num_embeddings)
    return table.num_embeddings


class CachedModel:
    """A model and its slot cache.

    Position ids are clamped to the last one a learned position table has (`position_limit`): a verify block or a
    draft tree may reach past it, but a token in such a slot predicts at least two tokens past the last position
    the model has, which plain generate() cannot reach either (it fails there), so no committed token depends on a
    clamped slot. Models whose positions are computed (rotary, ALiBi) are never clamped.
    """

    def __init__(self, model: PreTrainedModel, batch_size: int, packed_linear: bool | str = "auto"):
        self.model = model
        # large float32 Linear weights packed for few-row forwards (kernels/packed_linear; None where it does not apply)
        self.packed = packed_linear_weights(model, packed_linear)
        self.device = input_device(model)
        self.dtype = model.get_input_embeddings().weight.dtype
        self.layer_types, self.window = attention_layout(model)
        self.cache = DynamicCache()  # full (never windowed) layers: crop always works; windows live in our masks
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.pos = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self.forwards = 0
        self.cache_kw = cache_argument(model)
        self.max_position = position_limit(model)
        self.prefill_kw = prefill_logits_argument(model)

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def write_pointer(self) -> torch.Tensor:
        """[B] slot each row's next token goes to: the common end (rows append together, holes keep them aligned)."""
        return torch.full((self.batch,), self.length, dtype=torch.long, device=self.device)

    @property
    def batch(self) -> int:
        """Rows the cache holds now (the generation's batch until finished rows are dropped)."""
        return self.valid.shape[0]

    def default_attend(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Past valid slots plus causal attention among the new tokens: [B, n, L+n] bool."""
        B, n = new_valid.shape
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        past = self.valid[:, None, :].expand(B, n, self.length)
        return torch.cat([past, causal[None] & new_valid[:, None, :]], dim=2)

    def _mask(self, attend: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        key_pos = torch.cat([self.pos, positions], dim=1)
        allowed = attend.clone()
        if window is not None:
            allowed &= (positions[:, :, None] - key_pos[:, None, :]) < window
        # Every query sees at least itself, so padded queries never produce NaNs.
        n = positions.shape[1]
        allowed[:, :, self.length:] |= torch.eye(n, dtype=torch.bool, device=self.device)[None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)[:, None]

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        new_valid: torch.Tensor | None = None,
        attend: torch.Tensor | None = None,
        prefill: bool = False,
    ) -> torch.Tensor:
        """Run `tokens` [B, n] at logical `positions`, append their KV, return float32 logits [B, n, V].
        (`prefill`: the prompt, whose logits no one reads: only the last position's come back, where the model can
        skip the others, and an unpadded prompt into an empty cache passes no mask; the static cache also never
        compiles it.)

        attend: [B, n, L+n] bool, which slots (old and new) each new token may see; default `default_attend`.
        """
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        if self.length == 0 and self.valid.shape[0] != tokens.shape[0]:  # an empty cache takes any batch size
            self.valid = self.valid.new_zeros(tokens.shape[0], 0)
            self.pos = self.pos.new_zeros(tokens.shape[0], 0)
        if new_valid is None:
            new_valid = torch.ones_like(tokens, dtype=torch.bool)
        new_valid = new_valid.to(self.device)
        if prefill and attend is None and self._plain_causal(positions, new_valid):
            mask = None  # SDPA's causal kernel (_plain_causal)
        else:
            attend = self.default_attend(new_valid) if attend is None else attend
            mask = self._mask(attend, positions, self.window)
            if self.layer_types is not None:
                mask = {"full_attention": self._mask(attend, positions, None), "sliding_attention": mask}
        model_positions = positions if self.max_position is None else positions.clamp_max(self.max_position - 1)
        with packed_linear_applied(self.packed):
            out = self.model(
                input_ids=tokens, position_ids=model_positions, attention_mask=mask, use_cache=True,
                **{self.cache_kw: self.cache}, **(self.prefill_kw if prefill else {}),
            )
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self.pos = torch.cat([self.pos, positions], dim=1)
        self.forwards += 1
        return out.logits.float()

    def _plain_causal(self, positions: torch.Tensor, new_valid: torch.Tensor) -> bool:
        """May a prefill run with no mask? Only into an empty cache, with every token valid at positions 0..n-1 in
        every row, full attention in every layer and a family checked against the masked path: transformers' own
        causal mask is then ours."""
        if self.length > 0 or not causal_prefill_family(self.model, self.window, self.layer_types):
            return False
        n = positions.shape[1]
        in_order = torch.equal(positions, torch.arange(n, device=positions.device).expand_as(positions))
        return bool(new_valid.all()) and in_order

    def adopt_groups(self, parts: list, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Take a prompt prefilled in groups of rows (runtime.prefill: [(Group, CachedModel)]) as if its padded
        [B, n] `tokens` had been one forward: each group's KV at its rows and columns start..n-1, zeros (invalid
        slots) elsewhere. The cache must be empty."""
        B, n = tokens.shape
        first = parts[0][1].cache
        for i in range(len(first)):
            k0, v0 = layer_kv(first, i)
            keys = k0.new_zeros(B, k0.shape[1], n, k0.shape[3])
            values = v0.new_zeros(B, v0.shape[1], n, v0.shape[3])
            for group, part in parts:
                k, v = layer_kv(part.cache, i)
                rows = torch.tensor(group.rows, device=k.device)
                keys[rows, :, group.start:] = k
                values[rows, :, group.start:] = v
            self.cache.update(keys, values, i)
        self.valid = valid.to(self.device).clone()  # a group starts at its rows' first valid column
        self.pos = positions.to(self.device).clone()
        self.forwards += len(parts)

    def invalidate(self, start: torch.Tensor, stop: int | None = None) -> None:
        """Mark slots start[b] .. stop (default: the end) of each row as holes."""
        slots = torch.arange(self.length, device=self.device)[None, :]
        drop = slots >= start.to(self.device)[:, None]
        if stop is not None:
            drop &= slots < stop
        self.valid &= ~drop

    def trim(self) -> None:
        """Crop trailing slots that no row still uses."""
        used = self.valid.any(dim=0).nonzero()
        keep = int(used.max().item()) + 1 if used.numel() else 0
        self.crop_to(keep)

    def crop_to(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)
            self.valid = self.valid[:, :length]
            self.pos = self.pos[:, :length]

    def select_rows(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.device)
        if rows.numel() == self.valid.shape[0]:  # every row stays (rows are kept in order)
            self.trim()
            return
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        self.pos = self.pos[rows]
        self.trim()

    def next_position(self) -> torch.Tensor:
        """[B] logical position of the next token of each row (one past its last valid slot)."""
        if self.length == 0:
            return torch.zeros(self.valid.shape[0], dtype=torch.long, device=self.device)
        return torch.where(self.valid, self.pos + 1, torch.zeros_like(self.pos)).amax(dim=1)
