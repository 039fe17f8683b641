"""Synthetic checkpoints in the official DeepSeek-V4-Flash release format.

`synth_checkpoint(out, "demo", seed=0)` writes config.json, model-XXXXX-of-YYYYY.safetensors
shards (each at most `shard_bytes`), model.safetensors.index.json, prompts.json and the
tokenizer files (tokenizer.json, tokenizer_config.json, generation_config.json: a byte-level BPE
trained on a short text kept in the repo, its vocabulary the model's, DeepSeek's special tokens at
ids 0..5; see ds4f.engine.text.synthetic), with the official tensor names and dtypes:

    layers.N.ffn.experts.E.w{1,3,2}.weight   I8       two E2M1 codes per byte
    layers.N.ffn.experts.E.w{1,3,2}.scale    F8_E8M0  one per 32 along K
    layers.N.ffn.shared_experts.w*.weight    F8_E4M3  + .scale F8_E8M0 per 128x128 tile
    layers.N.ffn.gate.weight                 BF16 [n_experts, hidden]
    layers.N.ffn.gate.bias (N >= hash)       F32  [n_experts]
    layers.N.ffn.gate.tid2eid (N < hash)     I64  [vocab, top_k]
    layers.N.{attn,ffn}_norm.weight, norm.weight, embed.weight, head.weight   BF16
    with attention (every named geometry; tensors.attention_layer_tensors lists them):
    layers.N.attn.{wq_a,wq_b,wkv,wo_a,wo_b}  F8_E4M3 + .scale F8_E8M0 per 128x128 tile
    layers.N.attn.{q_norm,kv_norm}.weight    BF16;  layers.N.attn.attn_sink  F32 [heads]
    layers.N.hc_{attn,ffn}_{fn,base,scale}   F32;   hc_head_{fn,base,scale}  F32
    CSA / HCA layers: attn.compressor.* (and CSA: attn.indexer.*): wkv, wgate, weights_proj
    BF16, ape F32, norms BF16, the indexer's wq_b FP8

Everything is a deterministic function of (geometry, seed); the shard size only changes
how tensors are grouped into files. The shards are written by the `safetensors` library
(its low-level `serialize_file`, which takes every dtype above by name).

What makes it realistic rather than noise
- Magnitudes: MXFP4 codes follow the histogram of Gaussian weights quantized with the OCP
  rule, and E8M0 scales are chosen so decoded weights have std ~ 1/sqrt(K); the shared
  expert is Gaussian with std 1/sqrt(K) quantized to E4M3 per 128x128 tile; norms ~ 1;
  embeddings std ~ 1.
- Routing: tokens belong to "topics": an embedding is a topic centre plus a token part.
  Each layer's router row for an expert is a mix of the centres of the topics that favour
  it, plus noise; each topic favours a handful of experts drawn from a Zipf popularity, and
  the bias makes a few experts hot everywhere. So a layer's expert use is skewed (a few hot
  experts, a long tail) and tokens of one topic reuse the same experts.
- Greedy continuation (the first engine has no attention, so the next token is
  argmax head . norm(h(token))): head row sigma(t) is t's embedding, where sigma is one long
  cycle through the vocabulary that stays in a topic for several steps at a time.
- The hash layers' tid2eid sends most of a topic's tokens to a window of experts; the
  windows tile all experts, so every expert is used.
- Attention and hyper-connections (drawn from an RNG stream of their own per tensor, so the
  MoE tensors' bytes are the same as before they existed): linears Gaussian with std
  1/sqrt(fan_in) (FP8 ones quantized with quantize_fp8, per 128x128 tile), norms ~ 1, sinks
  ~ N(0, 1), compressor position biases (ape) small; hc fn with std 1/sqrt(N D), so each mix
  logit is ~ N(0, 1), scales in [0.5, 1], the pre / post biases ~ N(0, 0.5) and the comb bias
  favouring the diagonal (each stream keeps mostly itself), so that a forward stays finite
  and the streams stay distinct. Attention is not designed: the routing and the greedy cycle
  above were measured on the MoE alone. Through the whole model (a float64 decoder of
  transformers' semantics) the demo geometry's greedy continuation still walks the cycle
  (12 tokens: logits finite, |logit| up to ~60, top-2 gap ~23); tiny's does not.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from pathlib import Path

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.units import format_bytes
from ds4f.engine.checkpoint.formats import BF16, E2M1_VALUES, E8M0, ST_DTYPES, quantize_fp8
from ds4f.engine.checkpoint.tensors import MTP_PREFIX, TensorPlan, attention_tensors, mtp_tensors, official_tensors
from ds4f.engine.model.geometry import MX_BLOCK, Geometry, get_geometry
from ds4f.engine.checkpoint.progress import Progress, ProgressArg
from ds4f.engine.text.synthetic import MIN_VOCAB, write_tokenizer_files

DEFAULT_SHARD_BYTES = 512 * 1024 * 1024
PROMPTS_NAME = "prompts.json"
SYNTH_VERSION = 1

# Routing design knobs (tuned with tests/test_synth_routing.py's measurements).
TOPIC_SHARE = 0.5  # fraction of an embedding's variance that is its topic centre
ZIPF_S = 0.6  # expert popularity ~ rank^-s
FAVOURITE_EXTRA = 6  # a topic favours top_k + this many experts
FAVOURITE_LOGIT = 3.0  # router logit of a topic's favourite experts
ROUTER_NOISE = 1.3  # std of the token-specific part of the router logits
HOT_BIAS = 0.3  # score bias of the globally hot experts
BIAS_SPREAD = 0.15  # score bias ~ this x log(popularity / mean)
HASH_IN_TOPIC = 0.75  # share of a hash-layer token's experts taken from its topic's window


# ---- MXFP4 statistics of Gaussian weights ----------------------------------------------
_E2M1_MAGS = E2M1_VALUES[:8].astype(np.float64)  # the non-negative codes 0..7


def _mxfp4_luts(k: int) -> tuple[np.ndarray, np.ndarray]:
    """(byte LUT over uint16 randoms, scale-byte LUT over uint8 randoms) for weights of std 1/sqrt(k).

    Measured from Gaussian blocks quantized with the OCP rule (shared exponent
    floor(log2(amax)) - 2, round to nearest E2M1), then turned into sampling tables.
    """
    rng = np.random.default_rng(12345)
    sigma = 1.0 / math.sqrt(k)
    x = rng.standard_normal((16384, MX_BLOCK)) * sigma
    amax = np.abs(x).max(axis=1)
    e = np.floor(np.log2(amax)) - 2
    y = np.abs(x) / np.exp2(e)[:, None]
    mag = np.abs(y[..., None] - _E2M1_MAGS).argmin(axis=-1)
    hist = np.bincount(mag.ravel(), minlength=8) / mag.size
    # nibble LUT over 256 equally likely byte values: magnitude by hist, sign 50/50
    counts = np.floor(hist * 128).astype(int)
    counts[np.argmax(hist)] += 128 - counts.sum()
    mags = np.repeat(np.arange(8), counts)  # 128 entries
    nib = np.concatenate([mags, mags + 8]).astype(np.uint8)  # 256 entries
    r = np.arange(65536)
    byte_lut = (nib[r & 0xFF] | (nib[r >> 8] << 4)).astype(np.uint8)
    exps, ecounts = np.unique(e.astype(int), return_counts=True)
    ecounts = np.floor(ecounts / ecounts.sum() * 256).astype(int)
    ecounts[np.argmax(ecounts)] += 256 - ecounts.sum()
    scale_lut = np.clip(np.repeat(exps + 127, ecounts), 1, 254).astype(np.uint8)
    return byte_lut, scale_lut


class _ExpertSource:
    """Fast generator of one expert's six tensors (uint8 bytes), deterministic per (seed, layer, expert)."""

    def __init__(self, g: Geometry, seed: int):
        self.g = g
        self.seed = seed
        self.luts = {k: _mxfp4_luts(k) for k in {g.hidden, g.inter}}

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        g = self.g
        bitgen = np.random.SFC64(np.random.SeedSequence([self.seed, 1, layer, expert]))
        out = {}
        for part, shape in g.expert_parts().items():
            w, kind = part.split(".")
            k = g.hidden if w in ("w1", "w3") else g.inter
            byte_lut, scale_lut = self.luts[k]
            n = math.prod(shape)
            if kind == "weight":
                raw = bitgen.random_raw(-(-n // 4)).view(np.uint16)[:n]
                out[part] = byte_lut[raw].view(np.int8).reshape(shape)
            else:
                raw = bitgen.random_raw(-(-n // 8)).view(np.uint8)[:n]
                out[part] = scale_lut[raw].view(E8M0).reshape(shape)
        return out


# ---- the routing design: topics, embeddings, routers, head ------------------------------
class Design:
    """Everything about the synthetic model that is not an expert: deterministic from the seed."""

    def __init__(self, g: Geometry, seed: int):
        self.g = g
        self.seed = seed
        rng = np.random.default_rng(np.random.SeedSequence([seed, 2]))
        V, H = g.vocab, g.hidden
        special = {g.bos_token_id, g.eos_token_id}
        ordinary = np.array([t for t in range(V) if t not in special], dtype=np.int64)
        if len(ordinary) == 0:
            raise Ds4fError(f"geometry: vocab_size = {V}: synth needs at least one token besides bos and eos")
        self.n_topics = T = int(min(np.clip(round(math.sqrt(V) / 2), 2, 64), len(ordinary)))
        topic = np.full(V, -1, dtype=np.int64)
        topic[rng.permutation(ordinary)] = np.arange(len(ordinary)) % T
        self.topic = topic  # -1 for bos/eos
        self.centres = rng.standard_normal((T, H), dtype=np.float32)
        emb = rng.standard_normal((V, H), dtype=np.float32)
        a, b = math.sqrt(TOPIC_SHARE), math.sqrt(1 - TOPIC_SHARE)
        has = topic >= 0
        emb[has] = a * self.centres[topic[has]] + b * emb[has]
        self.embed = emb.astype(BF16)
        del emb
        self.cycle = self._long_cycle(rng, ordinary, topic)
        self.rng_layers = [np.random.default_rng(np.random.SeedSequence([seed, 3, layer]))
                           for layer in range(g.n_layers)]
        self._layers: dict[int, dict[str, np.ndarray]] = {}

    def _long_cycle(self, rng, ordinary: np.ndarray, topic: np.ndarray) -> np.ndarray:
        """One cycle through every ordinary token, staying 4-12 steps in a topic at a time."""
        T = self.n_topics
        queues = [list(rng.permutation(ordinary[topic[ordinary] == t])) for t in range(T)]
        order: list[int] = []
        cur = -1
        while any(queues):
            live = [t for t in range(T) if queues[t] and t != cur] or [t for t in range(T) if queues[t]]
            cur = int(rng.choice(live))
            run = int(rng.integers(4, 13))
            order += [int(x) for x in queues[cur][:run]]
            del queues[cur][:run]
        return np.array(order, dtype=np.int64)

    # head row sigma(t) = embedding of t (scaled), so greedy argmax walks the cycle
    def head(self) -> np.ndarray:
        g = self.g
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 4]))
        head = rng.standard_normal((g.vocab, g.hidden), dtype=np.float32) * np.float32(0.3)
        nxt = np.roll(self.cycle, -1)
        head[nxt] = self.embed[self.cycle].astype(np.float32)
        head *= np.float32(2.0 / math.sqrt(g.hidden))
        return head.astype(BF16)

    def norm(self, key: int) -> np.ndarray:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 5, key]))
        return (1.0 + 0.02 * rng.standard_normal(self.g.hidden, dtype=np.float32)).astype(BF16)

    def layer(self, layer: int) -> dict[str, np.ndarray]:
        """gate.weight (bf16), gate.bias (f32) or gate.tid2eid (i64) of one layer."""
        if layer in self._layers:
            return self._layers[layer]
        g, T = self.g, self.n_topics
        n, H, k = g.n_experts, g.hidden, g.top_k
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 3, layer]))
        rank = rng.permutation(n)  # rank[e]: popularity rank of expert e
        pop = (rank + 1.0) ** -ZIPF_S
        pop /= pop.sum()
        # each topic favours top_k + FAVOURITE_EXTRA experts, drawn by popularity
        m = min(n, k + FAVOURITE_EXTRA)
        P = np.zeros((T, n), dtype=np.float32)
        for t in range(T):
            fav = rng.choice(n, size=m, replace=False, p=pop)
            P[t, fav] = FAVOURITE_LOGIT * np.linspace(1.0, 0.7, m, dtype=np.float32)
        # router rows: topic directions + noise; x = rmsnorm(h) ~ embedding, |x|^2 ~ H
        a = math.sqrt(TOPIC_SHARE)
        W = (P.T @ self.centres) / np.float32(a * H)
        W += rng.standard_normal((n, H), dtype=np.float32) * np.float32(ROUTER_NOISE / math.sqrt(H))
        out = {"gate.weight": W.astype(BF16)}
        if g.is_hash_layer(layer):
            out["gate.tid2eid"] = self._tid2eid(rng)
        else:
            bias = BIAS_SPREAD * np.log(pop * n)
            n_hot = max(1, n // 16)
            bias[np.argsort(rank)[:n_hot]] += HOT_BIAS
            out["gate.bias"] = bias.astype(np.float32)
        self._layers = {layer: out}  # keep one layer (the demo's are 0.5 MB, bench's 1 MB)
        return out

    def _tid2eid(self, rng) -> np.ndarray:
        """[vocab, top_k] distinct experts per token: mostly from the token's topic window."""
        g, T = self.g, self.n_topics
        n, k, V = g.n_experts, g.top_k, g.vocab
        ring = rng.permutation(n)
        w = min(n, max(k + (k + 1) // 2, -(-n // T)))
        k_in = max(1, round(HASH_IN_TOPIC * k)) if w > k else k
        out = np.empty((V, k), dtype=np.int64)
        topic = np.where(self.topic >= 0, self.topic, rng.integers(0, T, V))
        starts = (topic * n) // T
        # in-window picks: random order of the window's w positions
        keys = rng.random((V, w))
        pos = np.argsort(keys, axis=1)[:, :k_in]
        win = ring[(starts[:, None] + np.arange(w)[None, :]) % n]
        picked = np.take_along_axis(win, pos, axis=1)
        out[:, :k_in] = picked
        if k_in < k:
            keys = rng.random((V, n))
            np.put_along_axis(keys, picked, 2.0, axis=1)  # exclude already picked
            out[:, k_in:] = np.argsort(keys, axis=1)[:, : k - k_in]
        return out

    def prompts(self, count: int = 8) -> list[list[int]]:
        """Sample prompts from a topic Markov chain (stay in a topic with p = 0.85)."""
        g = self.g
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 6]))
        by_topic = [np.flatnonzero(self.topic == t) for t in range(self.n_topics)]
        out = []
        for _ in range(count):
            length = int(rng.integers(8, 33))
            t = int(rng.integers(self.n_topics))
            ids = [g.bos_token_id]
            while len(ids) < length:
                if rng.random() > 0.85:
                    t = int(rng.integers(self.n_topics))
                ids.append(int(rng.choice(by_topic[t])))
            out.append(ids)
        return out


