"""`ds4f plan`: the memory plan of a geometry under a preset, and the preset's cache limit."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from ds4f.engine.batch import batched_chunk, step_rows
from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.config import AUTO_CHUNK, Budget, load_config
from ds4f.engine.model.attention import KVCache, attention_shapes
from ds4f.engine.model.forward import ChunkBuffers, transient_nbytes
from ds4f.errors import Ds4fError
from ds4f.engine.model.geometry import GEOMETRIES
from ds4f.runs.plan import AUTO_CHUNKS, OS_HEADROOM, RESIDENT_CHUNK, chunk_that_fits, memory_plan
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run
from ds4f.settings import load_settings


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", "plan", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_the_real_model_fits_a_24gb_laptop_with_the_laptop_preset(tmp_path):
    laptop = load_config().get_preset("laptop")
    plan = memory_plan(GEOMETRIES["flash"], laptop, 24 << 30)
    assert plan.fits and plan.total_bytes + OS_HEADROOM <= 24 << 30
    assert plan.total_bytes == sum(plan.resident.values()) + plan.kv_bytes + plan.cache_bytes
    # the reference figures of the released model: ~5.5 GB of attention weights as shipped,
    # embed + head ~1.97 GiB, 3.45 GB of routed experts per token
    assert 5.0e9 < plan.resident["attention and hyper-connections"] < 6.0e9
    assert abs(plan.resident["globals (embed, head, final norm)"] / 2**30 - 1.97) < 0.01
    assert abs(plan.routed_bytes_per_token / 1e9 - 3.45) < 0.05
    assert plan.cache_bytes <= 12 << 30 < plan.pool_bytes * 0.25   # the limit holds, not the 25%
    out = _cli("--geometry", "real", "--ram", "24GiB", "--preset", "laptop", cwd=tmp_path)
    assert out.returncode == 0 and "fits:" in out.stdout, out.stdout + out.stderr
    rows = json.loads(_cli("--geometry", "real", "--ram", "24GiB", "-o", "json", cwd=tmp_path).stdout)
    assert {r["part"]: r["bytes"] for r in rows["resident"]}["KV cache"] == plan.kv_bytes
    small = _cli("--geometry", "real", "--ram", "8GiB", "--preset", "laptop", cwd=tmp_path)
    assert small.returncode == 1 and "does NOT fit" in small.stdout
    bad = _cli("--ram", "25%", cwd=tmp_path)
    assert bad.returncode == 2 and "--ram" in bad.stderr and "Traceback" not in bad.stderr


def test_the_plan_is_what_a_run_allocates(tiny_model, tmp_path):
    preset = load_config().get_preset("laptop")
    with open_checkpoint(tiny_model) as ck:
        plan = memory_plan(ck.geometry, preset, 24 << 30)
    run = start_run(RunConfig(model=str(tiny_model), gen=2, preset="laptop", probe_floor=False,
                              dump_path=str(tmp_path / "a.bin")))
    assert run.wait(120) and run.state == "done", run.error
    s = run.report["summary"]
    assert s["kv_bytes"] == plan.kv_bytes and run.report["cache"]["budget_bytes"] == plan.cache_bytes


def test_a_cache_limit_caps_the_cache_and_must_be_a_size(tiny_model, tmp_path):
    (tmp_path / "ds4f.toml").write_text('[presets.small]\npinned_layers = "all"\ncache = "100%"\n'
                                        'cache_limit = "1 MiB"\n')
    run = start_run(RunConfig(model=str(tiny_model), gen=2, preset="small", probe_floor=False,
                              config_path=str(tmp_path / "ds4f.toml"), dump_path=str(tmp_path / "a.bin")))
    assert run.wait(120) and run.state == "done", run.error
    assert run.report["cache"]["budget_bytes"] <= 1 << 20
    (tmp_path / "bad.toml").write_text('[presets.small]\npinned_layers = "all"\ncache_limit = "10%"\n')
    with pytest.raises(Ds4fError, match=r"presets\.small\.cache_limit: a size like '12 GiB'"):
        load_config(tmp_path / "bad.toml")


@pytest.mark.parametrize("geometry", ["tiny", "bench", "flash"])
def test_the_plan_for_several_sequences_counts_what_the_batch_allocates(geometry):
    """N sequences decoded together: N KV caches and batched prompt chunks, and the batched
    step's buffers, as the engine allocates them (engine.batch)."""
    g = GEOMETRIES[geometry]
    laptop = load_config().get_preset("laptop")
    one = memory_plan(g, laptop, 24 << 30)
    four = memory_plan(g, laptop, 24 << 30, parallel=4)
    kv = KVCache.nbytes_for(attention_shapes(g.attention, g.rms_norm_eps), laptop.context)
    assert one.kv_bytes == kv and four.kv_bytes == 4 * kv
    planned = four.preset.prefill_chunk          # the preset's "auto" as the plan chose it
    assert planned in AUTO_CHUNKS and four.auto_chunk
    chunk = batched_chunk(planned)
    assert chunk == min(64, planned)
    per = ChunkBuffers.nbytes_for(g, chunk) + transient_nbytes(g, chunk)
    assert four.sequence_bytes == kv + per
    step = [v for k, v in four.resident.items() if k.startswith("batched step")]
    rows = step_rows(4, planned)
    assert step == [ChunkBuffers.nbytes_for(g, rows) + transient_nbytes(g, rows)]
    if geometry == "tiny":    # the step's buffers as allocated
        assert ChunkBuffers(g, rows).nbytes == ChunkBuffers.nbytes_for(g, rows)
    # how many fit: that many do, one more does not (with a RAM that makes it matter)
    small = dataclasses.replace(laptop, context=1 << 20) if geometry == "tiny" else laptop
    ram = 8 << 30
    fit = memory_plan(g, small, ram, parallel=2).sequences_fit
    if 2 <= fit < 64:
        assert memory_plan(g, small, ram, parallel=fit).fits
        assert not memory_plan(g, small, ram, parallel=fit + 1).fits


