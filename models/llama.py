"""The Llama forward pass over a slot KV cache (nano-vllm / gpt-fast style, eager PyTorch).

One preallocated cache tensor holds every layer's keys and values for every slot:
    kv[2, n_layers, n_slots, n_kv_heads, max_seq_len + 1, head_dim]
Per-layer views `kv[0, l]` / `kv[1, l]` have shape (n_slots, n_kv_heads, T, head_dim), which is the layout scaled-dot-
product attention wants, so a batch whose slots are consecutive attends over a *view* of the cache without a copy.
The last position (index max_seq_len) is a scratch cell: padded tokens of ragged rows write there, so they can never
overwrite a real position of their own row in the same step.

Weights come by their HF checkpoint names; q/k/v and gate/up are concatenated once at load so each layer runs two
matmuls fewer per step (Python dispatch is a measurable cost on a 2-core CPU). On CPU the weight matrices are also
packed for oneDNN once (see Linear). This eager forward is the reference: decode steps on a CPU go through
models/compiled_decode.py once it has compiled them.
"""
from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models import quant
from models.llama_config import LlamaConfig

ATTENTION_ROUND = 64  # attend over the longest row rounded up to this, never over all of max_seq_len
PACK_BATCH_HINT = 8  # oneDNN lays packed weights out for about this many rows


@dataclass
class Linear:
    """A weight matrix, oneDNN-packed on CPU (plain where oneDNN cannot pack it). Packed weights skip the per-call
    reorder; all matmuls of one SmolLM2 decode step, 2 threads: on a Xeon bf16 20 -> 12.5 ms (1 and 8 rows), fp32 at
    8 rows 48 -> 30 ms but at 1 row 20 -> 23 ms; on an AVX2-only EPYC fp32 43 -> 29 ms at 1 row and 90 -> 48 ms at
    8 (lm_head included). A plain copy kept beside the packed one for single-row calls cost 540 MB for that
    Xeon-only 15%, so only the packed copy is kept."""
    plain: torch.Tensor | None
    packed: torch.Tensor | None
    out_features: int
    in_features: int

    @classmethod
    def build(cls, w: torch.Tensor, pack: bool) -> "Linear":
        packed = None
        if pack and w.dtype in (torch.float32, torch.bfloat16):  # the dtypes oneDNN's packed linear takes
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
            except (RuntimeError, AttributeError):  # no oneDNN for this dtype/CPU: plain matmuls
                packed = None
        return cls(w if packed is None else None, packed, w.shape[0], w.shape[1])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.packed is not None and (self.plain is None or rows > 1):
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, self.in_features), self.packed, bias, "none",
                                                   [], "")
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.plain, bias)


