#!/usr/bin/env python3
"""A trained MTP layer for tests/fixtures/toolcall: the draft model of speculative decoding, learned.

A synthetic MTP layer's weights are random, so its drafts are never kept and speculation's real
acceptance cannot be measured. This script trains DeepSeek-V4's multi-token-prediction layer
(ds4f-mtp.md; engine/model/mtp.py) beside the frozen toolcall model of tools/make_tool_model.py,
on the same conversations, and writes it into the fixture in the official names and dtypes.

Run by hand, training in the reference venv of tools/make_tool_model.py (torch 2.13 CPU,
transformers 5.24.0, safetensors, ml_dtypes, tokenizers), the checks in the project's venv:

    /tmp/venv-ref/bin/python tools/make_mtp_layer.py --dump /tmp/mtp-rows.npz   # about 2 min on one core
    .venv/bin/python tools/make_mtp_layer.py --check --dump /tmp/mtp-rows.npz   # ds4f: reference, drafts, runs

The layer, in torch: transformers' own DeepseekV4DecoderLayer as the block, built from a copy of
the model's config with one layer, `layer_types` ["sliding_attention"] (compress ratio 0: the
window only, plain RoPE θ = 10000 through the rotary table's "main" entry) and `mlp_layer_types`
["moe"] (transformers picks hash routing by `mlp_layer_types[layer_idx] == "hash_moe"`, so the
block's gate is a learned DeepseekV4TopKRouter with its e_score_correction_bias), with its two
hyper-connections; around it enorm, hnorm, e_proj, h_proj, the layer's own DeepseekV4HyperHead
and final norm; the embedding and the head are the main model's (frozen). Row j of a sequence:

    X_j   the main model's last decoder layer's output streams [4, hidden] at token j (a forward
          hook on model.model.layers[-1]: before the main hc_head)
    X'    = e_proj(enorm(embed[t_{j+1}]))[None] + h_proj(hnorm(X_j)),  block(X') at position j
    logits(t_{j+2}) = head(norm(hc_head_mtp(X')))

The block's attention is a causal sliding window (sliding_window rows, this one included) over
the layer's own rows, as ds4f keeps its window (row j from (X_j, t_{j+1}) at position j). The
main model is loaded from the fixture's model.safetensors (dequantised), checked to give every
conversation's answer, and frozen; its streams are computed once. Only the MTP layer trains:
the block starts as a copy of the main model's last layer (also a window with a learned gate),
hc_head and norm as the main model's, enorm / hnorm ones, e_proj and h_proj as identity.
Training, fp32 AdamW on one thread, seeded, every conversation in each step: cross-entropy on
the rows that predict an answer token (the rows the engine drafts from: from the last prompt
row but one, so the first draft, made when the last prompt token is fed, counts), rows more
than a window before them dropped, until the greedy top-1 is right at TARGET_TOP1 of those
rows (or MAX_STEPS).

The tensors are then quantised as the main layers are (make_golden_whole.quantise_all on the
block under the name of a layer after the last, renamed to mtp.0.*: FP8 E4M3 with 128x128 E8M0
tiles for the attention and shared-expert linears, MXFP4 routed experts, BF16 norms and gate
weight, F32 hyper-connection parameters, sink and gate bias; e_proj / h_proj FP8, enorm /
hnorm / norm BF16, hc_head_* F32), the top-1 measured again with the dequantised values, and
written as a second shard, model-mtp.safetensors (the name ds4f synth's add_mtp_layer gives it),
with a model.safetensors.index.json naming both shards; model.safetensors, config.json (it
already says num_nextn_predict_layers 1, compress_ratios ending in 0) and training.json are
left as they are. The training record is mtp_training.json. A retrained main model
(make_tool_model.py) needs this run again: the MTP layer reads its streams.

`.venv/bin/ds4f verify tests/fixtures/toolcall` checks the layer's dtypes, shapes and scales.
--check (the project venv) holds what was written to ds4f itself: the torch layer's logits
(dumped by --dump) against engine.model.reference.ReferenceMtp (float64, from the checkpoint's
tensors) and against the engine's MTP layer on the engine's own main streams; the engine's
MtpDrafter's first drafts on every answer row against the torch layer's argmax; then every
conversation greedy through a run (RunConfig messages + tools, as the tests send them) with spec
off, 1, 2, 3: the tokens must be the same, and the acceptance per depth, drafts and tokens per
round are recorded under "ds4f" in mtp_training.json.

Measured (this machine, 2 cores, one torch thread, seed 0; mtp_training.json has them all):
180 steps in 110 s (about 0.6 s a step, every conversation in each), cross-entropy 6.65 at the
start (top-1 2 %) and 0.021 at the end; greedy top-1 746 of the 751 answer rows (99.3 %), the
same with the quantised weights (ce 0.023). The torch layer's logits against ReferenceMtp on
78 answer rows of two conversations: at most 1.7e-5 apart (the largest logit 17.2), the
engine's MTP layer 1.5e-5 from it, the same argmax everywhere, and the engine's MtpDrafter
drafting the torch argmax on all 78 rows. Through ds4f's runs, all 18 conversations, greedy:
the same tokens with spec off, 1, 2 and 3 (the script's answers); spec 1 kept 367 of 371 drafts
(0.99), 1.98 tokens a round; spec 2: depth 1 0.996, depth 2 0.82, 2.76 tokens a round; spec 3:
depth 1 0.99, depth 2 0.73, depth 3 0.77 (each given the ones before it kept), 3.21 tokens a
round. Only the first depth is trained (rows from the main model's streams); the chained
drafts feed the block's own output streams back, which it never saw in training. A synthetic
(random) MTP layer beside the same model keeps 3 of 135 first drafts on two conversations.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "toolcall"
MTP_SHARD = "model-mtp.safetensors"        # = ds4f.engine.checkpoint.synth.MTP_SHARD
INDEX_NAME = "model.safetensors.index.json"
MAIN_SHARD = "model.safetensors"
RECORD = "mtp_training.json"

SEED = 0
MAX_STEPS = 300
LR = 2e-3                   # AdamW(0.9, 0.95), no weight decay, WARMUP steps of linear warm-up
WARMUP = 20
CLIP = 1.0
EVAL_EVERY = 20
TARGET_TOP1 = 0.98          # stop once the greedy top-1 is right at this share of the answer rows
MIN_TOP1_QUANTISED = 0.8    # the written layer, dequantised: else nothing is written


def tool_model():
    """tools/make_tool_model.py as a module (its conversations, encoding, config, imports)."""
    tools = str(REPO / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import make_tool_model

    return make_tool_model


def load_examples(out: Path) -> list[dict]:
    mtm = tool_model()
    mtm.import_ds4f()
    from ds4f.engine.text import Tokenizer

    script = json.loads((out / mtm.SCRIPT_NAME).read_text())
    return mtm.encode_examples(Tokenizer.load(out), script)


# ---- the main model, from the fixture ---------------------------------------------------------------
def load_main(out: Path):
    """The fixture's DeepseekV4ForCausalLM, its weights dequantised from model.safetensors (fp32)."""
    import numpy as np

    mtm = tool_model()
    g = mtm.golden()
    g.install_patches()
    fields = copy.deepcopy(mtm.CONFIG)
    cfg, _ = g.load_config(out, fields)
    raw = g.read_safetensors(out / MAIN_SHARD)
    arr = {n: np.frombuffer(b, g.ST_NUMPY[dt]).reshape(shape) for n, (dt, shape, b) in raw.items()}
    from transformers import DeepseekV4ForCausalLM

    names = DeepseekV4ForCausalLM(cfg).state_dict().keys()
    deq = {}
    for name in names:
        if ".mlp.experts." in name:
            layer = name.split(".")[2]
            parts = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            deq[name] = np.stack([np.concatenate([g.dequantize_mxfp4(arr[f"layers.{layer}.ffn.experts.{e}.{w}.weight"],
                                                                     arr[f"layers.{layer}.ffn.experts.{e}.{w}.scale"])
                                                  for w in parts]) for e in range(cfg.n_routed_experts)])
            continue
        o = g.official_name(name)
        if g.official_dtype(o) == "F8_E4M3":
            deq[name] = g.dequantize_fp8(arr[o], arr[o[:-len(".weight")] + ".scale"])
        elif o.endswith(".tid2eid"):
            deq[name] = arr[o].astype(np.int64)
        else:
            deq[name] = arr[o].astype(np.float32)
    return g.build_model(cfg, deq), cfg, fields


