"""llama.cpp on the course's real model: its logits and its cache operations beside the course's.

Introduced in chapter 9 (page 9.8, how the engines compare). llama.cpp multiplies with the GGUF
file's 4-bit weights and activations quantized to 8 bits, where the course's model runs the same
weights dequantized to float32: the two are two computations of one model, and agree as such, by
top-1 agreement and the KL divergence of their next-token distributions, not to rounding. On the
same token ids of a standard-library module's documentation this module records

1. the ids (llama.cpp's tokenizer against the course's) and the logits of one prefill, with
   llama.cpp's flash attention as it chooses (on, for its CPU back end) and off;
2. rollback: `seq_rm` of the last positions, then the same tokens again, against llama.cpp's own
   logits for those tokens batched the same way the first time (its logits depend on how tokens
   are batched, so that, not the one-batch prefill, is what it must reproduce) and against the
   course's `CellsCache` rolled back;
3. a fork: `seq_cp` to a second sequence, then one token decoded on both;
4. the context shift: `seq_rm` of `n_discard` positions after `n_keep`, then `seq_add` moving the
   later ones down, against `labcode.kshift.context_shift`, for each `n_keep`.

llama-cpp-python is no dependency of the course: it compiles llama.cpp (`labcode.engines.llamacpp`
times that). Install a wheel of it into any folder (`pip install --no-deps --target DIR <wheel>`),
then run

    python -m labcode.engines.llamacpp_compare --out qa/results/llamacpp_compare.json --site DIR

Without `--site` it uses the installed `llama_cpp`. Only the binding's ctypes layer
(`llama_cpp.llama_cpp`) is loaded, so the high-level API's own dependencies are not needed.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from labcode.checks import fail, is_int
from labcode.corpus import stdlib_text
from labcode.engines.cells import CellsCache
from labcode.engines.llamacpp import VERSION, write_record
from labcode.kshift import context_shift
from labcode.results import QAResult, close, exact, recorded, rounding_rule
from labcode.weights.smollm2 import load_smollm2, package_file

PARAMETERS = {
    "module": "json",  # the text: this standard-library module's documentation (labcode.corpus)
    "n_tokens": 256,  # T: tokens prefilled and compared
    "n_rollback": 32,  # positions removed with seq_rm and evaluated again
    "shift_len": 64,  # S: tokens cached before the context shift
    "n_discard": 16,  # positions the shift removes after the first n_keep
    "keeps": [0, 4],  # n_keep values of the shift
    "n_next": 16,  # tokens decoded after the shift and compared
    "dtype": "float32",  # the course model's
}
# Two computations of one model, bounds a few times above what was measured (the record holds the values).
TOP1_MIN = 0.9  # share of positions whose most likely next token is the same
KL_MEAN_MAX = 0.02  # nats: mean KL(course || llama.cpp) of the next-token distributions
KL_MAX_MAX = 0.2  # nats: the largest at any one position
LOSS_GAP_MAX = 0.02  # nats: |mean next-token loss of llama.cpp - the course's|
SELF_TOL = 1e-3  # llama.cpp against itself after a cache operation: float32 sums in another order
COURSE_TOL = 1e-4  # the course's float32 model against itself: rounding
CONTRAST = 10  # a shift matches the course's shift this many times closer (mean KL) than a fresh prefill


# -- the pure parts: agreement of two sets of logits, the positions of each operation ---------------

def kl_rows(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(other)) of each row of logits [T, V] -> [T], in nats (float64)."""
    log_p, log_q = F.log_softmax(ref.double(), -1), F.log_softmax(other.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def agreement(ref: torch.Tensor, other: torch.Tensor, targets: torch.Tensor | None = None) -> dict:
    """How logits `other` [T, V] agree with `ref` [T, V]: the share of rows with the same argmax, the mean
    and largest KL(ref || other) (nats), the largest |logit difference|, and with the next token ids
    `targets` [T] the mean next-token loss of each (nats)."""
    if not (isinstance(ref, torch.Tensor) and ref.dim() == 2 and ref.shape[0] > 0):
        fail("ref", "logits [T, V] with T > 0", getattr(ref, "shape", type(ref)))
    if not (isinstance(other, torch.Tensor) and other.shape == ref.shape):
        fail("other", f"logits of ref's shape {tuple(ref.shape)}", tuple(getattr(other, "shape", ())))
    if targets is not None and tuple(targets.shape) != (ref.shape[0],):
        fail("targets", f"[{ref.shape[0]}] token ids, one per row", tuple(targets.shape))
    kl = kl_rows(ref, other)
    out = {"positions": ref.shape[0], "top1": (ref.argmax(-1) == other.argmax(-1)).double().mean().item(),
           "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
           "max_abs_diff": (ref.double() - other.double()).abs().max().item()}
    if targets is not None:
        out["loss_course"] = F.cross_entropy(ref.double(), targets).item()
        out["loss_llamacpp"] = F.cross_entropy(other.double(), targets).item()
    return out


def rollback_plan(n_tokens: int, n_rollback: int) -> dict:
    """A sequence holding positions 0 .. n_tokens - 1 loses its last `n_rollback` (`seq_rm` of [p0, p1)),
    then takes the same tokens again at the same positions; the fork decodes at the next position."""
    if not (is_int(n_tokens) and n_tokens >= 2):
        fail("n_tokens", "an int >= 2", repr(n_tokens))
    if not (is_int(n_rollback) and 0 < n_rollback < n_tokens):
        fail("n_rollback", f"an int with 0 < n_rollback < n_tokens = {n_tokens}", repr(n_rollback))
    start = n_tokens - n_rollback
    return {"seq_rm": [start, n_tokens], "again": list(range(start, n_tokens)), "pos_max_after_rm": start - 1,
            "fork_position": n_tokens}


def shift_plan(length: int, n_discard: int, n_keep: int, n_next: int) -> dict:
    """The context shift of a sequence holding positions 0 .. length - 1: `seq_rm` of [n_keep, n_keep +
    n_discard), `seq_add` of -n_discard to [n_keep + n_discard, length), the next `n_next` tokens after.
    `kept`: the original positions that stay, in order (what a fresh prefill would read)."""
    if not (is_int(length) and length >= 2):
        fail("length", "an int >= 2", repr(length))
    if not (is_int(n_keep) and 0 <= n_keep < length):
        fail("n_keep", f"an int with 0 <= n_keep < length {length}", repr(n_keep))
    if not (is_int(n_discard) and 0 < n_discard < length - n_keep):
        fail("n_discard", f"an int with 0 < n_discard < length {length} - n_keep {n_keep}", repr(n_discard))
    if not (is_int(n_next) and n_next > 0):
        fail("n_next", "a positive int", repr(n_next))
    rest, left = n_keep + n_discard, length - n_discard
    return {"seq_rm": [n_keep, rest], "seq_add": [rest, length, -n_discard],
            "kept": list(range(n_keep)) + list(range(rest, length)), "next": list(range(left, left + n_next)),
            "pos_range_after": [0, left - 1]}


def ids_needed(params: dict) -> int:
    """How many token ids of the text the measurements read (the prefill, its targets, the fork's token)."""
    return max(params["n_tokens"] + 1, params["shift_len"] + params["n_next"] + 1)


# -- llama.cpp, through the binding's ctypes layer ------------------------------------------------

def load_binding(site: str | Path | None = None) -> types.ModuleType:
    """llama-cpp-python's ctypes layer `llama_cpp.llama_cpp`, from the folder `site` if given, else the
    installed package. The package's own __init__ is skipped: it imports the high-level API, whose
    dependencies (diskcache, jinja2) the course does not install."""
    if site is not None:
        if not Path(site).is_dir():
            fail("site", "a folder llama-cpp-python was installed into", site, ModuleNotFoundError)
        sys.path.insert(0, str(site))
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        fail("llama_cpp", "llama-cpp-python installed, or a folder given with --site", "none", ModuleNotFoundError)
    if "llama_cpp" not in sys.modules:
        package = types.ModuleType("llama_cpp")
        package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules["llama_cpp"] = package
    return importlib.import_module("llama_cpp.llama_cpp")


LOG: list[str] = []  # llama.cpp's messages, kept instead of printed
_LOGGER = []  # the one callback handed to llama.cpp, referenced for as long as the process lives


def quiet(binding: types.ModuleType) -> list[str]:
    """Send llama.cpp's log (global, printed to stderr by default) to `LOG`, once; returns `LOG`."""
    if not _LOGGER:
        _LOGGER.append(binding.llama_log_callback(lambda level, text, data: LOG.append((text or b"").decode(
            errors="replace"))))
        binding.llama_log_set(_LOGGER[0], ctypes.c_void_p(0))
        binding.llama_backend_init()
    return LOG


class LlamaCpp:
    """One llama.cpp context on a GGUF file: batches decoded with every logit kept, and the memory's
    sequence operations. `n_ctx_seq` cells for each of `n_seqs` sequences; a prefill is one batch;
    `flash_attn`: llama.cpp's flash_attn_type, else its default."""

    def __init__(self, binding: types.ModuleType, path: Path, n_ctx_seq: int, n_seqs: int, threads: int,
                 flash_attn: int | None = None) -> None:
        lib = self.lib = binding
        start = len(quiet(lib))
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self.model:
            fail("path", "a GGUF file llama.cpp loads", path, RuntimeError)
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx_seq * n_seqs, n_seqs
        params.n_batch = params.n_ubatch = n_ctx_seq
        params.n_threads = params.n_threads_batch = threads
        if flash_attn is not None:  # -1 (the default): on where the back end has it; 0: off; 1: on
            params.flash_attn_type = flash_attn
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            fail("context", "a llama.cpp context", "none", RuntimeError)
        self.mem, self.vocab = lib.llama_get_memory(self.ctx), lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        names = ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads", "flash_attn_type", "type_k", "type_v",
                 "kv_unified")
        self.settings = {name: getattr(params, name) for name in names}
        # What flash_attn_type -1 became: the graph reserved at creation uses llama.cpp's fused attention or not.
        self.settings["flash_attention_in_graph"] = any("FLASH_ATTN_EXT" in line for line in LOG[start:])

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's token ids of `text`, no special tokens added or parsed."""
        data = text.encode()
        buf = (self.lib.llama_token * (len(data) + 8))()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, False)
        if n < 0:
            fail("text", f"at most {len(buf)} tokens", -n, RuntimeError)
        return list(buf[:n])

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int]) -> torch.Tensor:
        """Logits [T, V] of one batch: token i at positions[i] of sequence seqs[i], every logit kept."""
        lib, t = self.lib, len(tokens)
        batch = lib.llama_batch_init(t, 0, 1)
        try:
            for i, (token, pos, seq) in enumerate(zip(tokens, positions, seqs, strict=True)):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, 1
                batch.seq_id[i][0] = seq
            batch.n_tokens = t
            rc = lib.llama_decode(self.ctx, batch)
            if rc != 0:
                fail("llama_decode", "0 (success)", rc, RuntimeError)
            rows = [np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i), (self.n_vocab,)) for i in range(t)]
            return torch.from_numpy(np.stack(rows))  # a copy: the context reuses its buffer
        finally:
            lib.llama_batch_free(batch)

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        return bool(self.lib.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        self.lib.llama_memory_seq_add(self.mem, seq, p0, p1, delta)

    def pos_range(self, seq: int) -> list[int]:
        """[smallest, largest] position sequence `seq` holds ([-1, -1]: none)."""
        return [self.lib.llama_memory_seq_pos_min(self.mem, seq), self.lib.llama_memory_seq_pos_max(self.mem, seq)]

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


# -- the measurements: llama.cpp and the course on the same ids -----------------------------------

def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure_logits(lc: LlamaCpp, model, ids: list[int], n: int) -> dict:
    """One prefill of ids[:n] in each, timed, and how their logits agree (targets: ids[1 : n + 1])."""
    lc.clear()
    ours, course_s = _timed(lambda: model(torch.tensor([ids[:n]]))[0])
    theirs, llamacpp_s = _timed(lambda: lc.decode(ids[:n], list(range(n)), [0] * n))
    return {"agreement": agreement(ours, theirs, torch.tensor(ids[1 : n + 1])), "llamacpp": theirs, "course": ours,
            "seconds": {"course": course_s, "llamacpp": llamacpp_s}}


def measure_split(lc: LlamaCpp, ids: list[int], plan: dict) -> torch.Tensor:
    """llama.cpp's logits [r, V] of the rolled-back tokens evaluated the first time in two batches, the
    positions before them and then them: what re-evaluating them after `seq_rm` must reproduce."""
    p0, p1 = plan["seq_rm"]
    lc.clear()
    lc.decode(ids[:p0], list(range(p0)), [0] * p0)
    return lc.decode(ids[p0:p1], list(range(p0, p1)), [0] * (p1 - p0))


def measure_rollback(lc: LlamaCpp, model, ids: list[int], prefill: dict, split: torch.Tensor, plan: dict):
    """After the prefill, `seq_rm` of the last positions, then the same tokens again: llama.cpp against
    the same tokens batched the same way the first time (`split`), the batching's own effect (`split`
    against the prefill's rows), and the course's CellsCache rolled back (held to its own full pass).
    Returns the measurements and the cells cache, whose sequence 0 then holds what llama.cpp's does."""
    p0, p1 = plan["seq_rm"]
    removed = lc.seq_rm(0, p0, p1)
    pos_max = lc.pos_range(0)[1]
    again = plan["again"]
    theirs = lc.decode([ids[p] for p in again], again, [0] * len(again))
    cells = CellsCache(model.cfg.n_layers, plan["fork_position"] + 8, n_seqs=2, default_seq=0)
    model(torch.tensor([ids[:p1]]), cells)
    cells.rollback(p1 - p0)
    ours = model(torch.tensor([[ids[p] for p in again]]), cells)[0]
    targets = torch.tensor(ids[p0 + 1 : p1 + 1])
    return {"positions": {"removed": removed, "pos_max_after_rm": pos_max},
            "self_max_abs_diff": (theirs - split).abs().max().item(),
            "batching": agreement(prefill["llamacpp"][p0:p1], split),
            "course_max_abs_diff": (ours - prefill["course"][p0:p1]).abs().max().item(),
            "agreement": agreement(ours, theirs, targets),
            "prefill_agreement": agreement(prefill["course"][p0:p1], prefill["llamacpp"][p0:p1], targets)}, cells


def measure_fork(lc: LlamaCpp, model, cells: CellsCache, ids: list[int], position: int) -> dict:
    """`seq_cp` of sequence 0 to 1, then the token at `position` decoded on both in one batch, in each."""
    token = ids[position]
    lc.seq_cp(0, 1)
    theirs = lc.decode([token, token], [position, position], [0, 1])
    cells.seq_cp(0, 1)
    cells.plan([0, 1])
    ours = model(torch.tensor([[token, token]]), cells)[0]
    return {"self_max_abs_diff": (theirs[0] - theirs[1]).abs().max().item(),
            "course_max_abs_diff": (ours[0] - ours[1]).abs().max().item(), "agreement": agreement(ours, theirs)}


def measure_shift(lc: LlamaCpp, model, ids: list[int], pairs: list, plan: dict) -> dict:
    """The context shift of `plan` in llama.cpp (seq_rm, seq_add, then the next tokens) against the
    course's `context_shift` of the prefill's `pairs`, and both against a fresh prefill of the kept text."""
    (p0, p1), (_, length, delta), nxt = plan["seq_rm"], plan["seq_add"], plan["next"]
    new, targets = ids[length : length + len(nxt)], torch.tensor(ids[length + 1 : length + len(nxt) + 1])
    lc.clear()
    lc.decode(ids[:length], list(range(length)), [0] * length)
    removed = lc.seq_rm(0, p0, p1)
    lc.seq_add(0, p1, length, delta)
    pos_range = lc.pos_range(0)
    theirs = lc.decode(new, nxt, [0] * len(nxt))
    shifted = context_shift(pairs, -delta, model.cfg.rope_base, n_keep=p0)
    ours = model(torch.tensor([new]), shifted, return_cache=True)[0][0]
    fresh = model(torch.tensor([[ids[p] for p in plan["kept"]] + new]))[0, -len(nxt) :]
    return {"positions": {"removed": removed, "pos_range_after": pos_range},
            "agreement": agreement(ours, theirs, targets), "vs_recomputed": agreement(fresh, theirs, targets),
            "course_vs_recomputed": agreement(fresh, ours)}  # both the course's: no llama.cpp loss to name


def compare_ids(tok, lc: LlamaCpp, text: str, need: int) -> tuple[list[int], dict]:
    """The course tokenizer's first `need` ids of `text`, and how llama.cpp's tokenizer compares on it."""
    ours, theirs = tok.encode(text), lc.tokenize(text)
    if len(ours) < need:
        fail("module", f"a documentation of at least {need} tokens", len(ours))
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b]
    differ += [min(len(ours), len(theirs))] if len(ours) != len(theirs) else []  # one is longer
    return ours[:need], {"compared": need, "same_ids": theirs[:need] == ours[:need], "text_tokens": len(ours),
                         "text_same_ids": ours == theirs, "first_difference": differ[0] if differ else None}


