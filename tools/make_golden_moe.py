#!/usr/bin/env python3
"""Golden fixtures for the engine's MoE block, from HF transformers' `deepseek_v4` code.

Run by hand, in a venv with torch and transformers (not a ds4f or CI dependency):

    python3 -m venv /tmp/venv-ref && /tmp/venv-ref/bin/pip install setuptools wheel cffi
    /tmp/venv-ref/bin/pip install torch==2.13.0   # a CPU build of torch
    /tmp/venv-ref/bin/pip install transformers==5.24.0
    /tmp/venv-ref/bin/pip install -e . --no-build-isolation
    /tmp/venv-ref/bin/python tools/make_golden_moe.py   # rewrites tests/fixtures/golden_moe.{npz,json}

What it does
1. Writes the tiny synthetic checkpoint (`ds4f.engine.checkpoint.synth.synth_checkpoint(out, "tiny",
   seed=SYNTH_SEED)`, the official safetensors format) into a temp dir. That call is the
   only ds4f code used: everything after it is independent of ds4f.
2. Reads the shards with its own safetensors header parser and dequantizes every weight it
   needs with ml_dtypes, in float64: routed experts from MXFP4 (E2M1 codes, element 2i in
   the low nibble of byte i, 2i+1 in the high nibble, x E8M0 scale per 32 along K); the
   shared expert from FP8 E4M3 x E8M0 scale per 128x128 tile; router weight, norm weight
   from bf16; gate.bias f32; gate.tid2eid int64.
3. Builds a `DeepseekV4Config` with the tiny geometry and one `DeepseekV4SparseMoeBlock`
   per chosen layer (the hash layer and two learned layers), cast to float64, with the
   weights loaded under transformers' names (gate.weight, gate.e_score_correction_bias or
   gate.tid2eid, experts.gate_up_proj = [w1; w3] per expert, experts.down_proj = w2,
   shared_experts.{gate,up,down}_proj = shared w1, w3, w2).
4. For each chosen layer and each input row (token id, residual h): x = DeepseekV4RMSNorm
   (ffn_norm weight)(h), then the router (ids and weights) and the block (y = routed +
   shared, without the residual). The engine's `moe_block` takes the residual h and does
   the norm itself, so h is what the fixtures store as input.

The shared expert's clamp: the official DeepSeek inference code clamps only the routed
experts' SwiGLU activations (gate <= swiglu_limit, up in [-limit, limit]); transformers'
port (DeepseekV4MLP, used as the shared expert) clamps the shared expert's too. ds4f follows
the official semantics, so this script sets `shared_experts.limit = inf` on every block:
both sides then compute the same function. Some input rows are built so that the routed
experts' clamp and the shared expert's (absent) clamp really matter (see the
sidecar: rows `clamp_gate`, `clamp_up`, `clamp_shared` and their `*_clamp_effect`), so a side that
gets either wrong fails the test.

Inputs: per layer, rows of three kinds: "gauss" (h ~ N(0, 1) in fp32, a random token),
"embed" (h = the token's embedding + small noise: routes like the model's own tokens), and
"clamp" (h along a row of a selected expert's w1/w3 or the shared expert's w1/w3, so that
pre-activation exceeds swiglu_limit). For learned layers a row is redrawn if the gap between
the top_k-th and the next biased score is under MIN_MARGIN: an fp32 engine cannot be asked
to break a near-tie the same way as a float64 reference.

Records (npz; float64 reference values): layer, token, kind, h (fp32), ids (rank order:
hash layers in tid2eid order, learned layers by biased score descending), weights (aligned
with ids), y, margin; plus the synth seed, the geometry and a fingerprint of the tensors the
fixtures depend on (`checkpoint_fingerprint`), so the test can tell stale fixtures (the
synthetic generator changed) from a wrong engine.

Numerics of the reference: DeepseekV4RMSNorm computes the norm itself in float32 (it casts
its input to float32 and multiplies by the float64 weight); the rest (router logits,
sqrt(softplus), top-k, experts, shared expert) runs in float64 on float64 weights that are
exact decodes of the checkpoint.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import struct
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "golden_moe.npz"

SYNTH_GEOMETRY = "tiny"
SYNTH_SEED = 0  # the seed of tests/conftest.py's `tiny_official`
INPUT_SEED = 20260
LAYERS = (0, 1, 3)  # tiny: layer 0 is the hash layer, 1..3 are learned
ROWS = {"gauss": 4, "embed": 3, "clamp": 3}  # per layer
CLAMP_TARGETS = ("gate", "up", "shared")  # the clamp rows, in turn
MIN_CLAMP_EFFECT = 1e-2  # a clamp row: the clamp changes y by >= this x max|y|
MIN_MARGIN = 1e-3  # learned layers: min gap between the top_k-th and next biased score
FINGERPRINT_VERSION = 1

# config.json keys of the geometry (the official names)
GEOMETRY_KEYS = ("hidden_size", "moe_intermediate_size", "num_hidden_layers", "n_routed_experts",
                 "num_experts_per_tok", "num_hash_layers", "vocab_size", "routed_scaling_factor",
                 "swiglu_limit", "rms_norm_eps", "n_shared_experts")

_ST_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype("<f4"), "I64": np.dtype("<i8"),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}


# ---- reading the official shards (no ds4f code) -----------------------------------------------
class Shards:
    """The tensors of an official-format checkpoint directory, read with a minimal parser."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.config = json.loads((self.root / "config.json").read_text())
        index = json.loads((self.root / "model.safetensors.index.json").read_text())
        self.where: dict[str, tuple[Path, str, tuple, int, int]] = {}
        for fname in sorted(set(index["weight_map"].values())):
            path = self.root / fname
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            base = 8 + n
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                b0, b1 = info["data_offsets"]
                self.where[name] = (path, info["dtype"], tuple(info["shape"]), base + b0, b1 - b0)

    def names(self) -> list[str]:
        return sorted(self.where)

    def raw(self, name: str) -> tuple[str, tuple, bytes]:
        path, dtype, shape, off, n = self.where[name]
        with open(path, "rb") as f:
            f.seek(off)
            data = f.read(n)
        if len(data) != n:
            raise IOError(f"{path}: short read of {name}")
        return dtype, shape, data

    def array(self, name: str) -> np.ndarray:
        dtype, shape, data = self.raw(name)
        return np.frombuffer(data, dtype=_ST_DTYPES[dtype]).reshape(shape)