class RefinedHead:
    """The lm_head of a quantized model: an approximate matmul for every logit, fp32 for the ones that matter.

    The approximate matmul is bfloat16 (oneDNN-packed, on CPUs with native bf16) or int8 rows (kernels.cpu_quant, on
    AVX2 CPUs, where bf16 matmuls are emulated: 27 ms for 8 rows against 6.6 ms for the int8 kernel on SmolLM2's
    49,152 x 576 head). Then the REFINE highest logits are recomputed from the bfloat16 weights with fp32
    activations and fp32 sums, so the tokens greedy decoding and top-p sampling choose among are exact. With plain
    bf16 logits SmolLM2's top-1 agreement with the fp32 path over 600 teacher-forced tokens was 97.3-97.7%; refined,
    99.7%."""

    REFINE = 16

    def __init__(self, approx_linear, weight: torch.Tensor):
        self.approx_linear = approx_linear  # Linear (bfloat16, packed) or quant.Int8Linear
        self.weight = weight  # (vocab, hidden) bfloat16, the rows the refinement reads
        self.out_features, self.in_features = weight.shape

    @classmethod
    def build(cls, weight: torch.Tensor, pack: bool, cpu_kernels=None) -> "RefinedHead":
        if cpu_kernels is not None:
            return cls(quant.Int8Linear(quant.int8_rows(quant.float_chunks(weight)), cpu_kernels), weight)
        return cls(Linear.build(weight, pack), weight)

    def refine(self, x: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
        """approx (rows, vocab) fp32 with its REFINE highest logits recomputed exactly from x (rows, hidden) fp32."""
        top = approx.topk(min(self.REFINE, self.out_features), dim=-1).indices  # (rows, k)
        exact = torch.einsum("rh,rkh->rk", x, self.weight[top].float())
        return approx.scatter(1, top, exact)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        if isinstance(self.approx_linear, Linear):
            approx = self.approx_linear(x2.to(torch.bfloat16)).float()
        else:
            approx = self.approx_linear(x2)
        y = self.refine(x2, approx)
        if bias is not None:
            y = y + bias
        return y.view(*shape[:-1], self.out_features)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear  # (n_heads + 2 * n_kv_heads) * head_dim x hidden
    qkv_bias: torch.Tensor | None
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear  # 2 * intermediate x hidden
    down: Linear


class KVCache:
    """The one preallocated key/value tensor shared by every slot."""

    def __init__(self, config: LlamaConfig, n_slots: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.n_slots = n_slots
        self.max_seq_len = max_seq_len
        shape = (2, config.num_hidden_layers, n_slots, config.num_key_value_heads, max_seq_len + 1, config.head_dim)
        if torch.device(device).type == "cpu":
            # An anonymous map: zero pages the kernel hands out only when first written, so the positions no slot
            # has reached cost no memory (torch.zeros would write, and so commit, every page at start).
            self._map = mmap.mmap(-1, KVCache.nbytes_for(config, n_slots, max_seq_len, dtype))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the map is writable; torch warns about buffers anyway
                self.kv = torch.frombuffer(self._map, dtype=dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.k_layers = [self.kv[0, i] for i in range(config.num_hidden_layers)]
        self.v_layers = [self.kv[1, i] for i in range(config.num_hidden_layers)]

    @staticmethod
    def nbytes_for(config: LlamaConfig, n_slots: int, max_seq_len: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return (2 * config.num_hidden_layers * n_slots * config.num_key_value_heads * (max_seq_len + 1)
                * config.head_dim * elem)


@dataclass
class AttentionMeta:
    """Everything about a step's rows that every layer's attention shares (built once per forward)."""
    slot_ids: torch.Tensor  # (B,) long
    positions: torch.Tensor  # (B, S) absolute position of every query (padding repeats the row's last one)
    t_len: int  # cache positions to look at: the longest row, rounded up
    first_slot: int | None  # rows are slots first..first+B-1: attend over a view of the cache, no gather
    mask: torch.Tensor  # (B, 1, S, t_len) bool, True where a query may look


@dataclass
class RowPart:
    """A (B, S) block of ragged rows in one forward (forward_mixed runs a prefill part and a decode part)."""
    token_ids: torch.Tensor  # (B, S)
    seq_lens: torch.Tensor  # (B,) valid tokens per row
    slot_rows: torch.Tensor  # (B, S) each token's slot
    write_pos: torch.Tensor  # (B, S) each token's cache cell (padding: the scratch cell)
    cos: torch.Tensor  # (B, S, 1, head_dim)
    sin: torch.Tensor
    meta: AttentionMeta


def attention_meta(slot_ids: torch.Tensor, positions: torch.Tensor, t_len: int) -> AttentionMeta:
    b = slot_ids.shape[0]
    first = int(slot_ids[0])
    consecutive = bool(torch.equal(slot_ids, torch.arange(first, first + b, device=slot_ids.device)))
    mask = torch.arange(t_len, device=positions.device) <= positions.unsqueeze(-1)  # (B, S, T)
    return AttentionMeta(slot_ids, positions, t_len, first if consecutive else None, mask.unsqueeze(1))


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    """Attention of new queries over a slot cache: the seam for a fused decode-attention kernel.

    q: (B, S, n_heads, head_dim), already rotated; k_cache/v_cache: one layer's (n_slots, n_kv, T_max, head_dim)
    with this step's keys and values already written. Returns (B, S, n_heads * head_dim).
    GQA by folding the query heads of a group into the query rows, (B, n_kv, group * S, head_dim), instead of
    repeating keys and values; for decode (S == 1) that is a free view.
    """
    b, s, n_heads, hd = q.shape
    n_kv = k_cache.shape[1]
    group = n_heads // n_kv
    t = meta.t_len
    if meta.first_slot is not None:
        keys = k_cache[meta.first_slot:meta.first_slot + b, :, :t]
        values = v_cache[meta.first_slot:meta.first_slot + b, :, :t]
    else:
        keys = k_cache[meta.slot_ids, :, :t]
        values = v_cache[meta.slot_ids, :, :t]
    if keys.dtype != q.dtype:  # a narrower cache (engine.kv_dtype): widened for this step's rows only
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if s == 1:
        out = F.scaled_dot_product_attention(q.view(b, n_kv, group, hd), keys, values, attn_mask=meta.mask)
        return out.view(b, 1, n_heads * hd)
    qg = q.view(b, s, n_kv, group, hd).permute(0, 2, 3, 1, 4).reshape(b, n_kv, group * s, hd)
    mask = meta.mask.expand(b, group, s, t).reshape(b, 1, group * s, t)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
    return out.view(b, n_kv, group, s, hd).permute(0, 3, 1, 2, 4).reshape(b, s, n_heads * hd)


class LlamaModel:
    """Weights plus the forward pass; the KV cache is passed in so it can outlive a weight reload."""

    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", pack: bool | None = None, kernels: str = "auto",
                 cpu_kernels=None):
        """kernels (engine.kernels): "auto" runs decode steps through the fused Triton kernels on CUDA and through
        this file's eager path elsewhere; "triton" forces the kernels (on a CPU only with TRITON_INTERPRET=1, for
        tests); "torch" keeps the eager path everywhere. cpu_kernels: kernels.cpu_quant.library() to multiply
        quantized weights with our AVX2 kernels instead of torch's ops (None: torch's)."""
        self.config = config
        self.kernels = kernels
        self.dtype = dtype
        self.device = torch.device(device)
        if pack is None:  # oneDNN packing is a CPU matter; GPUs take plain weights
            pack = self.device.type == "cpu" and torch.backends.mkldnn.is_available()
        lin = lambda w: Linear.build(w, pack)  # noqa: E731

        def take(name: str) -> torch.Tensor:
            # Always a private copy: loaders hand out views of memory-mapped files, and a weight file replaced in
            # place while we serve would otherwise kill the process with SIGBUS.
            return tensors[name].detach().to(device=self.device, dtype=dtype, copy=True).contiguous()

        def optional(name: str) -> torch.Tensor | None:
            return take(name) if name in tensors else None

        def matrix(*names: str):
            """One linear layer of the named matrices stacked along the output rows (fused qkv, gate/up)."""
            parts = [tensors[n] for n in names]
            if isinstance(parts[0], quant.QuantizedMatrix):  # kept quantized: no float copy is ever made
                return quant.linear_for(parts[0] if len(parts) == 1 else quant.concat_rows(parts), cpu_kernels)
            return lin(torch.cat([take(n) for n in names]) if len(names) > 1 else take(names[0]))

        self.quantized = any(isinstance(t, quant.QuantizedMatrix) for t in tensors.values())
        if self.quantized:  # embeddings / lm_head in bfloat16 (quant.HEAD_NAMES), looked up and widened per row
            self.embed_weight = tensors["model.embed_tokens.weight"].to(torch.bfloat16).contiguous()
            self.embed = lambda ids: F.embedding(ids, self.embed_weight).float()  # noqa: E731
            head = tensors.get("lm_head.weight") if not config.tie_word_embeddings else None
            head = self.embed_weight if head is None else head.to(torch.bfloat16).contiguous()
            self.lm_head = RefinedHead.build(head, pack, cpu_kernels)
        else:
            self.embed_weight = take("model.embed_tokens.weight")
            self.embed = lambda ids: F.embedding(ids, self.embed_weight)  # noqa: E731
            lm_head = "lm_head.weight"
            self.lm_head = lin(take(lm_head) if lm_head in tensors and not config.tie_word_embeddings
                               else self.embed_weight)
        self.norm = take("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            biases = [optional(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            self.layers.append(LayerWeights(
                attn_norm=take(p + "input_layernorm.weight"),
                qkv=matrix(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                qkv_bias=torch.cat(biases) if all(x is not None for x in biases) else None,
                o=matrix(p + "self_attn.o_proj.weight"),
                mlp_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=matrix(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=matrix(p + "mlp.down_proj.weight"),
            ))
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)

    # -- rotary -----------------------------------------------------------------------------------------------
    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (first half negated) for positions 0..length-1 at least, (positions, head_dim)."""
        if length > self._rope_len:  # computed in fp32 like HF, then cast
            hd = self.config.head_dim
            inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
            self._cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(self.device, self.dtype)
            self._sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(self.device, self.dtype)
            self._rope_len = length
        return self._cos, self._sin

    # -- decode through the fused kernels ----------------------------------------------------------------------
    def use_kernels(self) -> bool:
        if self.kernels == "torch":
            return False
        from kernels import use_triton
        return use_triton(self.kernels, self.device)

    def decode_graphs(self, cache: KVCache):
        """Decode steps through the fused kernels as CUDA graphs, one per batch-size bucket up to the slot count
        (appliance/engine/cuda_graphs.py; on a CPU the same buffers run eagerly). Padded rows write to the scratch
        cell (position max_seq_len) of slot 0 and attend over one position, so they touch nothing real."""
        from appliance.engine.cuda_graphs import DecodeGraphs, InputSpec

        specs = {"token_ids": InputSpec((), torch.long, 0), "slot_ids": InputSpec((), torch.long, 0),
                 "positions": InputSpec((), torch.long, cache.max_seq_len), "lengths": InputSpec((), torch.long, 1)}
        return DecodeGraphs(lambda token_ids, slot_ids, positions, lengths: self._decode_kernels(
            cache, token_ids, slot_ids, positions, lengths), specs, max_batch=cache.n_slots, device=self.device)

    def _decode_kernels(self, cache: KVCache, token_ids: torch.Tensor, slot_ids: torch.Tensor,
                        positions: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row at its own position, every op a fused kernel (kernels/): add+RMSNorm, rotary in place,
        KV written into the slots, decode attention reading each row's slot through its index and length (no
        gather), SiLU-gate. Same numbers as forward() within the kernels' tolerance (tests/test_llama_kernels.py)."""
        from kernels import add_rms_norm, apply_rotary_, decode_attention, rotary_tables, silu_mul, write_kv_
        cfg, be = self.config, "triton"
        if getattr(self, "_kernel_rope_len", 0) < cache.max_seq_len + 1:
            self._kernel_cos, self._kernel_sin = rotary_tables(cfg.head_dim, cache.max_seq_len + 1, cfg.rope_theta,
                                                               self.device)
            self._kernel_rope_len = cache.max_seq_len + 1
        b = token_ids.shape[0]
        n_h, n_kv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        h = self.embed(token_ids).contiguous()  # the residual stream, updated in place
        delta = None
        for li, lw in enumerate(self.layers):
            x = add_rms_norm(delta, h, lw.attn_norm, eps, backend=be) if delta is not None else \
                add_rms_norm(h, None, lw.attn_norm, eps, backend=be)
            qkv = lw.qkv(x, lw.qkv_bias).view(b, n_h + 2 * n_kv, hd)
            q, k, v = (qkv[:, :n_h].contiguous(), qkv[:, n_h:n_h + n_kv].contiguous(),
                       qkv[:, n_h + n_kv:].contiguous())
            apply_rotary_(q, k, positions, self._kernel_cos, self._kernel_sin, backend=be)
            write_kv_(cache.k_layers[li], cache.v_layers[li], k, v, slot_ids, positions, backend=be)
            attn = decode_attention(q, cache.k_layers[li], cache.v_layers[li], slot_ids,
                                    positions + 1 if lengths is None else lengths, backend=be)
            delta = lw.o(attn.reshape(b, n_h * hd))
            x = add_rms_norm(delta, h, lw.mlp_norm, eps, backend=be)
            delta = lw.down(silu_mul(lw.gate_up(x), backend=be))
        x = add_rms_norm(delta, h, self.norm, eps, backend=be)
        return self.lm_head(x).float()

    # -- forward ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, cache: KVCache, token_ids: torch.Tensor, slot_ids: torch.Tensor, start_pos: torch.Tensor,
                seq_lens: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Run B ragged rows: row b holds seq_lens[b] >= 1 valid tokens at positions start_pos[b] + arange(S).

        Writes their keys/values into slot slot_ids[b] and returns fp32 logits of each row's last valid token
        (B, vocab), or of every position (B, S, vocab) with all_logits.
        """
        dev = self.device
        token_ids = token_ids.to(dev)
        if token_ids.shape[1] == 1 and not all_logits and self.use_kernels():  # decode: the fused kernels
            return self._decode_kernels(cache, token_ids[:, 0], slot_ids.to(dev, torch.long),
                                        start_pos.to(dev, torch.long))
        part = self._rows(cache, token_ids, slot_ids, start_pos, seq_lens)
        (h,) = self._layers(cache, [part])
        if not all_logits:
            h = h[torch.arange(h.shape[0], device=dev), part.seq_lens - 1]
        h = F.rms_norm(h, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        return self.lm_head(h).float()

    @torch.no_grad()
    def forward_mixed(self, cache: KVCache, prefill: tuple[torch.Tensor, ...],
                      decode: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill chunks and decode rows of one step in one pass over the weights: every matmul multiplies the
        tokens of both at once, only attention runs per part. prefill: forward()'s (token_ids (B, S), slot_ids,
        start_pos, seq_lens); decode: (token_ids (D,), slot_ids, positions). Returns fp32 logits of each prefill
        row's last valid token (B, vocab) and of each decode row (D, vocab), forward()'s numbers for each."""
        ids, slots, starts, lens = prefill
        d_ids, d_slots, d_pos = decode
        parts = [self._rows(cache, ids.to(self.device), slots, starts, lens),
                 self._rows(cache, d_ids.to(self.device).view(-1, 1), d_slots, d_pos, torch.ones_like(d_pos))]
        h_prefill, h_decode = self._layers(cache, parts)
        rows = torch.arange(h_prefill.shape[0], device=self.device)
        h = torch.cat([h_prefill[rows, parts[0].seq_lens - 1], h_decode[:, 0]])
        h = F.rms_norm(h, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        logits = self.lm_head(h).float()
        return logits[:h_prefill.shape[0]], logits[h_prefill.shape[0]:]

    def _rows(self, cache: KVCache, token_ids: torch.Tensor, slot_ids: torch.Tensor, start_pos: torch.Tensor,
              seq_lens: torch.Tensor) -> "RowPart":
        """What every layer needs about a (B, S) block of ragged rows: positions, rotary, cache cells, mask."""
        dev = self.device
        slot_ids = slot_ids.to(dev, torch.long)
        start_pos = start_pos.to(dev, torch.long)
        seq_lens = seq_lens.to(dev, torch.long)
        b, s = token_ids.shape
        offsets = torch.arange(s, device=dev)
        positions = start_pos.unsqueeze(1) + offsets  # (B, S)
        valid = offsets.unsqueeze(0) < seq_lens.unsqueeze(1)
        # Padded tokens write to the scratch cell; their queries see a harmless prefix (length >= 1, so no NaN).
        write_pos = torch.where(valid, positions, cache.max_seq_len)
        query_pos = torch.minimum(positions, (start_pos + seq_lens - 1).unsqueeze(1))
        longest = int((start_pos + seq_lens).max())
        t_len = min(-(-longest // ATTENTION_ROUND) * ATTENTION_ROUND, cache.max_seq_len)
        cos_t, sin_t = self.rope_tables(cache.max_seq_len)
        # sin's first half is negated: rotate_half(x) * sin == swap_halves(x) * sin
        return RowPart(token_ids, seq_lens, slot_ids.unsqueeze(1).expand(b, s), write_pos,
                       cos_t[query_pos].unsqueeze(2), sin_t[query_pos].unsqueeze(2),
                       attention_meta(slot_ids, query_pos, t_len))

    def _layers(self, cache: KVCache, parts: list["RowPart"]) -> list[torch.Tensor]:
        """The residual stream of each part after every layer, (B, S, hidden) each. The parts' tokens share each
        matmul (one pass over the weights); rotary, cache writes and attention run per part."""
        cfg = self.config
        n_h, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        half, eps, hidden = hd // 2, cfg.rms_norm_eps, cfg.hidden_size
        shapes = [p.token_ids.shape for p in parts]
        sizes = [b * s for b, s in shapes]
        h = torch.cat([self.embed(p.token_ids).reshape(-1, hidden) for p in parts]) if len(parts) > 1 \
            else self.embed(parts[0].token_ids).reshape(-1, hidden)  # (all tokens, hidden)
        for li, lw in enumerate(self.layers):
            x = F.rms_norm(h, (hidden,), lw.attn_norm, eps)
            qkv_all = lw.qkv(x, lw.qkv_bias)
            attn = []
            for part, (b, s), qkv in zip(parts, shapes, qkv_all.split(sizes)):
                qkv = qkv.view(b, s, n_h + 2 * n_kv, hd)
                qk = qkv[:, :, :n_h + n_kv]
                swapped = qk.unflatten(-1, (2, half)).flip(-2).flatten(-2)
                qk = torch.addcmul(qk * part.cos, swapped, part.sin)
                k_cache, v_cache = cache.k_layers[li], cache.v_layers[li]
                k_cache[part.slot_rows, :, part.write_pos] = qk[:, :, n_h:].to(k_cache.dtype)
                v_cache[part.slot_rows, :, part.write_pos] = qkv[:, :, n_h + n_kv:].to(v_cache.dtype)
                attn.append(attend(qk[:, :, :n_h], k_cache, v_cache, part.meta).reshape(b * s, n_h * hd))
            h = h + lw.o(torch.cat(attn) if len(attn) > 1 else attn[0])
            x = F.rms_norm(h, (hidden,), lw.mlp_norm, eps)
            gate, up = lw.gate_up(x).chunk(2, dim=-1)
            h = h + lw.down(F.silu(gate) * up)
        return [part.view(b, s, hidden) for part, (b, s) in zip(h.split(sizes), shapes)]

    def matmul_weights(self) -> list[Linear]:
        """Every weight matrix one decode step multiplies by (for the bare-matmul throughput limit)."""
        out: list[Linear] = []
        for lw in self.layers:
            out += [lw.qkv, lw.o, lw.gate_up, lw.down]
        return out + [self.lm_head]