# ---- writing ---------------------------------------------------------------------------------
def _keepalive_spec(arr: np.ndarray, code: str, keep: list):
    from safetensors import TensorSpec

    arr = np.ascontiguousarray(arr)
    keep.append(arr)
    return TensorSpec(dtype=ST_DTYPES[code][1], shape=list(arr.shape), data_ptr=arr.ctypes.data,
                      data_len=arr.nbytes)


def plan_shards(tensors: list[TensorPlan], shard_bytes: int) -> list[list[TensorPlan]]:
    """Group tensors in order into shards of at most shard_bytes (a bigger tensor gets its own).

    An expert's six tensors always share a shard (so an expert is two byte ranges)."""
    groups: list[list[TensorPlan]] = []
    i = 0
    while i < len(tensors):  # keep experts' six tensors together
        t = tensors[i]
        if ".experts." in t.name:
            groups.append(tensors[i:i + 6])
            i += 6
        else:
            groups.append([t])
            i += 1
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for grp in groups:
        n = sum(t.nbytes for t in grp)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(grp)
        size += n
    return shards


def _fresh_dir(out: Path, force: bool, need_bytes: int = 0) -> Path:
    """A temporary sibling directory; the result is renamed to `out` when complete. need_bytes:
    what will be written there, checked against the disk's free room first."""
    out = Path(out)
    if out.exists() and not force:
        if out.is_dir() and not any(out.iterdir()):
            pass
        else:
            raise Ds4fError(f"{out}: already exists (remove it or pass --force)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Ds4fError(f"{out.parent}: cannot create: {exc.strerror or exc}") from None
    _remove_leftovers(out)
    free = shutil.disk_usage(out.parent).free
    if need_bytes > free:
        raise Ds4fError(f"{out}: needs {format_bytes(need_bytes)}, and {out.parent} has {format_bytes(free)} free;"
                        f" nothing was written")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
    except OSError as exc:
        raise Ds4fError(f"{out.parent}: cannot write: {exc.strerror or exc}") from None
    return tmp


def _leftover_pid(path: Path, out: Path) -> int | None:
    """The writer's pid if `path` is one of `out`'s temporary siblings (.NAME.partial-PID, .NAME.old-PID)."""
    for kind in (".partial-", ".old-"):
        prefix = f".{out.name}{kind}"
        if path.name.startswith(prefix) and path.name[len(prefix):].isdigit():
            return int(path.name[len(prefix):])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process
        return True
    return True


def _remove_leftovers(out: Path) -> None:
    """Remove the temporary siblings of `out` that a killed writer left (its pid is gone)."""
    try:
        siblings = list(out.parent.iterdir())
    except OSError:
        return
    for p in siblings:
        pid = _leftover_pid(p, out)
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                p.unlink()
            except OSError:
                pass


def write_error(exc: OSError, tmp: Path, out: Path) -> Ds4fError:
    """An OSError while writing `out` (in its temporary sibling `tmp`), as the error to show: the
    path, the system's reason, and that nothing is left."""
    where = exc.filename or tmp
    return Ds4fError(f"{out}: cannot write {where}: {exc.strerror or exc}; nothing was left behind")


def _commit_dir(tmp: Path, out: Path) -> None:
    """Atomically put the finished directory in place (an old `out` is moved aside, then removed)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def synth_checkpoint(out: Path | str, geometry: Geometry | str, seed: int = 0, progress: ProgressArg = None,
                     *, shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False, mtp: bool = False) -> Path:
    """Write a synthetic checkpoint of `geometry` in the official format to directory `out`;
    mtp: with the release's MTP layer (mtp.0.*, written last: the main tensors are the same
    with or without it)."""
    from safetensors import SafetensorError, serialize_file

    g = get_geometry(geometry) if isinstance(geometry, str) else geometry
    out = Path(out)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise Ds4fError(f"seed must be a non-negative integer, got {seed!r}")
    if shard_bytes < 1:
        raise Ds4fError(f"shard size must be positive, got {shard_bytes}")
    if mtp and g.attention is None:
        raise Ds4fError("an MTP layer needs a geometry with attention")
    tensors = official_tensors(g) + (mtp_tensors(g) if mtp else [])
    shards = plan_shards(tensors, shard_bytes)
    total = sum(t.nbytes for t in tensors)
    tmp = _fresh_dir(out, force, total)
    try:
        design = Design(g, seed)
        experts = _ExpertSource(g, seed)
        weight_map: dict[str, str] = {}
        n_sh = len(shards)
        with Progress(progress, total, "synth") as bar:
            for si, shard in enumerate(shards):
                fname = f"model-{si + 1:05d}-of-{n_sh:05d}.safetensors"
                keep: list = []
                specs = {}
                cur_expert = None
                for t in shard:
                    arr = _generate(t, g, design, experts, cur_expert)
                    if isinstance(arr, dict):  # an expert: six tensors at once
                        cur_expert = arr
                        arr = arr["__this__"]
                    specs[t.name] = _keepalive_spec(arr, t.dtype, keep)
                    weight_map[t.name] = fname
                try:
                    serialize_file(specs, str(tmp / fname), metadata={"format": "pt"})
                except SafetensorError as exc:     # the library's own error for a failed write
                    raise OSError(None, str(exc), str(tmp / fname)) from None
                os.chmod(tmp / fname, 0o644)
                del keep, specs, cur_expert
                bar.advance(sum(t.nbytes for t in shard), f"shard {si + 1}/{n_sh}")
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            cfg = g.to_config()
            if mtp:     # as the release: one MTP layer, its compress_ratios entry 0 (a window only)
                cfg["num_nextn_predict_layers"] = 1
                cfg["compress_ratios"] = cfg["compress_ratios"] + [0]
            cfg["ds4f_synthetic"] = {"version": SYNTH_VERSION, "seed": seed, "n_topics": design.n_topics,
                                     "note": "synthetic weights written by ds4f synth; not a trained model"}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            prompts = {"format": "ds4f-prompts", "version": 1, "seed": seed,
                       "note": "token-id prompts from the synthetic model's topic Markov chain",
                       "prompts": design.prompts()}
            (tmp / PROMPTS_NAME).write_text(json.dumps(prompts) + "\n")
            if g.vocab >= MIN_VOCAB:   # a smaller vocabulary cannot hold the 256 bytes: no tokenizer
                write_tokenizer_files(tmp, g)
        _commit_dir(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(exc, tmp, out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


MTP_SHARD = "model-mtp.safetensors"


def add_mtp_layer(path: Path | str, seed: int = 0) -> Path:
    """Give an official checkpoint that has none a synthetic MTP layer (mtp.0.*, random weights
    as synth writes them), in a shard of its own: the index names it (one is written for a
    single-file checkpoint) and config.json says num_nextn_predict_layers 1 with its
    compress_ratios entry 0. The main tensors are left as they are. Refused where there is one."""
    from safetensors import serialize_file

    from ds4f.engine.checkpoint.safetensors_index import INDEX_NAME, load_official_index, read_json

    root = Path(path)
    cfg = read_json(root / "config.json", "config JSON")
    g = Geometry.from_config(cfg, str(root / "config.json"))
    if g.attention is None:
        raise Ds4fError(f"{root}: an MTP layer needs a geometry with attention")
    tensors, files = load_official_index(root)
    if any(n.startswith("mtp.") for n in tensors) or (root / MTP_SHARD).exists():
        raise Ds4fError(f"{root}: has mtp.* tensors already")
    design, experts = Design(g, seed), _ExpertSource(g, seed)
    keep: list = []
    specs, cur = {}, None
    for t in mtp_tensors(g):
        arr = _generate(t, g, design, experts, cur)
        if isinstance(arr, dict):
            cur, arr = arr, arr["__this__"]
        specs[t.name] = _keepalive_spec(arr, t.dtype, keep)
    tmp = root / (MTP_SHARD + ".tmp")
    serialize_file(specs, str(tmp), metadata={"format": "pt"})
    index_path = root / INDEX_NAME
    index = read_json(index_path, "index JSON") if index_path.exists() else \
        {"metadata": {}, "weight_map": {n: tensors[n].file.name for n in tensors}}
    index["weight_map"].update({n: MTP_SHARD for n in specs})
    cfg["num_nextn_predict_layers"] = 1
    ratios = list(cfg.get("compress_ratios") or [])
    cfg["compress_ratios"] = ratios[:g.n_layers] + [0] if ratios else ratios
    os.replace(tmp, root / MTP_SHARD)
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    (root / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return root


def _generate(t: TensorPlan, g: Geometry, design: Design, experts: _ExpertSource, cur):
    name = t.name
    if name == "embed.weight":
        return design.embed
    if name == "head.weight":
        return design.head()
    if name == "norm.weight":
        return design.norm(1 << 30)
    if name.startswith("hc_head_"):
        return _attention(g, design.seed, t)
    parts = name.split(".")
    layer = g.n_layers if name.startswith(MTP_PREFIX) else int(parts[1])   # mtp.0.*: the block after the last
    rest = ".".join(parts[2:])
    if rest in ("enorm.weight", "hnorm.weight", "norm.weight") or rest.split(".")[0] in ("e_proj", "h_proj"):
        return _attention(g, design.seed, t)
    if rest == "attn_norm.weight":
        return design.norm(2 * layer)
    if rest == "ffn_norm.weight":
        return design.norm(2 * layer + 1)
    if rest.startswith("ffn.gate."):
        return design.layer(layer)[rest[len("ffn."):]]
    if rest.startswith("ffn.shared_experts."):
        w, kind = parts[-2], parts[-1]
        return _shared(g, design.seed, layer, w)[kind]
    if rest.startswith("hc_") or rest.startswith("attn."):
        return _attention(g, design.seed, t)
    if rest.startswith("ffn.experts."):
        e = int(parts[4])
        part = f"{parts[5]}.{parts[6]}"
        if cur is None or cur.get("__key__") != (layer, e):
            cur = experts.expert(layer, e)
            cur["__key__"] = (layer, e)
        cur["__this__"] = cur[part]
        return cur
    raise AssertionError(name)


_shared_cache: dict = {}


def _shared(g: Geometry, seed: int, layer: int, w: str) -> dict[str, np.ndarray]:
    key = (g, seed, layer, w)
    if key not in _shared_cache:
        _shared_cache.clear()
        si = g.shared_inter
        shape, k = ((si, g.hidden), g.hidden) if w in ("w1", "w3") else ((g.hidden, si), si)
        rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, 7, layer, zlib.crc32(w.encode())])))
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / math.sqrt(k))
        q, s = quantize_fp8(x)
        _shared_cache[key] = {"weight": q, "scale": s}
    return _shared_cache[key]


# ---- attention and hyper-connections ------------------------------------------------------------
ATTN_STREAM = 8  # SeedSequence key of the attention tensors' streams (1..7: the MoE part's)
APE_STD = 0.1  # compressor position bias (added to gate logits of std ~1)
HC_BASE_STD = 0.5  # pre / post biases of the hyper-connections
HC_COMB_DIAGONAL = 3.0  # comb bias on the diagonal: softmax(3 + noise) keeps most (~85%) of a stream in itself

_attn_cache: dict = {}


def _attn_rng(seed: int, name: str) -> np.random.Generator:
    """The stream of one tensor (FP8: of its weight and scale), from its name: independent of the
    MoE tensors' streams and of the order tensors are written in."""
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, ATTN_STREAM,
                                                                        zlib.crc32(name.encode())])))