def main_streams(model, examples) -> list:
    """Each example's last decoder layer's output streams [len - 1, N, hidden] over prompt +
    answer[:-1] (one cache-less forward each), and whether the model's greedy argmax gives the
    answer at every answer row."""
    import torch

    got = []
    hook = model.model.layers[-1].register_forward_hook(lambda mod, args, out: got.append(out.detach()))
    ok = True
    with torch.no_grad():
        for e in examples:
            seq = e["prompt"] + e["answer"][:-1]
            logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0]
            ok &= logits[len(e["prompt"]) - 1:].argmax(-1).tolist() == e["answer"]
    hook.remove()
    return [x[0] for x in got], ok


# ---- the MTP layer in torch -------------------------------------------------------------------------
def block_config(cfg):
    """The main config for one layer: a sliding window (compress ratio 0) and a learned gate."""
    c = copy.deepcopy(cfg)
    c.num_hidden_layers = 1
    c.layer_types = ["sliding_attention"]
    c.mlp_layer_types = ["moe"]
    return c


def make_mtp(cfg):
    """The MTP layer's modules (torch.nn.Module); forward(X, next_ids, positions, embed, head, rotary)."""
    import torch
    from torch import nn
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4DecoderLayer, DeepseekV4HyperHead,
                                                                       DeepseekV4RMSNorm)

    class MtpLayer(nn.Module):
        def __init__(self):
            super().__init__()
            D, eps = cfg.hidden_size, cfg.rms_norm_eps
            self.block = DeepseekV4DecoderLayer(block_config(cfg), 0)
            assert not self.block.mlp.is_hash and self.block.self_attn.compressor is None
            assert self.block.self_attn.rope_layer_type == "main"
            self.block.mlp.shared_experts.limit = math.inf      # the official code clamps routed experts only
            self.enorm = DeepseekV4RMSNorm(D, eps=eps)
            self.hnorm = DeepseekV4RMSNorm(D, eps=eps)
            self.e_proj = nn.Linear(D, D, bias=False)
            self.h_proj = nn.Linear(D, D, bias=False)
            self.hc_head = DeepseekV4HyperHead(cfg)
            self.norm = DeepseekV4RMSNorm(D, eps=eps)
            self.window = cfg.sliding_window

        def forward(self, X, next_ids, positions, embed, head, rotary):
            """X [B, S, N, D] main streams, next_ids [B, S] the tokens after them, positions [B, S]
            (row j at j): (logits [B, S, vocab], the block's output streams [B, S, N, D])."""
            e = self.e_proj(self.enorm(embed(next_ids)))
            x = self.h_proj(self.hnorm(X)) + e[:, :, None, :]
            S = x.shape[1]
            q = positions[0][:, None] - positions[0][0]          # rows are consecutive: differences
            k = positions[0][None, :] - positions[0][0]
            allowed = (k <= q) & (k > q - self.window)
            mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
            pe = {"main": rotary(x[:, :, 0], position_ids=positions, layer_type="main")}
            assert mask.shape[-1] == S
            x = self.block(x, position_embeddings=pe, position_ids=positions, attention_mask=mask,
                           input_ids=next_ids)
            return head(self.norm(self.hc_head(x))), x

    return MtpLayer()