def geometry_of(config: dict) -> dict:
    g = {k: config[k] for k in GEOMETRY_KEYS if k in config}
    g.setdefault("num_hash_layers", 0)
    g.setdefault("n_shared_experts", 1)
    return g


def fingerprint_names(config: dict, layers=LAYERS) -> list[str]:
    """The tensors the fixtures depend on: the chosen layers' MoE tensors and the embedding."""
    g = geometry_of(config)
    out = ["embed.weight"]
    for layer in layers:
        p = f"layers.{layer}."
        out += [p + "ffn_norm.weight", p + "ffn.gate.weight"]
        out.append(p + ("ffn.gate.tid2eid" if layer < g["num_hash_layers"] else "ffn.gate.bias"))
        out += [p + f"ffn.shared_experts.{w}.{k}" for w in ("w1", "w3", "w2") for k in ("weight", "scale")]
        out += [p + f"ffn.experts.{e}.{w}.{k}" for e in range(g["n_routed_experts"])
                for w in ("w1", "w3", "w2") for k in ("weight", "scale")]
    return out


def checkpoint_fingerprint(root: Path | str, layers=LAYERS) -> str:
    """sha256 over the geometry and the (name, dtype, shape, bytes) of the tensors the fixtures use.

    Independent of shard size, file order and safetensors' header layout; changes exactly
    when the synthetic generator changes something these fixtures were computed from.
    """
    sh = Shards(Path(root))
    h = hashlib.sha256()
    h.update(f"ds4f-golden-moe-fingerprint/{FINGERPRINT_VERSION}\n".encode())
    h.update(json.dumps(geometry_of(sh.config), sort_keys=True).encode() + b"\n")
    for name in fingerprint_names(sh.config, layers):
        dtype, shape, data = sh.raw(name)
        h.update(f"{name} {dtype} {list(shape)} {len(data)}\n".encode())
        h.update(data)
    return h.hexdigest()