def _attention(g: Geometry, seed: int, t: TensorPlan) -> np.ndarray:
    """One attention / hyper-connection tensor (see the module docstring for the magnitudes)."""
    name = t.name
    if t.dtype in ("F8_E4M3", "F8_E8M0"):  # an FP8 linear: weight and tile scales from one draw
        base, kind = name.rsplit(".", 1)
        key = (g, seed, base)
        if key not in _attn_cache:
            _attn_cache.clear()
            shape = t.shape if kind == "weight" else next(p.shape for p in attention_tensors(g) + mtp_tensors(g)
                                                          if p.name == base + ".weight")
            x = _attn_rng(seed, base).standard_normal(shape, dtype=np.float32) * np.float32(1 / math.sqrt(shape[1]))
            q, s = quantize_fp8(x)
            _attn_cache[key] = {"weight": q, "scale": s}
        return _attn_cache[key][kind]
    rng = _attn_rng(seed, name)
    leaf = (name[:-len(".weight")] if name.endswith(".weight") else name).rsplit(".", 1)[-1]
    shape = t.shape
    if t.dtype == "BF16":
        if leaf.endswith("norm"):  # q_norm, kv_norm, a compressor's norm
            x = 1.0 + 0.02 * rng.standard_normal(shape, dtype=np.float32)
        else:  # compressor wkv / wgate, the indexer's weights_proj: [rows, hidden]
            x = rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / math.sqrt(shape[1]))
        return x.astype(BF16)
    if leaf == "attn_sink":
        return rng.standard_normal(shape, dtype=np.float32)
    if leaf == "ape":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(APE_STD)
    if name.endswith("_fn"):  # hc_attn_fn, hc_ffn_fn, hc_head_fn: [rows, N D]
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / math.sqrt(shape[1]))
    if name.endswith("_scale"):  # [3] or [1]
        return rng.uniform(0.5, 1.0, shape).astype(np.float32)
    if name.endswith("_base"):
        n = g.attention.hc_mult
        b = rng.standard_normal(shape, dtype=np.float32) * np.float32(HC_BASE_STD)
        if shape[0] > n:  # a layer's [pre N | post N | comb N x N]: comb favours the diagonal
            b[2 * n:] += (HC_COMB_DIAGONAL * np.eye(n, dtype=np.float32)).reshape(-1)
        return b
    raise AssertionError(name)