def init_mtp(mtp, model) -> None:
    """The block as a copy of the main model's last layer (a window and a learned gate too),
    hc_head and norm as the main model's, enorm / hnorm ones, e_proj / h_proj identity."""
    import torch

    last = len(model.model.layers) - 1
    assert model.config.layer_types[last] == "sliding_attention" and model.config.mlp_layer_types[last] == "moe"
    with torch.no_grad():
        mtp.block.load_state_dict(model.model.layers[last].state_dict())
        mtp.hc_head.load_state_dict(model.model.hc_head.state_dict())
        mtp.norm.load_state_dict(model.model.norm.state_dict())
        for p in (mtp.enorm.weight, mtp.hnorm.weight):
            p.fill_(1.0)
        for p in (mtp.e_proj.weight, mtp.h_proj.weight):
            p.copy_(torch.eye(p.shape[0]))


def mtp_rows(examples, streams, window: int) -> list[dict]:
    """Per example the MTP rows to run: j from `window` rows before the first drafting row (the
    last prompt row but one) to the last with a target; X_j, t_{j+1}, position j, target t_{j+2},
    and which rows predict an answer token."""
    out = []
    for e, X in zip(examples, streams):
        s = e["prompt"] + e["answer"]
        first = len(e["prompt"]) - 2                  # drafts answer[0] (fed: the last prompt token)
        lo, hi = max(0, first - window + 1), len(s) - 2          # rows lo .. hi - 1
        out.append({"X": X[lo:hi], "next": s[lo + 1:hi + 1], "pos": list(range(lo, hi)),
                    "target": s[lo + 2:hi + 2], "scored": [j >= first for j in range(lo, hi)]})
    return out