def test_plan_parallel_prints_the_sequences_and_refuses_nonsense():
    out = _cli("--geometry", "real", "--ram", "24GiB", "--parallel", "4")
    assert out.returncode == 0, out.stderr
    assert "4 sequences decoded together" in out.stdout and "KV caches (4 sequences)" in out.stdout
    assert "sequences fit" in out.stdout
    bad = _cli("--parallel", "0")
    assert bad.returncode != 0 and "--parallel" in bad.stderr and "between 1 and" in bad.stderr
    big = _cli("--geometry", "real", "--ram", "24GiB", "--parallel", "64")
    assert big.returncode == 1 and "does NOT fit" in big.stdout


def test_server_parallel_in_the_config(tmp_path):
    path = tmp_path / "ds4f.toml"
    path.write_text("[server]\nparallel = 3\n")
    assert load_settings(str(path)).server.parallel == 3
    assert load_settings(None).server.parallel == 0       # auto
    for bad in ("-1", "65", '"four"'):
        path.write_text(f"[server]\nparallel = {bad}\n")
        with pytest.raises(Ds4fError, match="server.parallel"):
            load_settings(str(path))


def test_the_plan_with_speculation_counts_what_the_mtp_layer_holds(tmp_path):
    """--spec: the MTP layer's block, expert slots and buffers, and one sequence's drafter, as an
    engine that loaded it and a drafter hold them; without the layer's experts (read as needed)."""
    from ds4f.engine.checkpoint.synth import synth_checkpoint
    from ds4f.engine.engine import Engine
    from ds4f.engine.speculative import MtpDrafter
    from ds4f.runs.plan import mtp_nbytes

    preset = load_config().get_preset("laptop")
    with open_checkpoint(synth_checkpoint(tmp_path / "mtp", "tiny", seed=0, mtp=True)) as ck:
        eng = Engine(ck, preset, 2, 1, "scalar")
        try:
            layer = eng.mtp_layer()
            held = eng.mtp_nbytes + MtpDrafter(layer, preset.context).nbytes
        finally:
            eng.close()
        g = ck.geometry
    assert abs(mtp_nbytes(g, preset.context) - held) <= 0.02 * held    # norms: bf16 shipped, fp32 held
    with_spec, without = (memory_plan(g, preset, 24 << 30, spec=s) for s in (True, False))
    assert with_spec.total_bytes - without.total_bytes == mtp_nbytes(g, preset.context)
    real = memory_plan(GEOMETRIES["flash"], preset, 24 << 30, spec=True)
    mtp = [n for k, n in real.resident.items() if k.startswith("MTP layer")]
    # the released layer is ~3.6 GB, 3.42 GB of it routed experts; a round's 24 expert slots
    assert len(mtp) == 1 and 0.15e9 + 24 * 12.7e6 < mtp[0] < 0.3e9 + 24 * 13.5e6
    out = _cli("--geometry", "real", "--ram", "24GiB", "--spec", cwd=tmp_path)
    assert "MTP layer" in out.stdout and "speculative decoding" in out.stdout, out.stdout + out.stderr


