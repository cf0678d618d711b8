"""Executes a step plan on the model, then samples: the prefill chunks (ragged rows, padded to the longest chunk) and
the decode rows (one token per generating sequence, each at its own position) in one pass over the weights
(LlamaModel.forward_mixed). A step with decode rows only runs as CUDA graphs on a GPU, through the compiled decode
step on a CPU once it is compiled, else eagerly: every one of these is the same forward (models/forward.py)."""
from __future__ import annotations

import logging
import time

import torch

from appliance.engine.llm.grammar import MaskFiller
from appliance.engine.llm.sampling import apply_token_masks, make_generator, sample, sample_one, verify_token
from appliance.engine.llm.scheduler import DecodeRow, StepPlan, Verified
from appliance.engine.llm.sequence import Sequence
from models.llama import KVCache, LlamaModel

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, graphs: bool | None = None, compiled=None):
        """graphs: decode steps as CUDA graphs (None: when the model decodes through the fused kernels on CUDA;
        True on a CPU runs the same padded buffers eagerly, for tests). compiled: a CompiledDecode
        (loader/compiled_decode.py) that decode steps go through once it is ready."""
        self.model = model
        self.cache = cache
        self.compiled = compiled
        if graphs is None:
            graphs = model.device.type == "cuda" and model.use_kernels()
        self._want_graphs = graphs
        self._graphs = None  # captured at the first decode step (Triton compiles there too)
        self._generators: dict[int, torch.Generator] = {}
        self.prefixes: dict[tuple[int, ...], torch.Tensor] = {}  # shared heads' KV (keys: prefix_index)
        self.parked: dict[str, torch.Tensor] = {}  # parked conversations' KV by session (slots.SlotMove)
        self._masks: MaskFiller | None = None  # built at the first constrained row
        # Read by bench/tasks.py (EngineLoop.step_counts): forwards run, time spent computing and applying token
        # masks, rows masked
        self.steps = 0
        self.mask_seconds = 0.0
        self.mask_rows = 0
        # Speculation (bench/speculative.py): rows verified, tokens drafted, drafted tokens accepted
        self.verify_rows = 0
        self.drafted = 0
        self.accepted = 0

    @property
    def graphs(self) -> bool:
        """Decode steps run as CUDA graphs (fixed one-token rows)."""
        return self._want_graphs

    def run(self, plan: StepPlan) -> dict[int, int]:
        """request_id -> sampled token, for every decode row and every prefill chunk that completes its prompt."""
        sampled: dict[int, int] = {}
        if plan.prefill or plan.decode:
            self.steps += 1
        kv = self.cache.kv  # (2, layers, slots, kv_heads, positions, head_dim)
        for move in plan.slot_moves:  # in order: a slot's old owner is parked before a new one is restored in it
            if move.kind == "park":
                self.parked[move.session] = kv[:, :, move.slot, :, :move.length].clone()
            elif move.kind == "restore":
                kv[:, :, move.slot, :, :move.length] = self.parked.pop(move.session)
            else:
                self.parked.pop(move.session, None)
        for key in plan.prefix_drops:
            self.prefixes.pop(key, None)
        for copy in plan.prefix_loads:
            kv[:, :, copy.slot, :, :len(copy.key)] = self.prefixes[copy.key]
        prefill = self._prefill_inputs(plan) if plan.prefill else None
        verify_rows = [r for r in plan.decode if r.draft]
        decode_rows = sorted((r for r in plan.decode if not r.draft), key=lambda r: r.slot)  # consecutive slots
        decode = (torch.tensor([r.token for r in decode_rows]), torch.tensor([r.slot for r in decode_rows]),  # attend
                  torch.tensor([r.pos for r in decode_rows])) if decode_rows else None  # over a cache view
        prefill_logits = decode_logits = None
        if verify_rows:  # speculation: the drafted rows' every position, with the others, in one pass
            if self._want_graphs:
                raise RuntimeError("speculative rows are verified by the eager forward only")
            prefill_logits, decode_logits, verify_logits = self.model.forward_verify(
                self.cache, prefill, decode, self._verify_inputs(verify_rows))
            start = 0
            for r in verify_rows:
                n = 1 + len(r.draft)
                sampled[r.seq.request_id] = self._verify(r, verify_logits[start:start + n])
                start += n
        elif prefill is not None and decode is not None and not self._want_graphs:
            # one pass over the weights for both (a decode step's matmuls are mostly reading the weights)
            prefill_logits, decode_logits = self.model.forward_mixed(self.cache, prefill, decode)
        elif prefill is not None:
            prefill_logits = self.model.forward(self.cache, *prefill)
        if prefill is not None:
            for copy in plan.prefix_saves:
                self.prefixes[copy.key] = kv[:, :, copy.slot, :, :len(copy.key)].clone()
            rows = [i for i, c in enumerate(plan.prefill) if c.last]
            if rows:
                self._sample(prefill_logits[rows], [plan.prefill[i].seq for i in rows], sampled)
        if decode is not None:
            if decode_logits is None:
                decode_logits = self._decode(*decode)
            self._sample(decode_logits, [r.seq for r in decode_rows], sampled)
        return sampled

    @staticmethod
    def _verify_inputs(rows: list[DecodeRow]) -> tuple[torch.Tensor, ...]:
        width = 1 + max(len(r.draft) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :1 + len(r.draft)] = torch.tensor([r.token, *r.draft], dtype=torch.long)
        return (ids, torch.tensor([r.slot for r in rows]), torch.tensor([r.pos for r in rows]),
                torch.tensor([1 + len(r.draft) for r in rows]))

    def _verify(self, row: DecodeRow, logits: torch.Tensor) -> Verified:
        """The reply's tokens from a drafted row's logits (1 + k, vocab): position i checks draft[i]
        (sampling.verify_token) until one is refused (the token drawn instead ends the list) or the draft is accepted
        whole (a token drawn from the last position follows). Under a grammar each position is masked for the
        matcher's state after the tokens before it (consumed here, then rolled back: the scheduler's commit
        consumes them as plain steps do), and the list ends where the grammar forces tokens or stops."""
        seq, draft = row.seq, row.draft
        gen = self._generator(seq) if seq.temperature > 0 else None
        constraint = seq.constraint
        tokens: list[int] = []
        consumed = 0
        self.verify_rows += 1
        self.drafted += len(draft)
        try:
            for i in range(len(draft) + 1):
                row_logits = logits[i:i + 1]
                if constraint is not None:
                    started = time.perf_counter()
                    if self._masks is None:
                        self._masks = MaskFiller(logits.shape[1])
                    row_logits = apply_token_masks(row_logits.clone(), [0], self._masks.fill([constraint]))
                    self.mask_seconds += time.perf_counter() - started
                    self.mask_rows += 1
                if i == len(draft):
                    tokens.append(sample_one(row_logits[0], seq.temperature, seq.top_p, gen))
                    break
                ok, token = verify_token(row_logits[0], draft[i], seq.temperature, seq.top_p, gen)
                tokens.append(token)
                if not ok:
                    break
                if constraint is not None:  # the grammar's state for the next position
                    matcher = constraint.matcher
                    if matcher.is_stopped() or not matcher.consume_token(token):
                        break
                    consumed += 1
                    if matcher.is_stopped() or matcher.compute_ff_tokens():
                        break
        finally:
            if consumed:
                constraint.matcher.rollback(consumed)
        accepted = next((i for i, (a, b) in enumerate(zip(tokens, draft)) if a != b), min(len(tokens), len(draft)))
        self.accepted += accepted
        return Verified(tokens, accepted)

    @staticmethod
    def _prefill_inputs(plan: StepPlan) -> tuple[torch.Tensor, ...]:
        """forward()'s ragged rows for the plan's prefill chunks, padded to the longest."""
        chunks = plan.prefill
        ids = torch.zeros(len(chunks), max(len(c.tokens) for c in chunks), dtype=torch.long)
        for i, c in enumerate(chunks):
            ids[i, :len(c.tokens)] = torch.tensor(c.tokens, dtype=torch.long)
        return (ids, torch.tensor([c.slot for c in chunks]), torch.tensor([c.start_pos for c in chunks]),
                torch.tensor([len(c.tokens) for c in chunks]))

    def _decode(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A decode step alone: CUDA graphs, else the compiled step once ready, else the eager forward."""
        if self._want_graphs:
            if self._graphs is None:
                self._graphs = self.model.decode_graphs(self.cache)
            return self._graphs.run(token_ids=tokens, slot_ids=slots, positions=positions,
                                    lengths=positions + 1).float()
        if self.compiled is not None and self.compiled.ready:
            try:
                return self.compiled.step(tokens, slots, positions)
            except Exception:  # noqa: BLE001 - e.g. a shape that would recompile: eager from now on
                log.exception("compiled decode step failed; decoding eagerly from now on")
                self.compiled = None
        return self.model.forward(self.cache, tokens.view(-1, 1), slots, positions,
                                  torch.ones(len(tokens), dtype=torch.long))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], out: dict[int, int]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if rows:  # the grammar's mask of each constrained row, computed on the CPU for this step
            started = time.perf_counter()
            if self._masks is None:
                self._masks = MaskFiller(logits.shape[1])
            bits = self._masks.fill([seqs[i].constraint for i in rows])
            logits = apply_token_masks(logits, rows, bits)
            self.mask_seconds += time.perf_counter() - started
            self.mask_rows += len(rows)
        gens = [self._generator(s) if s.temperature > 0 else None for s in seqs]
        tokens = sample(logits, [s.temperature for s in seqs], [s.top_p for s in seqs], gens)
        for s, t in zip(seqs, tokens):
            out[s.request_id] = t

    def _generator(self, seq: Sequence) -> torch.Generator:
        g = self._generators.get(seq.request_id)
        if g is None:
            g = self._generators[seq.request_id] = make_generator(seq.seed)
        return g

    @torch.no_grad()
    def score_options(self, prompt: list[int], options: list[list[int]], slots: list[int]) -> list[float]:
        """Choose (engine/llm/choose.py): log P(option | prompt) summed over each option's tokens. The prompt is
        prefilled into slots[0] and its cache copied into the other slots; the options run as rows of one forward
        per len(slots) options, row i at positions len(prompt).. of its own slot (each option's last token needs
        no forward: only the logits before it count)."""
        kv, n = self.cache.kv, len(prompt)
        last = self.model.forward(self.cache, torch.tensor([prompt]), torch.tensor([slots[0]]), torch.tensor([0]),
                                  torch.tensor([n]))
        first = torch.log_softmax(last[0].float(), dim=-1).cpu()
        for s in slots[1:]:  # the prompt's keys and values, shared by copy
            kv[:, :, s, :, :n] = kv[:, :, slots[0], :, :n]
        scores = [float(first[o[0]]) for o in options]
        longer = [i for i, o in enumerate(options) if len(o) > 1]
        for g in range(0, len(longer), len(slots)):
            group = longer[g:g + len(slots)]
            width = max(len(options[i]) - 1 for i in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            for r, i in enumerate(group):
                ids[r, :len(options[i]) - 1] = torch.tensor(options[i][:-1])
            logits = self.model.forward(self.cache, ids, torch.tensor(slots[:len(group)]),
                                        torch.full((len(group),), n, dtype=torch.long),
                                        torch.tensor([len(options[i]) - 1 for i in group]), all_logits=True)
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()
            for r, i in enumerate(group):
                targets = torch.tensor(options[i][1:])
                scores[i] += float(logp[r, torch.arange(len(targets)), targets].double().sum())
        return scores

    def forget(self, seq: Sequence) -> None:
        """The sequence ended: drop its random stream."""
        self._generators.pop(seq.request_id, None)