def batch_of(rows):
    import torch

    n, L = len(rows), max(len(r["pos"]) for r in rows)
    N, D = rows[0]["X"].shape[1:]
    X = torch.zeros(n, L, N, D)
    nxt = torch.zeros(n, L, dtype=torch.long)
    tgt = torch.zeros(n, L, dtype=torch.long)
    scored = torch.zeros(n, L, dtype=torch.bool)
    pos = torch.zeros(n, L, dtype=torch.long)
    for i, r in enumerate(rows):
        m = len(r["pos"])
        X[i, :m] = r["X"]
        nxt[i, :m] = torch.tensor(r["next"])
        tgt[i, :m] = torch.tensor(r["target"])
        scored[i, :m] = torch.tensor(r["scored"])
        pos[i] = torch.arange(r["pos"][0], r["pos"][0] + L)     # right padding: causal, never seen
    return X, nxt, pos, tgt, scored


def run_mtp(mtp, model, rows):
    """(logits [n, L, vocab], targets, scored mask) over a batch of examples' rows (their positions
    differ; the window's mask depends only on their differences)."""
    X, nxt, pos, tgt, scored = batch_of(rows)
    logits, _ = mtp(X, nxt, pos, model.model.embed_tokens, model.lm_head, model.model.rotary_emb)
    return logits, tgt, scored


def top1(mtp, model, rows) -> dict:
    import torch

    with torch.no_grad():
        logits, tgt, scored = run_mtp(mtp, model, rows)
    lg, t = logits[scored], tgt[scored]
    margins = tool_model().margins_of(lg, t)
    return {"right": int((lg.argmax(-1) == t).sum()), "of": int(t.numel()),
            "rate": round(float((lg.argmax(-1) == t).float().mean()), 4),
            "ce": round(float(torch.nn.functional.cross_entropy(lg, t)), 5),
            "median_margin": round(float(margins.median()), 3)}


def train(mtp, model, rows, seed: int, log) -> dict:
    import torch

    params = [p for p in mtp.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    hist = {"evals": []}
    t0 = time.time()
    ev = top1(mtp.eval(), model, rows)
    hist["evals"].append(dict(step=0, **ev, seconds=0.0))
    log(f"step 0: top-1 {ev['rate']:.3f} ce {ev['ce']:.3f}")
    for step in range(1, MAX_STEPS + 1):
        mtp.train()
        logits, tgt, scored = run_mtp(mtp, model, rows)
        loss = torch.nn.functional.cross_entropy(logits[scored], tgt[scored])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        sched.step()
        if step % EVAL_EVERY:
            continue
        ev = top1(mtp.eval(), model, rows)
        hist["evals"].append(dict(step=step, loss=round(loss.item(), 5), **ev, seconds=round(time.time() - t0, 1)))
        log(f"step {step}: loss {loss.item():.4f} top-1 {ev['rate']:.3f} ({ev['right']}/{ev['of']}) "
            f"{time.time() - t0:.0f} s")
        if ev["rate"] >= TARGET_TOP1:
            break
    hist.update(steps=step, loss=round(loss.item(), 5), seconds=round(time.time() - t0, 1))
    return hist


# ---- quantised as the main layers are ---------------------------------------------------------------
def quantise_mtp(mtp, fields: dict):
    """(official mtp.0.* name -> array in its shipped dtype, the module's state_dict name ->
    dequantised float32)."""
    import numpy as np

    g = tool_model().golden()
    L = fields["num_hidden_layers"]          # the block is quantised as a layer after the last
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in mtp.state_dict().items()}
    block = {f"model.layers.{L}.{k[len('block.'):]}": v for k, v in sd.items() if k.startswith("block.")}
    off, deq_block = g.quantise_all(block, fields)
    official = {"mtp.0." + n[len(f"layers.{L}."):]: a for n, a in off.items()}
    deq = {"block." + n[len(f"model.layers.{L}."):]: a for n, a in deq_block.items()}
    for n in ("e_proj", "h_proj"):
        q, s = g.quantize_fp8(sd[f"{n}.weight"])
        official[f"mtp.0.{n}.weight"], official[f"mtp.0.{n}.scale"] = q, s
        deq[f"{n}.weight"] = g.dequantize_fp8(q, s)
    for n in ("enorm", "hnorm", "norm"):
        official[f"mtp.0.{n}.weight"] = g.to_bf16(sd[f"{n}.weight"])
        deq[f"{n}.weight"] = official[f"mtp.0.{n}.weight"].astype(np.float32)
    for n in ("fn", "base", "scale"):
        official[f"mtp.0.hc_head_{n}"] = sd[f"hc_head.hc_{n}"].astype(np.float32)
        deq[f"hc_head.hc_{n}"] = official[f"mtp.0.hc_head_{n}"]
    assert set(deq) == set(sd), sorted(set(deq) ^ set(sd))
    return official, deq


