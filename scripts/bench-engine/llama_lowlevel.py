"""A thin wrapper over llama-cpp-python's low-level (ctypes) API.

Just what the benchmark and the GGUF parity check need: load a model, make a context, decode
batches of (token, position, sequence, wants-logits) entries, read a row of logits, clear the
KV cache. No sampling chains and no high-level `Llama` object, so the timed sections contain
llama_decode and an argmax and nothing else.
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

import llama_cpp as lc

_backend_ready = False
_log_callback = None  # kept alive: llama.cpp holds the pointer


def init(quiet: bool = True) -> None:
    """Initialises the llama.cpp backend once; `quiet` drops its log output."""
    global _backend_ready, _log_callback
    if _backend_ready:
        return
    if quiet and not os.environ.get("BENCH_LLAMA_VERBOSE"):
        _log_callback = lc.llama_log_callback(lambda level, text, user: None)
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
    lc.llama_backend_init()
    _backend_ready = True


class ForeignCpu:
    """CPU time other processes used while this one ran a timed section (a noisy-box check).

    `share` is that time over wall time × cores: 0 on a quiet machine, ~0.5 when another job
    kept one of two cores busy.
    """

    def __init__(self):
        self.tick = os.sysconf("SC_CLK_TCK")
        self.start()

    @staticmethod
    def _busy_ticks() -> int:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...
        return v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.own0 = time.process_time()
        self.busy0 = self._busy_ticks()

    def share(self) -> float:
        wall = time.perf_counter() - self.t0
        own = time.process_time() - self.own0
        busy = (self._busy_ticks() - self.busy0) / self.tick
        return max(0.0, busy - own) / max(wall * (os.cpu_count() or 1), 1e-9)


def system_info() -> str:
    init()
    return lc.llama_print_system_info().decode("utf-8", "replace").strip()


class Model:
    """A loaded GGUF (the library's default load mode)."""

    def __init__(self, path: str):
        init()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        self.ptr = lc.llama_model_load_from_file(path.encode(), params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.path = path
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        # How the weights are loaded (library default; "mmap" unless the build decides otherwise).
        mode = int(getattr(params, "load_mode", -2))
        name = lc.llama_load_mode_name(mode) if hasattr(lc, "llama_load_mode_name") else None
        self.load_mode = name.decode() if name else str(mode)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = lc.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def close(self) -> None:
        if self.ptr:
            lc.llama_model_free(self.ptr)
            self.ptr = None


class Context:
    """A llama.cpp context with its own batch buffer.

    Everything not set here keeps llama.cpp's default (`llama_context_default_params`):
    flash attention auto, f16 KV cache, and so on; n_batch and n_ubatch are 512 unless given.
    """

    def __init__(
        self,
        model: Model,
        n_ctx: int,
        n_seq_max: int = 1,
        threads: int = 2,
        n_batch: int = 512,
        n_ubatch: int = 512,
    ):
        p = lc.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_ubatch
        p.n_seq_max = n_seq_max
        p.n_threads = threads
        p.n_threads_batch = threads
        p.no_perf = True
        self.ptr = lc.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx})")
        self.model = model
        self.mem = lc.llama_get_memory(self.ptr)
        self.n_batch = lc.llama_n_batch(self.ptr)
        self.n_seq_max = n_seq_max
        self.params = {
            "n_ctx": lc.llama_n_ctx(self.ptr),
            "n_ctx_seq": lc.llama_n_ctx_seq(self.ptr),
            "n_batch": self.n_batch,
            "n_ubatch": lc.llama_n_ubatch(self.ptr),
            "n_seq_max": lc.llama_n_seq_max(self.ptr),
            "flash_attn_type": int(p.flash_attn_type),
            "kv_unified": bool(p.kv_unified),
            "type_k": int(p.type_k),
            "type_v": int(p.type_v),
            "threads": threads,
            "load_mode": model.load_mode,
        }
        self._batch = lc.llama_batch_init(self.n_batch, 0, max(1, n_seq_max))
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        self._seq = [b.seq_id[i] for i in range(self.n_batch)]
        self._seq_cache = np.full(self.n_batch, -1, dtype=np.int64)

    def clear(self) -> None:
        """Empties the KV cache (all sequences)."""
        lc.llama_memory_clear(self.mem, True)

    def decode(self, tokens, positions, seqs, outputs) -> None:
        """One llama_decode of up to n_batch entries; `outputs` marks rows that get logits.

        Logits of the i-th marked row are then `logits(i)`.
        """
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"batch of {n} entries (n_batch {self.n_batch})")
        b = self._batch
        b.n_tokens = n
        self._tok[:n] = tokens
        self._pos[:n] = positions
        self._nseq[:n] = 1
        self._out[:n] = outputs
        seqs = np.asarray(seqs, dtype=np.int64)
        changed = np.nonzero(self._seq_cache[:n] != seqs)[0]
        for i in changed:
            self._seq[i][0] = int(seqs[i])
        self._seq_cache[:n] = seqs
        rc = lc.llama_decode(self.ptr, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def sync(self) -> None:
        lc.llama_synchronize(self.ptr)

    def logits(self, i: int) -> np.ndarray:
        """Logits of the i-th output row of the last decode (-1: the last), a view."""
        ptr = lc.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise RuntimeError(f"no logits for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def all_logits(self, n_outputs: int) -> np.ndarray:
        """The last decode's output rows, (n_outputs, n_vocab), a view."""
        ptr = lc.llama_get_logits(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(n_outputs, self.model.n_vocab))

    def prefill(self, tokens, seq: int = 0, start: int = 0) -> np.ndarray:
        """Decodes `tokens` for one sequence in n_batch chunks; returns the last row's logits."""
        n = len(tokens)
        toks = np.asarray(tokens, dtype=np.int32)
        for lo in range(0, n, self.n_batch):
            hi = min(n, lo + self.n_batch)
            out = np.zeros(hi - lo, dtype=np.int8)
            if hi == n:
                out[-1] = 1
            self.decode(toks[lo:hi], np.arange(start + lo, start + hi), np.full(hi - lo, seq), out)
        self.sync()
        return self.logits(-1)

    def close(self) -> None:
        if self.ptr:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self.ptr)
            self.ptr = None


def greedy(model: Model, prompt, max_tokens: int, eos=(), threads: int = 2):
    """Greedy continuation of `prompt` (token ids); stops after an id in `eos`."""
    ctx = Context(model, n_ctx=max(512, len(prompt) + max_tokens + 8), threads=threads)
    try:
        logits = ctx.prefill(prompt)
        out = []
        pos = len(prompt)
        for _ in range(max_tokens):
            tok = int(np.argmax(logits))
            out.append(tok)
            if tok in eos:
                break
            ctx.decode([tok], [pos], [0], [1])
            ctx.sync()
            logits = ctx.logits(-1)
            pos += 1
        return out
    finally:
        ctx.close()


def prompt_logits(model: Model, prompt, threads: int = 2) -> np.ndarray:
    """Logits of every prompt position, (len(prompt), n_vocab), a copy."""
    ctx = Context(model, n_ctx=max(512, len(prompt) + 8), threads=threads)
    try:
        n = len(prompt)
        rows = []
        for lo in range(0, n, ctx.n_batch):
            hi = min(n, lo + ctx.n_batch)
            ctx.decode(prompt[lo:hi], list(range(lo, hi)), [0] * (hi - lo), [1] * (hi - lo))
            ctx.sync()
            rows.append(np.array(ctx.all_logits(hi - lo)))
        return np.concatenate(rows)
    finally:
        ctx.close()