# ---- independent dequantization (ml_dtypes, float64) -------------------------------------------
def deq_bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(ml_dtypes.bfloat16).astype(np.float64)


def deq_e8m0(s: np.ndarray) -> np.ndarray:
    return np.asarray(s).view(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def deq_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """I8 [rows, k/2] (element 2i in the low nibble of byte i) x E8M0 [rows, k/32] -> float64 [rows, k]."""
    b = np.asarray(packed).view(np.uint8)
    rows, half = b.shape
    codes = np.empty((rows, 2 * half), np.uint8)
    codes[:, 0::2] = b & 0x0F
    codes[:, 1::2] = b >> 4
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = deq_e8m0(scales)
    assert s.shape == (rows, 2 * half // 32), (s.shape, rows, half)
    return (vals.reshape(rows, -1, 32) * s[:, :, None]).reshape(rows, 2 * half)


def deq_fp8(w: np.ndarray, s: np.ndarray, tile: int = 128) -> np.ndarray:
    """F8_E4M3 [r, c] x E8M0 [ceil(r/128), ceil(c/128)] -> float64 [r, c]."""
    v = np.asarray(w).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sc = deq_e8m0(s)
    r, c = v.shape
    full = np.repeat(np.repeat(sc, tile, axis=0), tile, axis=1)[:r, :c]
    return v * full


def layer_weights(sh: Shards, layer: int, g: dict) -> dict[str, np.ndarray]:
    p = f"layers.{layer}.ffn."
    out = {
        "ffn_norm": deq_bf16(sh.array(f"layers.{layer}.ffn_norm.weight")),
        "gate": deq_bf16(sh.array(p + "gate.weight")),
    }
    if layer < g["num_hash_layers"]:
        out["tid2eid"] = sh.array(p + "gate.tid2eid").astype(np.int64)
    else:
        out["bias"] = sh.array(p + "gate.bias").astype(np.float64)
    for w in ("w1", "w3", "w2"):
        out["shared_" + w] = deq_fp8(sh.array(p + f"shared_experts.{w}.weight"),
                                     sh.array(p + f"shared_experts.{w}.scale"))
    for w in ("w1", "w3", "w2"):
        out[w] = np.stack([deq_mxfp4(sh.array(p + f"experts.{e}.{w}.weight"), sh.array(p + f"experts.{e}.{w}.scale"))
                           for e in range(g["n_routed_experts"])])
    return out


# ---- the transformers reference -----------------------------------------------------------------
def build_config(g: dict):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    n = g["num_hidden_layers"]
    return DeepseekV4Config(
        vocab_size=g["vocab_size"], hidden_size=g["hidden_size"], moe_intermediate_size=g["moe_intermediate_size"],
        num_hidden_layers=n, n_routed_experts=g["n_routed_experts"], num_experts_per_tok=g["num_experts_per_tok"],
        n_shared_experts=g["n_shared_experts"], scoring_func="sqrtsoftplus", norm_topk_prob=True,
        routed_scaling_factor=float(g["routed_scaling_factor"]), swiglu_limit=float(g["swiglu_limit"]),
        rms_norm_eps=float(g["rms_norm_eps"]),
        mlp_layer_types=["hash_moe" if i < g["num_hash_layers"] else "moe" for i in range(n)],
        hidden_act="silu", mlp_bias=False, experts_implementation="eager",
    )


def build_block(config, layer: int, w: dict):
    """DeepseekV4SparseMoeBlock + its DeepseekV4RMSNorm for one layer, float64, weights loaded."""
    import torch
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm, DeepseekV4SparseMoeBlock

    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    block = DeepseekV4SparseMoeBlock(config, layer).to(torch.float64).eval()
    norm = DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps).to(torch.float64).eval()
    with torch.no_grad():
        norm.weight.copy_(t(w["ffn_norm"]))
        block.gate.weight.copy_(t(w["gate"]))
        if block.is_hash:
            block.gate.tid2eid.copy_(t(w["tid2eid"]))
        else:
            block.gate.e_score_correction_bias = t(w["bias"]).clone()  # float64 buffer
        block.experts.gate_up_proj.copy_(t(np.concatenate([w["w1"], w["w3"]], axis=1)))
        block.experts.down_proj.copy_(t(w["w2"]))
        block.shared_experts.gate_proj.weight.copy_(t(w["shared_w1"]))
        block.shared_experts.up_proj.weight.copy_(t(w["shared_w3"]))
        block.shared_experts.down_proj.weight.copy_(t(w["shared_w2"]))
    # Official semantics: only the routed experts clamp; transformers' DeepseekV4MLP would
    # clamp the shared expert too. Lift its limit so both sides compute the same function.
    block.shared_experts.limit = math.inf
    assert block.experts.limit == config.swiglu_limit
    return norm, block


def run_reference(norm, block, h: np.ndarray, token: int) -> dict:
    import torch

    with torch.no_grad():
        x = norm(torch.from_numpy(h.astype(np.float32).astype(np.float64)).reshape(1, 1, -1))
        assert x.dtype == torch.float64
        ids_t = torch.tensor([[token]], dtype=torch.long)
        if block.is_hash:
            logits, weights, idx = block.gate(x, ids_t)
        else:
            logits, weights, idx = block.gate(x)
        y = block(x, input_ids=ids_t)
    scores = torch.sqrt(torch.nn.functional.softplus(logits[0])).numpy()
    idx = idx[0].numpy().astype(np.int64)
    weights = weights[0].numpy()
    k = len(idx)
    if block.is_hash:
        margin = np.inf
    else:  # rank order: biased score descending
        biased = scores + block.gate.e_score_correction_bias.numpy()
        order = np.argsort(-biased[idx], kind="stable")
        idx, weights = idx[order], weights[order]
        srt = np.sort(biased)[::-1]
        margin = float(srt[k - 1] - srt[k])
        assert set(idx.tolist()) == set(np.argsort(-biased, kind="stable")[:k].tolist())
    xv = x.reshape(-1).numpy()
    return {"x": xv, "ids": idx, "weights": weights, "y": y.reshape(-1).numpy(), "margin": margin}


def numpy_block(w: dict, g: dict, x: np.ndarray, ids: np.ndarray, token: int, is_hash: bool) -> tuple:
    """The same block written out in numpy from the official formulas (w1 = gate, w3 = up): a
    self-check that the weights went into transformers' modules the right way round."""
    lim = float(g["swiglu_limit"])
    scores = np.sqrt(np.logaddexp(0.0, w["gate"] @ x))
    if is_hash:
        sel = w["tid2eid"][token]
    else:
        sel = np.argsort(-(scores + w["bias"]), kind="stable")[: g["num_experts_per_tok"]]
    assert set(sel.tolist()) == set(ids.tolist())
    wt = scores[ids] / scores[ids].sum() * g["routed_scaling_factor"]
    silu = lambda v: v / (1.0 + np.exp(-v))  # noqa: E731
    y = np.zeros_like(x)
    for e, we in zip(ids, wt):
        gate = np.minimum(w["w1"][e] @ x, lim)
        up = np.clip(w["w3"][e] @ x, -lim, lim)
        y += w["w2"][e] @ (we * silu(gate) * up)
    y += w["shared_w2"] @ (silu(w["shared_w1"] @ x) * (w["shared_w3"] @ x))  # no clamp: official
    return wt, y


def clamp_effects(block, x_np: np.ndarray, token: int, y: np.ndarray) -> tuple[float, float]:
    """How much the clamps matter on this row, relative to max|y|:
    (routed clamp lifted -> change, shared clamp applied as transformers would -> change)."""
    import torch

    x = torch.from_numpy(x_np).reshape(1, 1, -1)
    ids_t = torch.tensor([[token]], dtype=torch.long)
    scale = np.abs(y).max()
    with torch.no_grad():
        lim = block.experts.limit
        block.experts.limit = math.inf
        y_nc = block(x, input_ids=ids_t).reshape(-1).numpy()
        block.experts.limit = lim
        block.shared_experts.limit = lim
        y_sc = block(x, input_ids=ids_t).reshape(-1).numpy()
        block.shared_experts.limit = math.inf
    return float(np.abs(y_nc - y).max() / scale), float(np.abs(y_sc - y).max() / scale)


def make_rows(sh: Shards, g: dict, layer: int, w: dict, norm, block, rng: np.random.Generator) -> list[dict]:
    H, V = g["hidden_size"], g["vocab_size"]
    embed = None
    rows: list[dict] = []

    def accept(kind, token, h) -> dict | None:
        r = run_reference(norm, block, h, token)
        if r["margin"] < MIN_MARGIN:
            return None
        wt, y_np = numpy_block(w, g, r["x"], r["ids"], token, block.is_hash)
        assert np.allclose(wt, r["weights"], rtol=1e-12, atol=0), (wt, r["weights"])
        assert np.abs(y_np - r["y"]).max() <= 1e-12 * np.abs(r["y"]).max(), "transformers != numpy formulas"
        r["routed_clamp_effect"], r["shared_clamp_effect"] = clamp_effects(block, r["x"], token, r["y"])
        r.update(kind=kind, token=token, h=h)
        return r

    for kind, count in ROWS.items():
        made = 0
        tries = 0
        while made < count:
            tries += 1
            if tries > 10000:
                raise RuntimeError(f"layer {layer}: cannot make {kind} rows")
            token = int(rng.integers(V))
            if kind == "gauss":
                h = rng.standard_normal(H).astype(np.float32)
            elif kind == "embed":
                if embed is None:
                    embed = deq_bf16(sh.array("embed.weight"))
                h = (embed[token] + 0.1 * rng.standard_normal(H)).astype(np.float32)
            else:
                # h along one weight row: that row's pre-activation is ~ sqrt(H) |row| ~ 16 > limit.
                # gate: a routed expert's w1 row, + sign (the clamp is gate <= limit);
                # up: a routed expert's w3 row, either sign; shared: a shared w1/w3 row.
                target = CLAMP_TARGETS[made % len(CLAMP_TARGETS)]
                sign = 1.0 if target == "gate" or rng.random() < 0.5 else -1.0
                if target == "shared":
                    mat = w["shared_w1"] if rng.random() < 0.5 else w["shared_w3"]
                    if mat is w["shared_w1"]:
                        sign = 1.0
                else:  # an expert this token could route to: selected for a random probe input
                    probe = run_reference(norm, block, rng.standard_normal(H).astype(np.float32), token)
                    e = int(probe["ids"][rng.integers(len(probe["ids"]))])
                    mat = w["w1" if target == "gate" else "w3"][e]
                row = mat[rng.integers(mat.shape[0])]
                h = (sign * row / np.sqrt(np.mean(row ** 2)) + 0.3 * rng.standard_normal(H)).astype(np.float32)
            r = accept(kind, token, h)
            if r is None:
                continue
            if kind == "clamp":
                effect = r["shared_clamp_effect"] if target == "shared" else r["routed_clamp_effect"]
                if effect < MIN_CLAMP_EFFECT:
                    continue
                r["kind"] = f"clamp_{target}"
            rows.append(r)
            made += 1
    return rows


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed, but byte-reproducible (fixed zip timestamps, sorted members), so that
    regenerating unchanged fixtures leaves git with nothing to commit."""
    import io
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="npz path (a .json sidecar is written next to it)")
    ap.add_argument("--keep", type=Path, default=None, help="write the synthetic checkpoint here and keep it")
    args = ap.parse_args(argv)

    import torch
    import transformers

    from ds4f.engine.checkpoint.synth import synth_checkpoint

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="ds4f-golden-") as tmp:
        ck_dir = args.keep or Path(tmp) / "official"
        synth_checkpoint(ck_dir, SYNTH_GEOMETRY, seed=SYNTH_SEED, force=args.keep is not None)
        sh = Shards(ck_dir)
        g = geometry_of(sh.config)
        assert g["n_shared_experts"] == 1, "DeepseekV4MLP's width is moe_intermediate_size: one shared expert"
        fp = checkpoint_fingerprint(ck_dir)
        config = build_config(g)
        rng = np.random.default_rng(INPUT_SEED)
        rows: list[dict] = []
        layer_of: list[int] = []
        for layer in LAYERS:
            w = layer_weights(sh, layer, g)
            norm, block = build_block(config, layer, w)
            assert block.is_hash == (layer < g["num_hash_layers"])
            new = make_rows(sh, g, layer, w, norm, block, rng)
            rows += new
            layer_of += [layer] * len(new)

    kinds = ["gauss", "embed"] + [f"clamp_{t}" for t in CLAMP_TARGETS]
    arrays = {
        "layer": np.array(layer_of, np.int32),
        "token": np.array([r["token"] for r in rows], np.int64),
        "kind": np.array([kinds.index(r["kind"]) for r in rows], np.int8),
        "h": np.stack([r["h"] for r in rows]).astype(np.float32),
        "ids": np.stack([r["ids"] for r in rows]).astype(np.int64),
        "weights": np.stack([r["weights"] for r in rows]).astype(np.float64),
        "y": np.stack([r["y"] for r in rows]).astype(np.float64),
        "margin": np.array([r["margin"] for r in rows], np.float64),
        "routed_clamp_effect": np.array([r["routed_clamp_effect"] for r in rows], np.float64),
        "shared_clamp_effect": np.array([r["shared_clamp_effect"] for r in rows], np.float64),
    }
    meta = {
        "format": "ds4f-golden-moe", "version": 1,
        "generator": "tools/make_golden_moe.py",
        "reference": f"transformers {transformers.__version__} DeepseekV4SparseMoeBlock (float64), torch {torch.__version__}",
        "shared_expert_clamp": "lifted (limit = inf): official semantics clamp routed experts only",
        "synth_geometry": SYNTH_GEOMETRY, "synth_seed": SYNTH_SEED, "input_seed": INPUT_SEED,
        "geometry": g, "layers": list(LAYERS), "kinds": kinds, "min_margin": MIN_MARGIN,
        "fingerprint_version": FINGERPRINT_VERSION, "fingerprint": fp,
        "rows": len(rows),
        "ids_order": "rank order: hash layers as in tid2eid, learned layers by biased score descending",
    }
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_npz(args.out, arrays)
    summary = dict(meta)
    summary["per_row"] = [{"layer": l, "kind": r["kind"], "token": r["token"], "ids": r["ids"].tolist(),
                           "margin": None if math.isinf(r["margin"]) else round(r["margin"], 6),
                           "routed_clamp_effect": float(f"{r['routed_clamp_effect']:.3g}"),
                           "shared_clamp_effect": float(f"{r['shared_clamp_effect']:.3g}")}
                          for l, r in zip(layer_of, rows)]
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {len(rows)} rows) and {args.out.with_suffix('.json').name}")
    print(f"fingerprint {fp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