def load_deq(mtp, deq) -> None:
    import numpy as np
    import torch

    with torch.no_grad():
        for name, t in mtp.state_dict().items():
            t.copy_(torch.from_numpy(np.ascontiguousarray(deq[name])))


def write_shard(out: Path, official: dict) -> None:
    """model-mtp.safetensors and the index naming both shards (the main shard's bytes untouched)."""
    g = tool_model().golden()
    main = g.read_safetensors(out / MAIN_SHARD)
    tmp = out / (MTP_SHARD + ".tmp")
    g.save_official(official, tmp)
    tmp.replace(out / MTP_SHARD)
    total = sum(len(b) for _, _, b in main.values()) + sum(a.nbytes for a in official.values())
    wm = {n: MAIN_SHARD for n in sorted(main)} | {n: MTP_SHARD for n in sorted(official)}
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2) + "\n")


def dump_rows(path: Path, mtp, model, examples, rows, which: list[int]) -> None:
    """For the check: of some conversations, the rows (main streams, next tokens, positions) and
    the layer's logits and output streams (the dequantised weights)."""
    import numpy as np
    import torch

    arrays = {}
    with torch.no_grad():
        for i in which:
            X, nxt, pos, _, _ = batch_of([rows[i]])
            logits, streams = mtp(X, nxt, pos, model.model.embed_tokens, model.lm_head, model.model.rotary_emb)
            arrays[f"{i}_X"] = X[0].numpy()
            arrays[f"{i}_next"] = nxt[0].numpy()
            arrays[f"{i}_pos"] = pos[0].numpy()
            arrays[f"{i}_scored"] = np.array(rows[i]["scored"])
            arrays[f"{i}_logits"] = logits[0].numpy()
            arrays[f"{i}_streams"] = streams[0].numpy()
            arrays[f"{i}_tokens"] = np.array(examples[i]["prompt"] + examples[i]["answer"])
    np.savez(path, which=np.array(which), **arrays)


# ---- ds4f's own checks (the project venv) -----------------------------------------------------------
def spec_runs(out: Path, specs=("off", 1, 2, 3), examples=None, log=print) -> dict:
    """Every conversation (or `examples`' indices) greedy through ds4f's runs under each spec:
    {spec: {"tokens": [ids per conversation], "summary": summed spec figures, "depth": [tries,
    hits] per depth}}. The runs' prompts are the training prompts."""
    mtm = tool_model()
    mtm.import_ds4f()
    import os

    tmp = Path(tempfile.mkdtemp(prefix="ds4f-mtp-check-"))
    for var in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME"):
        os.environ.setdefault(var, str(tmp / var.lower()))
    from ds4f.api import EngineHost, RunConfig, start_run

    script = json.loads((out / mtm.SCRIPT_NAME).read_text())
    convs = mtm.conversations(script)
    exs = load_examples(out)
    idx = list(range(len(convs))) if examples is None else list(examples)
    host = EngineHost()
    res = {}
    try:
        for spec in specs:
            got, sums, tries, hits = [], {}, [0, 0, 0, 0], [0, 0, 0, 0]
            for i in idx:
                conv, e = convs[i], exs[i]
                run = start_run(RunConfig(model=str(out), messages=tuple(conv["messages"]), thinking=conv["thinking"],
                                          tools=tuple(script["tools"]), gen=len(e["answer"]) + 8, stop_at_eos=True,
                                          probe_floor=False, dump_path=str(tmp / f"{spec}-{i}.bin"),
                                          reuse_prefix=False, kernel_threads=1, io_threads=1, spec=spec),
                                engines=host)
                assert run.wait(300), "run did not finish"
                assert run.state == "done", run.error
                assert list(run.prompt) == e["prompt"], conv["name"]
                got.append(list(run.generated_ids))
                sp = run.report["summary"]["spec"]
                if spec != "off":
                    assert sp["active"], sp
                    for key in ("rounds", "drafted", "accepted", "tokens", "plain_steps"):
                        sums[key] = sums.get(key, 0) + sp[key]
                    for d, (judged, kept) in sp["by_depth"].items():     # drafts judged / kept per depth
                        tries[int(d)] += judged
                        hits[int(d)] += kept
            entry = {"tokens": got}
            if spec != "off":
                entry["summary"] = dict(sums, acceptance=round(sums["accepted"] / sums["drafted"], 4),
                                        tokens_per_round=round(sums["tokens"] / sums["rounds"], 4),
                                        tokens_per_step=round((sums["tokens"] + sums["plain_steps"])
                                                              / (sums["rounds"] + sums["plain_steps"]), 4))
                entry["depth"] = {str(d): {"judged": tries[d], "kept": hits[d],
                                           "acceptance": round(hits[d] / tries[d], 4) if tries[d] else None}
                                  for d in range(1, int(spec) + 1)}
                log(f"spec {spec}: {entry['summary']} per depth {entry['depth']}")
            res[str(spec)] = entry
    finally:
        host.close()
    return res


