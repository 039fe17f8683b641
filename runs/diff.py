"""The diff of two state dumps: what kind of difference it is, and where it starts.

Classes: identical (same bytes); low-bit (same tokens and routing, hidden states within
LOW_BIT_TOLERANCE: SIMD lane order); routing (the first token and layer whose selected experts
differ); drift (same routing, hidden states beyond tolerance); prefix (the same prefix, lengths
differ). `ds4f diff` exits with the class's code.

Two full dumps compare every float. A compact dump holds per token and layer a digest of the exact
state and its sketch (max |x|, rms, x on fixed directions: runs.statedump): where either dump is
compact, both are compared as compact records (a full record gives its compact one exactly), the
digests saying where the exact states first differ and the sketches how far apart they are,
relative to the layer's max |x| and rms. Two dumps whose compact records are equal are identical
whatever their kinds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.runs.statedump import State, read_state

# hidden-state error, relative to the layer's largest magnitude, below which two runs
# with identical routing are "low-bit" (SIMD lane order) rather than "drift"
LOW_BIT_TOLERANCE = 1e-4

# the records' other floats, compared like the hidden states (each relative to its own largest magnitude)
OTHER_FLOATS = {"attn": "attention outputs", "attn_sketch": "attention outputs", "weights": "expert weights",
                "top_logits": "top logits"}

CLASS_EXIT_CODES = {"identical": 0, "low-bit": 1, "routing": 3, "drift": 4, "prefix": 5}


@dataclass
class StateDiff:
    cls: str                        # identical | low-bit | routing | drift | prefix (same prefix, lengths differ)
    token: int | None               # first divergent token (routing), else None
    layer: int | None               # first divergent layer (routing), else None
    layer_max_abs: list[float]      # per layer, over the compared tokens
    layer_max_rel: list[float]      # per layer: max |a-b| / max(|a|, |b|) of that layer
    sha_a: str
    sha_b: str
    n_tokens: int                   # tokens compared
    backends_a: list[str]
    backends_b: list[str]
    detail: str = ""
    attention_token: int | None = None   # the first token, then layer, whose attention output differs beyond
    attention_layer: int | None = None   # LOW_BIT_TOLERANCE (whole-model dumps; None: nowhere, or no attention)
    other_max_rel: dict = field(default_factory=dict)   # OTHER_FLOATS' field -> its max relative difference
    modes: tuple[str, str] = ("full", "full")   # the kinds of the two dumps (full | compact)
    state_token: int | None = None      # the first token, then layer, whose exact state differs (compared
    state_layer: int | None = None      # as compact records: the digests); None: nowhere, or not compared

    @property
    def exit_code(self) -> int:
        return CLASS_EXIT_CODES[self.cls]

    def summary(self) -> str:
        if self.cls == "identical":
            if self.sha_a != self.sha_b:
                return (f"identical: the same states bit for bit, every layer's digest equal ({self.n_tokens} tokens;"
                        f" a {self.modes[0]} and a {self.modes[1]} dump)")
            return f"identical: sha256 {self.sha_a[:16]}… on both ({self.n_tokens} tokens)"
        worst = max(self.layer_max_rel, default=0.0)
        if self.cls in ("low-bit", "drift") and self.state_token is not None:
            where = f"; the exact states first differ at token {self.state_token}, layer {self.state_layer}"
            return replace(self, state_token=None).summary() + where
        if self.cls == "low-bit":
            others = max(self.other_max_rel.values(), default=0.0)
            also = f", the other values within {others:.2e}" if others > worst else ""
            rest = f"; {self.detail}" if self.detail else ""
            return (f"low-bit: same tokens and routing, hidden states within {worst:.2e} relative{also}"
                    f" (tolerance {LOW_BIT_TOLERANCE:g}){rest}")
        if self.cls == "drift":
            if self.detail:
                return f"drift: {self.detail}"
            return f"drift: same routing, but hidden states differ by up to {worst:.2e} relative (tolerance {LOW_BIT_TOLERANCE:g})"
        if self.cls == "prefix":
            return f"same prefix, lengths differ: {self.detail}"
        return f"routing divergence at token {self.token}, layer {self.layer}" + (f": {self.detail}" if self.detail else "")

    def attention_summary(self) -> str | None:
        """Where the attention first diverges, when it does (beyond the low-bit tolerance)."""
        if self.attention_token is None:
            return None
        return f"attention first diverges at token {self.attention_token}, layer {self.attention_layer}"

    def to_dict(self) -> dict:
        return {"class": self.cls, "token": self.token, "layer": self.layer, "layer_max_abs": self.layer_max_abs,
                "layer_max_rel": self.layer_max_rel, "sha_a": self.sha_a, "sha_b": self.sha_b,
                "n_tokens": self.n_tokens, "attention_token": self.attention_token,
                "attention_layer": self.attention_layer, "summary": self.summary(),
                "attention": self.attention_summary(), "other_max_rel": self.other_max_rel,
                "modes": list(self.modes), "state_token": self.state_token, "state_layer": self.state_layer}


def sketch_rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How far apart two sketches are (runs.statedump.sketch: [..., max |x|, rms, x on directions]),
    per sketch: |max a - max b| over the larger max, and every other entry's difference over the
    larger rms (a direction's value has the rms's scale). float64 [...]; NaN where either is."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    d = np.abs(a - b)
    with np.errstate(invalid="ignore", divide="ignore"):
        top = np.maximum(a[..., 0], b[..., 0])
        rms = np.maximum(a[..., 1], b[..., 1])
        rel_max = np.where(d[..., 0] == 0, 0.0, d[..., 0] / top)
        rel_rest = np.where(d[..., 1:] == 0, 0.0, d[..., 1:] / rms[..., None])
    return np.maximum(rel_max, rel_rest.max(axis=-1))


def first_attention_divergence(ra: np.ndarray, rb: np.ndarray, n: int) -> tuple[int | None, int | None]:
    """(token, layer) of the first attention output (token order, then layer order) whose
    max |a - b| over max(|a|, |b|) (compact records: its sketch_rel) exceeds LOW_BIT_TOLERANCE;
    (None, None) if none does."""
    compact = "attn_sketch" in ra.dtype.names
    if not ("attn" in ra.dtype.names or compact) or not n:
        return None, None
    for start in range(0, n, 256):    # a chunk of tokens at a time: float64 copies stay small
        if compact:
            rel = sketch_rel(ra["attn_sketch"][start:min(n, start + 256)], rb["attn_sketch"][start:min(n, start + 256)])
            bad = ~(rel <= LOW_BIT_TOLERANCE)
        else:
            a = ra["attn"][start:min(n, start + 256)].astype(np.float64)
            b = rb["attn"][start:min(n, start + 256)].astype(np.float64)
            d = np.abs(a - b).max(axis=2)
            scale = np.maximum(np.abs(a).max(axis=2), np.abs(b).max(axis=2))
            bad = ~(d <= LOW_BIT_TOLERANCE * scale)       # NaN counts as divergent
        if bad.any():
            t, layer = np.argwhere(bad)[0]
            return start + int(t), int(layer)
    return None, None


def diff_states(a: str | os.PathLike | State, b: str | os.PathLike | State) -> StateDiff:
    sa = a if isinstance(a, State) else read_state(a)
    sb = b if isinstance(b, State) else read_state(b)
    ga, gb = sa.header["geometry"], sb.header["geometry"]
    shape_keys = ("num_hidden_layers", "num_experts_per_tok", "hidden_size", "hc_mult")
    if any(ga.get(k) != gb.get(k) for k in shape_keys):
        raise Ds4fError(f"{sb.path}: geometry differs from {sa.path} "
                        f"({', '.join(f'{k} {ga.get(k)} vs {gb.get(k)}' for k in shape_keys if ga.get(k) != gb.get(k))}); nothing to compare")
    modes = (sa.mode, sb.mode)
    compact = "compact" in modes
    ra, rb = (sa.compact(), sb.compact()) if compact else (sa.records, sb.records)
    n = min(len(ra), len(rb))
    n_layers = ga["num_hidden_layers"]
    hidden = "hidden_sketch" if compact else "hidden"

    def errors(upto: int) -> tuple[list[float], list[float]]:
        if upto == 0:
            return [0.0] * n_layers, [0.0] * n_layers
        if compact:
            a, b = ra["hidden_sketch"][:upto].astype(np.float64), rb["hidden_sketch"][:upto].astype(np.float64)
            return ([float(v) for v in np.abs(a - b).max(axis=(0, 2))],
                    [float(v) for v in sketch_rel(a, b).max(axis=0)])
        ha = ra["hidden"][:upto].astype(np.float64)
        hb = rb["hidden"][:upto].astype(np.float64)
        d = np.abs(ha - hb).max(axis=(0, 2))
        scale = np.maximum(np.abs(ha).max(axis=(0, 2)), np.abs(hb).max(axis=(0, 2)))
        rel = np.where(scale > 0, d / np.where(scale > 0, scale, 1), 0.0)
        return [float(v) for v in d], [float(v) for v in rel]

    common = dict(sha_a=sa.sha256, sha_b=sb.sha256, backends_a=sa.backends, backends_b=sb.backends, modes=modes)
    if sa.sha256 == sb.sha256 or (compact and len(ra) == len(rb) and ra.tobytes() == rb.tobytes()):
        return StateDiff("identical", None, None, [0.0] * n_layers, [0.0] * n_layers, n_tokens=n, **common)
    common["attention_token"], common["attention_layer"] = first_attention_divergence(ra, rb, n)
    if compact:
        common["state_token"], common["state_layer"] = first_digest_divergence(ra, rb, n)

    # first (token, layer) where the selected experts (as sets) or the fed token differ
    for t in range(n):
        if ra["token"][t] != rb["token"][t]:
            mabs, mrel = errors(t)
            return StateDiff("routing", t, 0, mabs, mrel, n_tokens=n,
                             detail=f"token ids differ ({ra['token'][t]} vs {rb['token'][t]})", **common)
        for layer in range(n_layers):
            ea, eb = ra["ids"][t, layer], rb["ids"][t, layer]
            if set(ea.tolist()) != set(eb.tolist()):
                mabs, mrel = errors(t)
                return StateDiff("routing", t, layer, mabs, mrel, n_tokens=n,
                                 detail=f"experts {sorted(ea.tolist())} vs {sorted(eb.tolist())}", **common)
    for t in np.flatnonzero(ra["next"][:n] != rb["next"][:n])[:1]:     # the last pick (the others are tokens)
        mabs, mrel = errors(n)
        return StateDiff("routing", int(t) + 1, 0, mabs, mrel, n_tokens=n,
                         detail=f"the token picked after token {int(t)} differs ({ra['next'][t]} vs {rb['next'][t]})",
                         **common)
    mabs, mrel = errors(n)
    fields = (hidden, *(f for f in OTHER_FLOATS if f in ra.dtype.names))
    bad = [f"{OTHER_FLOATS.get(f, 'hidden states')} of {s.path}" for s, r in ((sa, ra), (sb, rb)) for f in fields
           if not np.isfinite(r[f][:n]).all()]
    if bad:
        return StateDiff("drift", None, None, mabs, mrel, n_tokens=n,
                         detail=f"non-finite values (NaN or Inf): {', '.join(bad)}", **common)
    common["other_max_rel"] = {f: float(sketch_rel(ra[f][:n], rb[f][:n]).max(initial=0.0)) if f == "attn_sketch"
                               else _max_rel(*(_by_expert(r, f, n) for r in (ra, rb))) for f in fields[1:]}
    off = {f: v for f, v in common["other_max_rel"].items() if v > LOW_BIT_TOLERANCE}
    if off and max(mrel, default=0.0) <= LOW_BIT_TOLERANCE:
        return StateDiff("drift", None, None, mabs, mrel, n_tokens=n, **common,
                         detail="same routing and hidden states, but " + ", ".join(
                             f"{OTHER_FLOATS[f]} differ by up to {v:.2e} relative" for f, v in off.items())
                         + f" (tolerance {LOW_BIT_TOLERANCE:g})")
    within = max(mrel, default=0.0) <= LOW_BIT_TOLERANCE
    exact = common.get("state_token") is None if compact else max(mabs, default=0.0) == 0.0
    if len(ra) != len(rb):
        same = "bit-identical" if within and exact else (
            f"within {max(mrel, default=0.0):.2e} relative" if within else None)
        if same is not None:
            return StateDiff("prefix", None, None, mabs, mrel, n_tokens=n,
                             detail=f"the first {n} tokens have the same routing and states {same};"
                                    f" the runs have {len(ra)} and {len(rb)} tokens", **common)
    same_records = len(ra) == len(rb) and ra.tobytes() == rb.tobytes()
    return StateDiff("low-bit" if within else "drift", None, None, mabs, mrel, n_tokens=n, **common,
                     detail="the records are bit-identical; the files differ in their headers" if same_records else "")


def first_digest_divergence(ra: np.ndarray, rb: np.ndarray, n: int) -> tuple[int | None, int | None]:
    """(token, layer) of the first exact state (token order, then layer order) whose digest differs
    between two compact record arrays; (None, None) if all of the first n are equal."""
    bad = ra["digest"][:n] != rb["digest"][:n]
    if not bad.any():
        return None, None
    t, layer = np.argwhere(bad)[0]
    return int(t), int(layer)


def _by_expert(records: np.ndarray, name: str, n: int) -> np.ndarray:
    """The first n records' values of a field; the expert weights in the order of the expert ids
    (the sets are equal here; two backends may list a near tie in either order)."""
    values = records[name][:n]
    if name != "weights":
        return values
    return np.take_along_axis(values, np.argsort(records["ids"][:n], axis=-1, kind="stable"), axis=-1)


def _max_rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| over max(|a|, |b|), in float64 (0 for empty or all-zero values)."""
    if a.size == 0:
        return 0.0
    a, b = a.astype(np.float64), b.astype(np.float64)
    scale = max(float(np.abs(a).max()), float(np.abs(b).max()))
    return float(np.abs(a - b).max() / scale) if scale > 0 else 0.0