def measure_no_flash(binding: types.ModuleType, path: Path, ids: list[int], prefill: dict, threads: int) -> dict:
    """The prefill again in a context with llama.cpp's flash attention off, against the course's logits."""
    n = prefill["course"].shape[0]
    lc = LlamaCpp(binding, path, n_ctx_seq=256 * -(-(n + 8) // 256), n_seqs=1, threads=threads, flash_attn=0)
    try:
        theirs = lc.decode(ids[:n], list(range(n)), [0] * n)
        return {"agreement": agreement(prefill["course"], theirs, torch.tensor(ids[1 : n + 1])),
                "flash_attention_in_graph": lc.settings["flash_attention_in_graph"]}
    finally:
        lc.close()


def measure(binding: types.ModuleType, params: dict, threads: int) -> dict:
    """Every measurement of the record, on the course's real model and llama.cpp's, same ids."""
    torch.set_grad_enabled(False)
    model, tok = load_smollm2(dtype={"float32": torch.float32, "float64": torch.float64}[params["dtype"]], device="cpu")
    path, _ = package_file()
    n, plan = params["n_tokens"], rollback_plan(params["n_tokens"], params["n_rollback"])
    lc = LlamaCpp(binding, path, n_ctx_seq=256 * -(-(n + 8) // 256), n_seqs=2, threads=threads)
    try:
        ids, tokens = compare_ids(tok, lc, stdlib_text([params["module"]]), ids_needed(params))
        split = measure_split(lc, ids, plan)
        prefill = measure_logits(lc, model, ids, n)
        rollback, cells = measure_rollback(lc, model, ids, prefill, split, plan)
        fork = measure_fork(lc, model, cells, ids, plan["fork_position"])
        length = params["shift_len"]
        _, pairs = model(torch.tensor([ids[:length]]), None, return_cache=True)
        shift = {f"n_keep{k}": measure_shift(lc, model, ids, pairs,
                                             shift_plan(length, params["n_discard"], k, params["n_next"]))
                 for k in params["keeps"]}
        settings = lc.settings
    finally:
        lc.close()
    return {"version": importlib.metadata.version("llama-cpp-python"), "tokens": tokens,
            "system_info": binding.llama_print_system_info().decode().strip(), "settings": settings,
            "logits": prefill["agreement"], "seconds": prefill["seconds"], "rollback": rollback, "fork": fork,
            "shift": shift, "no_flash": measure_no_flash(binding, path, ids, prefill, threads)}


# -- the record ------------------------------------------------------------------------------------

# llama.cpp's kernels round by the CPU's instruction set: another machine moves a top-1 decision or
# two and the digits of the KL divergences, not the claims.
AGREEMENT_RULE = close(abs_tol=0.02, rel_tol=0.5)


def record(measured: dict, params: dict = PARAMETERS) -> QAResult:
    """The result document of `measure`'s dict: values with their rules, checks with their bounds."""
    qa = QAResult("llamacpp_compare", params, machine_dependent=True)
    qa.value("version", measured["version"], exact())
    qa.value("tokens", measured["tokens"], exact())
    qa.value("logits", measured["logits"], AGREEMENT_RULE)
    qa.value("logits_flash_attention_off", measured["no_flash"]["agreement"], AGREEMENT_RULE)
    qa.value("flash_attention_in_graph", {"default": measured["settings"]["flash_attention_in_graph"],
                                          "off": measured["no_flash"]["flash_attention_in_graph"]}, exact())
    qa.value("prefill_seconds", measured["seconds"], recorded("timings of this machine"))
    qa.value("system_info", measured["system_info"], recorded("the instruction sets llama.cpp was built for"))
    qa.value("settings", measured["settings"], recorded("llama.cpp's context settings; threads: this machine's"))
    rollback, fork, shift = measured["rollback"], measured["fork"], measured["shift"]
    qa.value("rollback_positions", rollback["positions"], exact())
    qa.value("rollback_self_max_abs_diff", rollback["self_max_abs_diff"], rounding_rule(SELF_TOL))
    qa.value("rollback_course_max_abs_diff", rollback["course_max_abs_diff"], rounding_rule(COURSE_TOL))
    qa.value("rollback_batching", rollback["batching"], AGREEMENT_RULE)
    qa.value("rollback_agreement", rollback["agreement"], AGREEMENT_RULE)
    qa.value("rollback_prefill_agreement", rollback["prefill_agreement"], AGREEMENT_RULE)
    qa.value("fork_self_max_abs_diff", fork["self_max_abs_diff"], rounding_rule(SELF_TOL))
    qa.value("fork_course_max_abs_diff", fork["course_max_abs_diff"], rounding_rule(COURSE_TOL))
    qa.value("fork_agreement", fork["agreement"], AGREEMENT_RULE)
    qa.value("shift_positions", {k: s["positions"] for k, s in shift.items()}, exact())
    qa.value("shift_agreement", {k: s["agreement"] for k, s in shift.items()}, AGREEMENT_RULE)
    qa.value("shift_vs_recomputed", {k: s["vs_recomputed"] for k, s in shift.items()}, AGREEMENT_RULE)
    qa.value("course_shift_vs_recomputed", {k: s["course_vs_recomputed"] for k, s in shift.items()},
             close(abs_tol=1e-4, rel_tol=1e-3))  # the course's float32 model against itself
    _checks(qa, measured, params)
    return qa


def _agreement_checks(qa: QAResult, name: str, what: str, agree: dict, top1: bool = True) -> None:
    if top1:
        qa.check(f"{name}/top1", f"{what}: the same most likely next token at >= {TOP1_MIN:.0%} of positions",
                 agree["top1"], TOP1_MIN, ">=")
    qa.check(f"{name}/kl_mean", f"{what}: mean KL(course || llama.cpp) of the next-token distributions",
             agree["kl_mean"], KL_MEAN_MAX, "<=")
    qa.check(f"{name}/kl_max", f"{what}: the largest KL at any position", agree["kl_max"], KL_MAX_MAX, "<=")


def _checks(qa: QAResult, m: dict, params: dict) -> None:
    qa.check("llamacpp/compare/version", f"llama.cpp through llama-cpp-python {VERSION}, the version the build "
             "record built", m["version"] == VERSION, True, "==")
    qa.check("llamacpp/compare/same_ids", "llama.cpp's tokenizer gives the course tokenizer's ids for the text",
             m["tokens"]["same_ids"], True, "==")
    _agreement_checks(qa, "llamacpp/compare/logits", "a prefill of the same ids", m["logits"])
    qa.check("llamacpp/compare/logits/loss_gap", "the same mean next-token loss, in nats",
             abs(m["logits"]["loss_llamacpp"] - m["logits"]["loss_course"]), LOSS_GAP_MAX, "<=")
    _agreement_checks(qa, "llamacpp/compare/logits_flash_attention_off", "the prefill with flash attention off",
                      m["no_flash"]["agreement"])
    plan = rollback_plan(params["n_tokens"], params["n_rollback"])
    rb = m["rollback"]
    qa.check("llamacpp/compare/rollback/positions", "seq_rm of the last positions leaves the positions before them",
             [rb["positions"]["removed"], rb["positions"]["pos_max_after_rm"]], [True, plan["pos_max_after_rm"]], "==")
    qa.check("llamacpp/compare/rollback/self", "re-evaluated after seq_rm, llama.cpp gives the logits of the same "
             "tokens batched the same way the first time", rb["self_max_abs_diff"], SELF_TOL, "<=")
    qa.check("llamacpp/compare/rollback/batching_kl_mean", "batched differently (one prefill, or the positions "
             "before them and then them), llama.cpp's logits agree as two computations do, not to rounding",
             rb["batching"]["kl_mean"], KL_MEAN_MAX, "<=")
    qa.check("llamacpp/compare/rollback/course", "the course's CellsCache rolled back gives its full pass's logits",
             rb["course_max_abs_diff"], COURSE_TOL, "<=")
    _agreement_checks(qa, "llamacpp/compare/rollback", "re-evaluated after a rollback", rb["agreement"], top1=False)
    fork = m["fork"]
    qa.check("llamacpp/compare/fork/self", "after seq_cp, one token gives the same logits on both sequences",
             fork["self_max_abs_diff"], SELF_TOL, "<=")
    qa.check("llamacpp/compare/fork/course", "the course's CellsCache after seq_cp: the same on both sequences",
             fork["course_max_abs_diff"], COURSE_TOL, "<=")
    _agreement_checks(qa, "llamacpp/compare/fork", "one token after seq_cp", fork["agreement"], top1=False)
    for key, s in m["shift"].items():
        k = int(key.removeprefix("n_keep"))
        plan = shift_plan(params["shift_len"], params["n_discard"], k, params["n_next"])
        name = f"llamacpp/compare/shift/{key}"
        qa.check(f"{name}/positions", "seq_rm then seq_add leave the positions 0 .. S - n_discard - 1",
                 [s["positions"]["removed"], s["positions"]["pos_range_after"]], [True, plan["pos_range_after"]], "==")
        _agreement_checks(qa, name, f"after the context shift with n_keep = {k}", s["agreement"], top1=False)
        ratio = s["vs_recomputed"]["kl_mean"] / max(s["agreement"]["kl_mean"], 1e-300)
        qa.check(f"{name}/is_the_shift", "llama.cpp's shift is the course's K-shift, not a fresh prefill: its mean "
                 f"KL to the course's shift is at least {CONTRAST} times smaller", ratio, CONTRAST, ">=")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labcode.engines.llamacpp_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="result file, e.g. qa/results/llamacpp_compare.json")
    parser.add_argument("--site", metavar="DIR", default=None,
                        help="a folder llama-cpp-python was installed into (default: the installed llama_cpp)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser.add_argument("--threads", type=int, default=cores,
                        help="llama.cpp's threads (default: the cores this process may use, %(default)s)")
    args = parser.parse_args(argv)
    try:
        binding = load_binding(args.site)
    except ModuleNotFoundError as e:
        print(e)
        return 2
    qa, seconds = _timed(lambda: record(measure(binding, PARAMETERS, args.threads)))
    print(qa.report())
    print(f"measured in {seconds:.0f} s")
    return write_record(qa, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