def check_reference(out: Path, dump: Path, log=print) -> dict:
    """The dumped torch logits against ReferenceMtp (float64) and the engine's MTP layer on the
    same rows; the engine's own main streams against the dumped ones; MtpDrafter's first drafts
    on the answer rows against the torch argmax."""
    tool_model().import_ds4f()
    import numpy as np

    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.config import load_config
    from ds4f.engine.engine import Engine
    from ds4f.engine.model.reference import ReferenceMtp
    from ds4f.engine.speculative import MtpDrafter

    d = np.load(dump)
    ck = open_checkpoint(out)
    eng = Engine(ck, load_config(None).get_preset("laptop"), 1, 1, "scalar")
    g = eng.geometry
    N = g.attention.hc_mult
    layer = eng.mtp_layer()
    worst = {"torch_vs_reference": 0.0, "engine_vs_reference": 0.0, "torch_streams_vs_engine_streams": 0.0,
             "max_abs_logit": 0.0}
    same_argmax = rows_checked = draft_same = drafts = 0
    for i in d["which"].tolist():
        X, nxt, pos, scored = d[f"{i}_X"], d[f"{i}_next"], d[f"{i}_pos"], d[f"{i}_scored"]
        want, tokens = d[f"{i}_logits"], d[f"{i}_tokens"].tolist()
        m = int(len(scored))
        ref = ReferenceMtp(ck)
        state = layer.new_state(4096)
        # the engine's main streams over the whole sequence, and its drafter told each row
        s = eng.new_session()
        drafter = MtpDrafter(layer, s.context)
        s.enable_drafts(drafter)
        lo = int(pos[0])
        first_scored = lo + int(np.argmax(scored))
        engine_X = {}
        for p, t in enumerate(tokens[:-1]):
            if p == first_scored + 1 or (p > first_scored + 1 and p < lo + m + 1):
                dr = drafter.draft(1, p, t)           # from main row p - 1 and token t: predicts tokens[p + 1]
                drafts += 1
                draft_same += dr == [int(np.argmax(want[p - 1 - lo]))]
            r = s.step(t)
            engine_X[p] = r.hidden[-1].reshape(N, g.hidden).copy()
        for c in range(m):
            j = int(pos[c])
            lg_ref, _ = ref.step(X[c], int(nxt[c]), j)
            lg_eng, _ = layer.rows(state, X[c][None].astype(np.float32), [int(nxt[c])], j)
            worst["max_abs_logit"] = max(worst["max_abs_logit"], float(np.abs(lg_ref).max()))
            worst["torch_streams_vs_engine_streams"] = max(worst["torch_streams_vs_engine_streams"],
                                                          float(np.abs(engine_X[j] - X[c]).max()))
            if scored[c]:
                rows_checked += 1
                worst["torch_vs_reference"] = max(worst["torch_vs_reference"], float(np.abs(want[c] - lg_ref).max()))
                worst["engine_vs_reference"] = max(worst["engine_vs_reference"], float(np.abs(lg_eng[0] - lg_ref).max()))
                same_argmax += int(np.argmax(want[c])) == int(np.argmax(lg_ref))
    res = {k: float(f"{v:.3g}") for k, v in worst.items()}
    res.update(rows=rows_checked, argmax_same=same_argmax, drafter_first_drafts=drafts,
               drafter_same_as_torch=draft_same, conversations=[int(i) for i in d["which"]])
    log(f"reference: {res}")
    return res