def test_auto_chunk_is_the_largest_that_fits_the_ram():
    """prefill_chunk = "auto": the largest chunk whose plan fits, with the preset's cache as it is;
    one size larger would not fit; the plan counts the chunk it chose, and says so."""
    g = GEOMETRIES["flash"]
    server = dataclasses.replace(load_config().get_preset("server"), prefill_chunk=AUTO_CHUNK)
    seen = set()
    for ram_gib in (120, 128, 140, 192):
        ram = ram_gib << 30
        chosen = chunk_that_fits(g, server, ram).prefill_chunk
        seen.add(chosen)
        plan = memory_plan(g, server, ram)
        assert plan.fits and plan.auto_chunk and plan.preset.prefill_chunk == chosen
        assert any(k.startswith(f"prefill chunk ({chosen} tokens, the largest that fits") for k in plan.resident)
        assert sum(v for k, v in plan.resident.items() if k.startswith("prefill chunk")) == \
            ChunkBuffers.nbytes_for(g, chosen) + transient_nbytes(g, chosen)
        larger = [c for c in AUTO_CHUNKS if c > chosen]
        if larger:     # the next size up does not fit this RAM
            assert not memory_plan(g, dataclasses.replace(server, prefill_chunk=min(larger)), ram).fits
    assert len(seen) > 1                     # the RAM decides
    # too little RAM for anything: the smallest size, and the plan says it does not fit
    tiny_ram = memory_plan(g, dataclasses.replace(server, prefill_chunk=0), 64 << 30)
    assert not tiny_ram.fits
    assert chunk_that_fits(g, server, 64 << 30).prefill_chunk == AUTO_CHUNKS[-1]
    # nothing read (every layer pinned, the whole pool cached): the chunk's size saves no reads, and
    # the largest that fits up to RESIDENT_CHUNK is taken
    resident = dataclasses.replace(server, pinned_layers="all", cache=Budget(fraction=1.0), cache_limit=None)
    for ram_gib in (192, 256, 1024):
        chosen = chunk_that_fits(g, resident, ram_gib << 30).prefill_chunk
        assert chosen == max(c for c in AUTO_CHUNKS if c <= RESIDENT_CHUNK
                             and memory_plan(g, dataclasses.replace(resident, prefill_chunk=c), ram_gib << 30).fits)
    assert chunk_that_fits(g, resident, 1 << 40).prefill_chunk == RESIDENT_CHUNK < AUTO_CHUNKS[0]
    assert chunk_that_fits(g, dataclasses.replace(resident, cache=Budget(fraction=0.99)), 1 << 40).prefill_chunk \
        == AUTO_CHUNKS[0]
    # a fixed chunk is left as it is
    assert chunk_that_fits(g, dataclasses.replace(server, prefill_chunk=512), 1 << 40).prefill_chunk == 512


