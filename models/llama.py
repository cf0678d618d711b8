"""A Llama-family model (models/llama_config.py: llama, qwen2, qwen3, phi3) over a slot KV cache: its weights as
the one forward (models/forward.py) multiplies them, and the entry points that run that forward.

One preallocated cache tensor holds every layer's keys and values for every slot:
    kv[2, n_layers, n_slots, n_kv_heads, max_seq_len + 1, head_dim]
Per-layer views `kv[0, l]` / `kv[1, l]` have shape (n_slots, n_kv_heads, T, head_dim), which is the layout scaled-dot-
product attention wants, so a batch whose slots are consecutive attends over a *view* of the cache without a copy.
The last position (index max_seq_len) is a scratch cell: padded tokens of ragged rows write there, so they can never
overwrite a real position of their own row in the same step.

Weights come by their HF checkpoint names; q/k/v and gate/up are concatenated once at load (phi3 stores them so) so
each layer runs two matmuls fewer per step (Python dispatch is a measurable cost on a 2-core CPU). On CPU dense
matrices are packed for oneDNN once (see Linear); quantized ones multiply through models/quant.py's linears on a CPU
and through kernels/dequant_matmul.py's Triton kernel on a GPU (models/gpu_linear.py).

    forward()        ragged rows (prefill chunks, or decode rows), torch ops; decode rows through the fused Triton
                     kernels where `kernels` says so
    forward_mixed()  prefill chunks and decode rows in one pass over the weights
    decode_graphs()  decode steps through the fused kernels as CUDA graphs (models/cuda_graphs.py)
The compiled decode step (loader/compiled_decode.py) runs the same forward.
"""
from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from models import packed_rows, quant, torch_internals
from models.forward import LayerWeights, ModelWeights, Rows, forward
from models.forward_ops import KernelOps, TorchOps
from models.llama_config import LlamaConfig
from models.rope import angle_tables

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
                packed = torch_internals.onednn_pack_linear_weight(w, PACK_BATCH_HINT)
            except (RuntimeError, AttributeError):  # no oneDNN for this dtype/CPU: plain matmuls
                packed = None
        return cls(w if packed is None else None, packed, w.shape[0], w.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return (self.plain if self.packed is None else self.packed).dtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.packed is not None:  # at a bounded set of row counts: oneDNN keeps a kernel per count
            y = packed_rows.linear(x.reshape(rows, self.in_features), self.packed, bias)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.plain, bias)


class RowStack:
    """Matrices stacked along the output rows that cannot be fused into one (e.g. Q4_K q/k and Q6_K v in one
    layer of a Q4_K_M file): one multiply per part, outputs concatenated."""

    def __init__(self, parts: list, out_features: int | None = None, in_features: int | None = None):
        self.parts = parts
        self.out_features = out_features or sum(p.out_features for p in parts)
        self.in_features = in_features or parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def map(self, fn) -> "RowStack":
        """The same stack with each part replaced by fn(part) (the compiled step's traceable forms)."""
        return RowStack([fn(p) for p in self.parts], self.out_features, self.in_features)


@dataclass
class CastLinear:
    """A matmul in a narrower dtype than its input (the bfloat16 lm_head of a quantized model): the input is cast
    to the weights' dtype, the output stays in it."""
    inner: object  # a Linear, or the form of it a compiled graph holds
    dtype: torch.dtype
    out_features: int
    in_features: int

    @classmethod
    def of(cls, linear: Linear) -> "CastLinear":
        return cls(linear, linear.dtype, linear.out_features, linear.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(self.dtype))

    def map(self, fn) -> "CastLinear":
        return replace(self, inner=fn(self.inner))


