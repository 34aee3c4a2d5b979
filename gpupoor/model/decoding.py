"""The decoding engine for the verbs that answer prompts: continuations of left-padded prompts, greedy or sampled,
for the Llama-family decoder (llama, qwen2, mistral without a sliding window: RMSNorm, rotary positions,
grouped-query attention, a gated SiLU MLP). What it does differently from transformers' `generate`, and why
(docs/benchmarks.md, Generation):

- a static KV cache, allocated once for the prompt and every new token: no tensor grows by concatenation;
- a LoRA adapter merged into the weights it reads (W + s B A, once, in the weights' dtype), so a token costs the
  base's matmuls alone, not peft's two extra thin matmuls per adapted linear;
- one attention call per layer over the cache, the padding and causality as one boolean mask built once a step.

The numbers are transformers' own: the model's rotary embedding and `apply_rotary_pos_emb`, its RMSNorm formula,
SDPA. `decoder_for(model)` says whether a model is one it covers (else None: the caller keeps `model.generate`):
its architecture and activation, no quantized linear, no adapter but LoRA, no sliding window, no embedding or norm
behind a peft wrapper. It reads the model's current weights when built: a caller whose weights change (GRPO's
policy after an optimizer step) builds it again."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "mistral", "qwen2")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Linear:
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    gate: Linear
    up: Linear
    down: Linear


def _base_model(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _effective_linear(module) -> Linear | None:
    """A linear's weight and bias as the model computes them: a plain nn.Linear's own tensors (no copy), or a peft
    LoRA layer's base weight with its active adapters merged (a new tensor). None: a kind it does not cover (DoRA,
    IA3, a quantized base)."""
    if type(module) is torch.nn.Linear:
        return Linear(module.weight, module.bias)
    base = getattr(module, "base_layer", None)
    if base is None or type(base) is not torch.nn.Linear or not hasattr(module, "lora_A"):
        return None
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return Linear(base.weight, base.bias)  # merged in place already, or switched off (eval's base column)
    weight = base.weight
    merged = None
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if module.use_dora.get(name, False):
            return None
        a, b = module.lora_A[name].weight, module.lora_B[name].weight
        delta = (b.float() @ a.float()) * module.scaling[name]
        if getattr(module, "fan_in_fan_out", False):
            delta = delta.T
        merged = (weight.float() if merged is None else merged) + delta
    if merged is None:
        return Linear(weight, base.bias)
    return Linear(merged.to(weight.dtype), base.bias)


def decoder_for(model) -> "Decoder | None":
    """The engine for `model`, or None when it is not a model the engine covers (its caller uses generate)."""
    inner = _base_model(model)
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in FAMILIES or getattr(config, "hidden_act", None) != "silu":
        return None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) and \
            config.model_type != "llama":
        return None  # mistral's window: transformers masks past it; not done here
    body = getattr(inner, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return None
    # Weights read as they are, so each must be the module's own: an embedding or a norm behind a peft wrapper
    # (modules_to_save, a LoRA embedding) would be read without what was trained in it.
    norms = [body.norm] + [n for layer in body.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if type(body.embed_tokens) is not torch.nn.Embedding or any(not type(n).__name__.endswith("RMSNorm")
                                                                     for n in norms):
        return None
    layers = []
    for layer in body.layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears = {}
        for name in PROJECTIONS:
            module = getattr(attention if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else mlp, name, None)
            linear = None if module is None else _effective_linear(module)
            if linear is None:
                return None
            linears[name] = linear
        layers.append(Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                            linears["q_proj"], linears["k_proj"], linears["v_proj"], linears["o_proj"],
                            linears["gate_proj"], linears["up_proj"], linears["down_proj"]))
    head = _effective_linear(inner.lm_head)
    if head is None:
        return None
    rotate = sys.modules[type(body.layers[0].self_attn).__module__].apply_rotary_pos_emb
    decoder = Decoder(config, body.embed_tokens.weight, layers, body.norm.weight, head, body.rotary_emb, rotate)
    generation = getattr(inner, "generation_config", None)
    decoder.top_k = getattr(generation, "top_k", None) or 0
    decoder.top_p = getattr(generation, "top_p", None) or 1.0
    return decoder


class Decoder:
    """Continuations of a batch of left-padded prompts (`generate`), the model's weights read as `decoder_for`
    found them."""

    def __init__(self, config, embedding, layers: list[Layer], final_norm, head: Linear, rotary, rotate):
        self.config, self.embedding, self.layers, self.final_norm = config, embedding, layers, final_norm
        self.head, self.rotary, self.rotate = head, rotary, rotate
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.top_k, self.top_p = 0, 1.0  # sampling's filters, as the model's generation config sets generate's

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm, step for step (the same rounding)
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * hidden.to(dtype)

    def _forward(self, tokens, positions, start: int, keys_allowed, cache_k, cache_v) -> torch.Tensor:
        """The last position's logits of `tokens` [B, T] at `positions`, written into the cache at start..start+T;
        `keys_allowed` [B, 1, T, start+T]: which cached keys each query sees."""
        batch, length = tokens.shape
        hidden = F.embedding(tokens, self.embedding)
        cos, sin = self.rotary(hidden, positions)
        end = start + length
        for index, layer in enumerate(self.layers):
            x = self._norm(hidden, layer.input_norm)
            q = layer.q(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
            k = layer.k(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            v = layer.v(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self.rotate(q, k, cos, sin)
            cache_k[index, :, :, start:end] = k
            cache_v[index, :, :, start:end] = v
            attended = F.scaled_dot_product_attention(q, cache_k[index, :, :, :end], cache_v[index, :, :, :end],
                                                      attn_mask=keys_allowed, enable_gqa=self.kv_heads != self.heads)
            hidden = hidden + layer.o(attended.transpose(1, 2).reshape(batch, length, -1))
            x = self._norm(hidden, layer.post_norm)
            hidden = hidden + layer.down(F.silu(layer.gate(x)) * layer.up(x))
        return self.head(self._norm(hidden[:, -1], self.final_norm)).float()

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 eos_token_id, pad_token_id: int, temperature: float = 0.0,
                 generator: torch.Generator | None = None, streamer=None) -> torch.Tensor:
        """[B, max_new_tokens] new tokens of each row (pad_token_id after its end of sequence), as generate's
        greedy search (temperature 0) or sampling at `temperature` (drawn with `generator`). `streamer`: as
        generate's (transformers' TextStreamer): given the prompt, then each token as it comes, then `end()`."""
        if streamer is not None:
            streamer.put(input_ids.cpu())
        batch, prompt = input_ids.shape
        device = input_ids.device
        total = prompt + max_new_tokens
        dtype = self.embedding.dtype
        cache_k = torch.zeros(len(self.layers), batch, self.kv_heads, total, self.head_dim, dtype=dtype, device=device)
        cache_v = torch.zeros_like(cache_k)
        present = torch.zeros(batch, total, dtype=torch.bool, device=device)
        present[:, :prompt] = attention_mask.bool()
        positions = attention_mask.long().cumsum(-1) - 1
        positions = positions.masked_fill(attention_mask == 0, 1)  # as generate places padded positions
        # the prompt: causal, padding unseen; a padding query sees itself (a row of no keys would be NaN)
        causal = torch.ones(prompt, prompt, dtype=torch.bool, device=device).tril()
        allowed = (causal[None] & present[:, None, :prompt]) | torch.eye(prompt, dtype=torch.bool, device=device)
        logits = self._forward(input_ids, positions, 0, allowed[:, None], cache_k, cache_v)
        ends = torch.tensor(eos_token_id if isinstance(eos_token_id, (list, tuple)) else
                            [] if eos_token_id is None else [eos_token_id], device=device)
        out = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        position = positions[:, -1]
        for step in range(max_new_tokens):
            token = self._pick(logits, temperature, generator) if temperature > 0 else logits.argmax(-1)
            token = torch.where(finished, torch.full_like(token, pad_token_id), token)
            out[:, step] = token
            if streamer is not None:
                streamer.put(token.cpu())
            finished |= torch.isin(token, ends)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            at = prompt + step
            present[:, at] = True
            position = position + 1
            logits = self._forward(token[:, None], position[:, None], at, present[:, None, None, :at + 1],
                                   cache_k, cache_v)
        if streamer is not None:
            streamer.end()
        return out

    def _pick(self, logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
        """A token drawn as generate's sampling draws it: the logits over `temperature`, then its top-k and top-p
        filters (transformers' TopKLogitsWarper and TopPLogitsWarper) from the model's generation config."""
        scores = logits / temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k).values[..., -1, None]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=False)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= (1 - self.top_p)
            drop[..., -1:] = False  # the likeliest token always stays
            scores = scores.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(-1)
