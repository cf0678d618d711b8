"""llama.cpp as a baseline for bench/generate.py: the same GGUF file, the same prompt tokens, n sequences decoded
together greedily (llama-cpp-python's low-level API: one llama_batch per step, one sequence id per prompt).

Installed by scripts/setup-bench.sh only (it compiles llama.cpp with this CPU's native flags); never part of the
appliance or its tests.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np


class LlamaCpp:
    def __init__(self, path: Path, threads: int, n_ctx: int, n_seq: int, flash_attention: bool = True,
                 extra_buffers: bool | None = None, n_batch: int | None = None):
        """n_batch: tokens a decode takes (default: the whole context, at least 512: one prefill batch)."""
        from llama_cpp import llama_cpp as L
        self.L = L
        self._quiet = L.llama_log_callback(lambda level, text, user: None)  # kept: llama.cpp holds the pointer
        L.llama_log_set(self._quiet, ctypes.c_void_p())
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        if extra_buffers is not None and hasattr(mp, "use_extra_bufts"):  # llama.cpp's repacked / AMX weights
            mp.use_extra_bufts = extra_buffers
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx * n_seq
        cp.n_batch = n_batch or max(512, n_ctx)
        cp.n_ubatch = cp.n_batch
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = threads
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = 1 if flash_attention else 0
        elif hasattr(cp, "flash_attn"):
            cp.flash_attn = flash_attention
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_seq = n_seq
        self.n_batch = cp.n_batch
        self.batch = L.llama_batch_init(max(cp.n_batch, n_ctx) * n_seq, 0, n_seq)

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _logits(self, i: int) -> np.ndarray:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence id, wants logits)."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def generate(self, prompts: list[list[int]], new: int) -> tuple[float, float, list[list[int]]]:
        """(tokens/s over all sequences, mean time to first token, greedy tokens) for len(prompts) sequences."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        n = len(prompts)
        start = time.perf_counter()
        rows = []
        for s, p in enumerate(prompts):  # prefill batches holding every prompt, as our scheduler does
            rows += [(t, i, s, i == len(p) - 1) for i, t in enumerate(p)]
        out: list[list[int]] = [[] for _ in prompts]
        for at in range(0, len(rows), self.n_batch):  # llama.cpp takes at most n_batch tokens per decode
            chunk = rows[at:at + self.n_batch]
            self._decode(chunk)
            for i, (_tok, _pos, s, last) in enumerate(chunk):
                if last:
                    out[s].append(int(np.argmax(self._logits(i))))
        ttft = time.perf_counter() - start
        for step in range(1, new):
            self._decode([(out[s][-1], len(prompts[s]) + step - 1, s, True) for s in range(n)])
            for s in range(n):
                out[s].append(int(np.argmax(self._logits(s))))
        wall = time.perf_counter() - start
        return n * new / wall, ttft, out

    def teacher_forced_top1(self, ids: list[int]) -> np.ndarray:
        """Arg-max of the logits after each position of `ids` (one sequence), for agreement with other paths."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        self._decode([(t, i, 0, True) for i, t in enumerate(ids)])
        return np.array([int(np.argmax(self._logits(i))) for i in range(len(ids))])


    def teacher_forced_logits(self, ids: list[int]) -> np.ndarray:
        """The logits after each position of `ids` (one sequence), (len(ids), vocab) float32, n_batch at a time."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        out = np.empty((len(ids), self.n_vocab), np.float32)
        for at in range(0, len(ids), self.n_batch):
            chunk = ids[at:at + self.n_batch]
            self._decode([(t, at + i, 0, True) for i, t in enumerate(chunk)])
            for i in range(len(chunk)):
                out[at + i] = self._logits(i)
        return out


def extra_buffers_work(path: Path, threads: int) -> bool:
    """Whether llama.cpp's extra weight buffers (its AMX / repacked layouts) decode this file here, tried in a child
    process: on the AMX Xeon this was written on, llama-cpp-python 0.3.36's AMX buffer crashed (SIGSEGV) at the
    first decode of SmolLM2 Q4_1; the baseline then runs with them off (its AVX-512 VNNI dot products)."""
    import subprocess
    import sys
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from llama_cpp_baseline import LlamaCpp; "
            "l = LlamaCpp(sys.argv[2], int(sys.argv[3]), 64, 2, extra_buffers=True); "
            "l.generate([[1, 2, 3, 4], [5, 6, 7]], 4); l.close()")
    try:
        done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(path), str(threads)],
                              capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def system_info() -> str:
    """llama.cpp's own account of the instructions it was built with ("AVX2 = 1 | AVX512 = 0 ...")."""
    from llama_cpp import llama_cpp as L
    info = L.llama_print_system_info()
    return (info.decode(errors="replace") if isinstance(info, bytes) else str(info)).strip()


def available() -> bool:
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None