class RefinedHead:
    """The bfloat16 lm_head of a quantized model whose output matrix is not kept in blocks (a GPU, or tensors built
    by hand; a file's blocks go to quant.head_for, which refines the same way): an approximate bfloat16 matmul
    (oneDNN-packed on CPUs) for every logit, then the REFINE highest recomputed from the bfloat16 rows with fp32
    activations and fp32 sums, so the tokens greedy decoding and top-p sampling choose among are exact. With plain
    bf16 logits SmolLM2's top-1 agreement with the fp32 path over 600 teacher-forced tokens was 97.3-97.7%; refined,
    99.7%."""

    REFINE = 16

    def __init__(self, approx, weight: torch.Tensor):
        self.approx = approx  # x (rows, hidden) fp32 -> approximate logits (rows, vocab)
        self.weight = weight  # (vocab, hidden) bfloat16, the rows the refinement reads
        self.out_features, self.in_features = weight.shape

    @classmethod
    def build(cls, weight: torch.Tensor, pack: bool) -> "RefinedHead":
        return cls(CastLinear.of(Linear.build(weight, pack)), weight)

    def refine(self, x: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
        """approx (rows, vocab) fp32 with its REFINE highest logits recomputed exactly from x (rows, hidden) fp32."""
        top = approx.topk(min(self.REFINE, self.out_features), dim=-1).indices  # (rows, k)
        exact = torch.einsum("rh,rkh->rk", x, self.weight[top].float())
        return approx.scatter(1, top, exact)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.refine(x, self.approx(x).float())

    def map(self, fn) -> "RefinedHead":
        return RefinedHead(fn(self.approx), self.weight)


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


class LlamaModel:
    """Weights plus the entry points of the forward pass; the KV cache is passed in so it can outlive a reload."""

    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", pack: bool | None = None, kernels: str = "auto",
                 cpu_kernels=None):
        """kernels (engine.kernels): "auto" runs decode steps through the fused Triton kernels on CUDA and through
        torch's ops elsewhere; "triton" forces the kernels (on a CPU only with TRITON_INTERPRET=1, for tests: then
        quantized matrices multiply through the Triton kernel too); "torch" keeps torch's ops everywhere.
        cpu_kernels: kernels.cpu_quant's kernels (an opaque object) to multiply quantized weights with our CPU
        kernels instead of torch's ops (None: torch's)."""
        self.config = config
        self.kernels = kernels
        self.cpu_kernels = cpu_kernels
        self.dtype = dtype
        self.device = torch.device(device)
        if pack is None:  # oneDNN packing is a CPU matter; GPUs take plain weights
            pack = self.device.type == "cpu" and torch.backends.mkldnn.is_available()
        triton_matmuls = self.device.type == "cuda" or kernels == "triton"

        def take(name: str) -> torch.Tensor:
            # Always a private copy: loaders hand out views of memory-mapped files, and a weight file replaced in
            # place while we serve would otherwise kill the process with SIGBUS.
            return tensors[name].detach().to(device=self.device, dtype=dtype, copy=True).contiguous()

        def quantized_linear(m):
            if triton_matmuls:
                from models.gpu_linear import gpu_linear
                return gpu_linear(m, self.device, dtype, "triton" if kernels == "triton" else "auto")
            return quant.linear_for(m, cpu_kernels)

        def matrix(*names: str):
            """One linear layer of the named matrices stacked along the output rows (fused qkv, gate/up)."""
            parts = [tensors[n] for n in names]
            if isinstance(parts[0], quant.QuantizedMatrix):  # kept quantized: no float copy is ever made
                if len(parts) == 1:
                    return quantized_linear(parts[0])
                try:
                    return quantized_linear(quant.concat_rows(parts))
                except ValueError:  # different formats in one layer: one multiply each
                    return RowStack([quantized_linear(p) for p in parts])
            return Linear.build(torch.cat([take(n) for n in names]) if len(names) > 1 else take(names[0]), pack)

        self.quantized = any(isinstance(t, quant.QuantizedMatrix) for t in tensors.values())
        embed_t = tensors["model.embed_tokens.weight"]
        head_t = None if config.tie_word_embeddings else tensors.get("lm_head.weight")
        head_t = embed_t if head_t is None else head_t
        if isinstance(embed_t, quant.QuantizedMatrix) and isinstance(head_t, quant.QuantizedMatrix) \
                and not triton_matmuls:
            # kept in the file's blocks: exact rows looked up, the head refines its top logits from exact rows
            embed, lm_head = quant.BlockEmbedding(embed_t, cpu_kernels), quant.head_for(head_t, cpu_kernels)
        elif self.quantized:  # bfloat16 rows, widened per looked-up row; the head refined (RefinedHead)
            def bf16(t) -> torch.Tensor:
                t = quant.dequantize(t) if isinstance(t, quant.QuantizedMatrix) else t
                return t.to(self.device, torch.bfloat16).contiguous()
            embed_weight = bf16(embed_t)
            embed = _WidenedEmbedding(embed_weight)
            lm_head = RefinedHead.build(embed_weight if head_t is embed_t else bf16(head_t), pack)
        else:
            embed_weight = take("model.embed_tokens.weight")
            embed = _Embedding(embed_weight)
            lm_head = Linear.build(embed_weight if head_t is embed_t else take("lm_head.weight"), pack)
        layers = []
        n_h, n_kv = config.num_attention_heads, config.num_key_value_heads
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            if config.fused_projections:
                qkv, gate_up = matrix(p + "self_attn.qkv_proj.weight"), matrix(p + "mlp.gate_up_proj.weight")
            else:
                qkv = matrix(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"))
                gate_up = matrix(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None
            qk_norm = None
            if config.qk_norm:
                hd = config.head_dim
                qk_norm = torch.cat([take(p + "self_attn.q_norm.weight").expand(n_h, hd),
                                     take(p + "self_attn.k_norm.weight").expand(n_kv, hd)]).contiguous()
            layers.append(LayerWeights(
                attn_norm=take(p + "input_layernorm.weight"), qkv=qkv, qkv_bias=bias, qk_norm=qk_norm,
                o=matrix(p + "self_attn.o_proj.weight"), mlp_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=gate_up, down=matrix(p + "mlp.down_proj.weight")))
        self.weights = ModelWeights(embed=embed, layers=layers, norm=take("model.norm.weight"), head=lm_head,
                                    n_heads=n_h, n_kv_heads=n_kv, head_dim=config.head_dim,
                                    eps=config.rms_norm_eps)
        # The non-matmul ops through our CPU kernels' operators where the model multiplies with them and the
        # operators are loaded; attention too where it takes the head size (a 16 x 39 SmolLM2 prefill's attention of
        # a layer: 0.46-0.53 ms, against 2.1-2.8 ms through sdpa over widened cache views; AVX2, a Zen 4 EPYC)
        fused = cpu_kernels if cpu_kernels is not None and cpu_kernels.op and self.device.type == "cpu" else None
        hd = config.head_dim
        attention = fused.attention if fused is not None and hd % 16 == 0 and hd <= 256 else None
        self.torch_ops = TorchOps(config.rms_norm_eps, attention, fused)
        self._tables: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    # -- what tests, benchmarks and the compiled step read ------------------------------------------------------
    @property
    def layers(self) -> list[LayerWeights]:
        return self.weights.layers

    @property
    def lm_head(self):
        return self.weights.head

    def matmul_weights(self) -> list:
        """Every weight matrix one decode step multiplies by (for the bare-matmul throughput limit)."""
        out: list = []
        for lw in self.layers:
            out += [lw.qkv, lw.o, lw.gate_up, lw.down]
        return out + [self.lm_head]

    # -- rotary -------------------------------------------------------------------------------------------------
    def rope_tables(self, cache: KVCache, half: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions 0..max_seq_len (the scratch cell included) of this cache's context:
        (positions, head_dim) in the compute dtype with sin's first half negated (TorchOps), or with `half`
        (positions, head_dim // 2) fp32 (KernelOps)."""
        key = (cache.max_seq_len, half)
        if key not in self._tables:
            cos, sin = angle_tables(self.config, cache.max_seq_len + 1, cache.max_seq_len)
            if half:
                self._tables[key] = cos.to(self.device), sin.to(self.device)
            else:  # computed in fp32 like HF, then cast
                self._tables[key] = (torch.cat([cos, cos], dim=-1).to(self.device, self.dtype),
                                     torch.cat([-sin, sin], dim=-1).to(self.device, self.dtype))
        return self._tables[key]

    # -- decode through the fused kernels -----------------------------------------------------------------------
    def use_kernels(self) -> bool:
        if self.kernels == "torch":
            return False
        from kernels import use_triton
        return use_triton(self.kernels, self.device)

    def kernel_ops(self, cache: KVCache, backend: str = "triton") -> KernelOps:
        """The fused kernels for decode rows over cache (backend "torch": their torch twins, for benchmarks)."""
        cos, sin = self.rope_tables(cache, half=True)
        return KernelOps(self.config.rms_norm_eps, self.config.num_attention_heads, cos, sin, backend)

    def decode_kernels(self, cache: KVCache, token_ids: torch.Tensor, slot_ids: torch.Tensor,
                       positions: torch.Tensor, lengths: torch.Tensor | None = None,
                       ops: KernelOps | None = None) -> torch.Tensor:
        """One token per row (B,) at its own position through the fused kernels: fp32 logits (B, vocab). No host
        syncs (lengths: positions + 1 unless given), so it can be captured."""
        ops = ops or self.kernel_ops(cache)
        rows = ops.decode_rows(token_ids, slot_ids, positions, positions + 1 if lengths is None else lengths)
        return self.weights.head(forward(self.weights, ops, cache.k_layers, cache.v_layers, [rows])).float()

    def decode_graphs(self, cache: KVCache):
        """Decode steps through the fused kernels as CUDA graphs, one per batch-size bucket up to the slot count
        (models/cuda_graphs.py; on a CPU the same buffers run eagerly). Padded rows write to the scratch cell
        (position max_seq_len) of slot 0 and attend over one position, so they touch nothing real."""
        from models.cuda_graphs import DecodeGraphs, InputSpec

        ops = self.kernel_ops(cache)
        specs = {"token_ids": InputSpec((), torch.long, 0), "slot_ids": InputSpec((), torch.long, 0),
                 "positions": InputSpec((), torch.long, cache.max_seq_len), "lengths": InputSpec((), torch.long, 1)}
        return DecodeGraphs(lambda token_ids, slot_ids, positions, lengths: self.decode_kernels(
            cache, token_ids, slot_ids, positions, lengths, ops), specs, max_batch=cache.n_slots, device=self.device)

    # -- the forward, eager -------------------------------------------------------------------------------------
    def _ragged(self, cache: KVCache, token_ids: torch.Tensor, slot_ids: torch.Tensor, start_pos: torch.Tensor,
                seq_lens: torch.Tensor, packed: bool = True) -> Rows:
        """Ragged rows, packed (only their own tokens) where the ops' attention takes them so (TorchOps.packs)."""
        dev = self.device
        cos, sin = self.rope_tables(cache)
        return self.torch_ops.ragged_rows(token_ids.to(dev), slot_ids.to(dev, torch.long),
                                          start_pos.to(dev, torch.long), seq_lens.to(dev, torch.long),
                                          cache.max_seq_len, cos, sin,
                                          packed and self.torch_ops.packs(self.dtype, cache.kv.dtype))

    @torch.no_grad()
    def forward(self, cache: KVCache, token_ids: torch.Tensor, slot_ids: torch.Tensor, start_pos: torch.Tensor,
                seq_lens: torch.Tensor, all_logits: bool = False, pad: bool = False) -> torch.Tensor:
        """Run B ragged rows: row b holds seq_lens[b] >= 1 valid tokens at positions start_pos[b] + arange(S).

        Writes their keys/values into slot slot_ids[b] and returns fp32 logits of each row's last valid token
        (B, vocab), or of every position (B, S, vocab) with all_logits. pad: every row padded to the longest even
        where the ops take them packed (the same numbers, more rows: benchmarks' baseline and tests).
        """
        dev = self.device
        b, s = token_ids.shape
        if s == 1 and not all_logits and self.use_kernels():  # decode: the fused kernels
            return self.decode_kernels(cache, token_ids.to(dev)[:, 0], slot_ids.to(dev, torch.long),
                                       start_pos.to(dev, torch.long))
        rows = self._ragged(cache, token_ids, slot_ids, start_pos, seq_lens, packed=not (all_logits or pad))
        x = forward(self.weights, self.torch_ops, cache.k_layers, cache.v_layers, [rows])
        if all_logits:
            return self.weights.head(x).float().view(b, s, -1)
        if s > 1:
            x = x[rows.last]
        return self.weights.head(x).float()

    @torch.no_grad()
    def forward_mixed(self, cache: KVCache, prefill: tuple[torch.Tensor, ...],
                      decode: tuple[torch.Tensor, ...], pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill chunks and decode rows of one step in one pass over the weights: every matmul multiplies the
        tokens of both at once, only attention runs per part. prefill: forward()'s (token_ids (B, S), slot_ids,
        start_pos, seq_lens); decode: (token_ids (D,), slot_ids, positions). Returns fp32 logits of each prefill
        row's last valid token (B, vocab) and of each decode row (D, vocab), forward()'s numbers for each (pad: as
        forward()'s)."""
        ids, slots, starts, lens = prefill
        d_ids, d_slots, d_pos = decode
        parts = [self._ragged(cache, ids, slots, starts, lens, packed=not pad),
                 self._ragged(cache, d_ids.view(-1, 1), d_slots, d_pos, torch.ones_like(d_pos), packed=not pad)]
        x = forward(self.weights, self.torch_ops, cache.k_layers, cache.v_layers, parts)
        n, b = parts[0].n, ids.shape[0]
        logits = self.weights.head(torch.cat([x[:n][parts[0].last], x[n:]])).float()
        return logits[:b], logits[b:]

    @torch.no_grad()
    def forward_verify(self, cache: KVCache, prefill: tuple[torch.Tensor, ...] | None,
                       decode: tuple[torch.Tensor, ...] | None, verify: tuple[torch.Tensor, ...]
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """forward_mixed with a third part: speculative rows (forward()'s (token_ids (V, S), slot_ids, start_pos,
        seq_lens): a decode row's token and its draft), whose every valid position gives logits. One pass over the
        weights for all. Returns (prefill rows' last logits or None, decode rows' or None, the verify rows' logits
        (sum(seq_lens), vocab), row after row)."""
        parts, kinds = [], []
        if prefill is not None:
            parts.append(self._ragged(cache, *prefill))
            kinds.append("prefill")
        if decode is not None:
            d_ids, d_slots, d_pos = decode
            parts.append(self._ragged(cache, d_ids.view(-1, 1), d_slots, d_pos, torch.ones_like(d_pos)))
            kinds.append("decode")
        v_ids, v_slots, v_starts, v_lens = verify
        parts.append(self._ragged(cache, v_ids, v_slots, v_starts, v_lens))
        kinds.append("verify")
        x = forward(self.weights, self.torch_ops, cache.k_layers, cache.v_layers, parts)
        picks, offset, sizes = [], 0, []
        lens = v_lens.to(x.device, torch.long)
        for kind, rows in zip(kinds, parts):
            if kind == "verify":  # a row's valid tokens are contiguous and end at its `last`
                first = rows.last - (lens - 1)
                index = torch.cat([torch.arange(int(f), int(f) + int(n), device=x.device)
                                   for f, n in zip(first, lens)])
            else:
                index = rows.last
            picks.append(x[offset:offset + rows.n][index])
            sizes.append(len(index))
            offset += rows.n
        logits = self.weights.head(torch.cat(picks)).float().split(sizes)
        out = dict(zip(kinds, logits))
        return out.get("prefill"), out.get("decode"), out["verify"]


class _Embedding:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class _WidenedEmbedding(_Embedding):
    """bfloat16 rows, widened to fp32 per looked-up row (quantized models compute in fp32)."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float()