def test_auto_chunk_in_a_config_and_a_bad_value(tmp_path):
    (tmp_path / "ds4f.toml").write_text('[presets.long]\npinned_layers = "all"\nprefill_chunk = "auto"\n')
    assert load_config(tmp_path / "ds4f.toml").get_preset("long").prefill_chunk == AUTO_CHUNK
    for bad, said in (('"big"', 'or "auto"'), ("-3", 'or "auto"'), ("5000", 'or "auto"'), ("true", "expected int or str")):
        (tmp_path / "bad.toml").write_text(f'[presets.long]\npinned_layers = "all"\nprefill_chunk = {bad}\n')
        with pytest.raises(Ds4fError, match=r'bad\.toml: presets\.long\.prefill_chunk: .*' + said):
            load_config(tmp_path / "bad.toml")


def test_a_run_under_an_auto_chunk_takes_its_prompt_in_one_chunk(tiny_model, tmp_path):
    """A run whose preset says "auto" gets a chunk from this machine's plan (a prompt shorter than
    it in one chunk of its own length), and the same tokens as the prompt token by token."""
    (tmp_path / "ds4f.toml").write_text('[presets.long]\npinned_layers = "all"\ncache = "100%"\n'
                                        'prefill_chunk = "auto"\n')
    prompt = tuple(range(1, 41))
    runs = []
    for chunk in (None, 0):
        run = start_run(RunConfig(model=str(tiny_model), gen=4, preset="long", prompt=prompt, probe_floor=False,
                                  prefill_chunk=chunk, config_path=str(tmp_path / "ds4f.toml"), dump="off"))
        assert run.wait(120) and run.state == "done", run.error
        runs.append(run)
    assert runs[0].prefill_chunk == len(prompt) and runs[1].prefill_chunk == 0
    assert len(runs[0].report["generated"]) == 4 and runs[0].report["generated"] == runs[1].report["generated"]


@pytest.mark.parametrize("dump", ["full", "compact", "off"])
def test_the_plan_shows_each_part_under_its_row_and_the_chunks_records(dump):
    """The attention's dtypes sit under the attention's row, and under the prompt chunk's row the
    share its tokens' records take, by the runs' state dump: per token the routing (top_k ids and
    weights a layer) and, with a full dump, per layer the state after it (hc_mult x hidden floats)
    and the attention output (hidden floats); with a compact one per layer a digest (8 bytes) and
    sketches (6 + 3 floats), and the last layer's state and one layer's attention output, as
    without a dump. Without full records a larger chunk fits the same RAM."""
    out = _cli("--geometry", "flash", "--ram", "24GiB", "--dump", dump, "-o", "csv")
    assert out.returncode == 0, out.stderr
    rows = [line.rsplit(",", 1) for line in out.stdout.splitlines()[2:] if line.strip()]
    names = [name.strip('"') for name, _ in rows]
    att = names.index("attention and hyper-connections")
    assert all(n.startswith("  attention ") for n in names[att + 1:att + 5]) and not names[att + 5].startswith("  ")
    chunk_row = next(i for i, n in enumerate(names) if n.startswith("prefill chunk ("))
    chunk = int(names[chunk_row].split("(")[1].split()[0])
    assert names[chunk_row + 1].startswith("  of it the tokens' records")
    g = GEOMETRIES["flash"]
    width, routing = g.attention.hc_mult * g.hidden, 4 * 2 * g.top_k * g.n_layers
    per_token = {"full": routing + 4 * g.n_layers * (width + g.hidden),
                 "compact": routing + g.n_layers * (8 + 4 * 6 + 4 * 3) + 4 * (width + g.hidden),
                 "off": routing + 4 * (width + g.hidden)}[dump]
    records = int(rows[chunk_row + 1][1])
    assert records == chunk * per_token and records < int(rows[chunk_row][1])
    assert (chunk > 512) == (dump != "full")      # 24 GiB: full records leave room for 512 tokens, the others for more