def check(out: Path, dump: Path | None, log=print) -> int:
    record_path = out / RECORD
    record = json.loads(record_path.read_text())
    facts = {}
    if dump is not None:
        facts["reference"] = check_reference(out, dump, log)
    runs = spec_runs(out, log=log)
    exs = load_examples(out)
    plain = runs["off"]["tokens"]
    facts["plain_exact"] = sum(t == e["answer"] for t, e in zip(plain, exs))
    facts["conversations"] = len(exs)
    facts["same_tokens_as_plain"] = {k: v["tokens"] == plain for k, v in runs.items() if k != "off"}
    facts["spec"] = {k: {"summary": v["summary"], "depth": v["depth"]} for k, v in runs.items() if k != "off"}
    log(json.dumps(facts, indent=1))
    record["ds4f"] = facts
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(facts["same_tokens_as_plain"].values()) else 1


# ---- main -------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--dump", type=Path, help="training: write some conversations' rows and logits here; "
                                              "--check: compare them with ds4f's reference and engine")
    ap.add_argument("--check", action="store_true", help="ds4f's checks of the written layer (project venv)")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.check:
        return check(out, args.dump, log)

    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(1)
    t_start = time.time()
    examples = load_examples(out)
    model, cfg, fields = load_main(out)
    for p in model.parameters():
        p.requires_grad_(False)
    streams, ok = main_streams(model, examples)
    assert ok, "the main model does not give the answers: is model.safetensors the fixture's?"
    rows = mtp_rows(examples, streams, cfg.sliding_window)
    log(f"{len(examples)} conversations, {sum(sum(r['scored']) for r in rows)} answer rows, "
        f"{sum(len(r['pos']) for r in rows)} rows run ({time.time() - t_start:.0f} s)")
    torch.manual_seed(args.seed)
    mtp = make_mtp(cfg).to(torch.float32)
    init_mtp(mtp, model)
    hist = train(mtp, model, rows, args.seed, log)
    fp32 = top1(mtp.eval(), model, rows)
    official, deq = quantise_mtp(mtp, fields)
    load_deq(mtp, deq)
    quant = top1(mtp.eval(), model, rows)
    log(f"fp32 {fp32}; quantised {quant}")
    if quant["rate"] < MIN_TOP1_QUANTISED:
        raise SystemExit(f"the quantised layer's top-1 is {quant['rate']}: nothing written")
    write_shard(out, official)
    if args.dump:
        dump_rows(args.dump, mtp, model, examples, rows, [0, len(examples) - 1])
    facts = {
        "generator": "tools/make_mtp_layer.py", "seed": args.seed, "steps": hist["steps"],
        "final_loss": hist["loss"], "top1_fp32": fp32, "top1_quantised": quant,
        "rows": "the rows that draft an answer token (main row j, token j + 1 -> token j + 2, j from the last "
                "prompt row but one)",
        "init": "block = the main model's last layer, hc_head / norm = the main model's, enorm / hnorm ones, "
                "e_proj / h_proj identity",
        "lr": LR, "warmup": WARMUP, "clip": CLIP, "target_top1": TARGET_TOP1,
        "reference": f"transformers {transformers.__version__} DeepseekV4DecoderLayer (sliding window, learned "
                     f"gate) + MTP projections, fp32, eager; torch {torch.__version__} (1 thread); numpy {np.__version__}",
        "shard": MTP_SHARD, "tensors": len(official), "shard_bytes": (out / MTP_SHARD).stat().st_size,
        "wall_seconds": round(time.time() - t_start, 1), "evals": hist["evals"],
    }
    (out / RECORD).write_text(json.dumps(facts, indent=1) + "\n")
    log(f"wrote {out / MTP_SHARD} ({facts['shard_bytes']} bytes, {len(official)} tensors), {INDEX_NAME}, {RECORD} "
        f"in {facts['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
