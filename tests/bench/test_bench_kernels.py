"""`ds4f bench-kernels`: the memory floor's read loop, page buffers with transparent huge pages,
and the bench's records (structure and self-consistency only: no figure is asserted)."""
from __future__ import annotations

import json
import mmap

import numpy as np
import pytest

from ds4f.native import kernels as K
from ds4f.bench import kernels as B
from ds4f.engine.runtime import memory as M

AVAILABLE = K.available_backends()


# ---- page buffers --------------------------------------------------------------------------------
def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_page_buffer_huge_is_aligned_writable_and_zeroed():
    n = 5 * M.huge_page_size() + 123
    buf, thp = M.page_buffer(n, "huge")
    assert buf.dtype == np.uint8 and buf.shape == (n,) and buf.flags.writeable and buf.flags.c_contiguous
    assert thp == M.thp_available()
    assert _address(buf) % (M.huge_page_size() if thp else mmap.PAGESIZE) == 0
    assert not buf.any()
    buf[:] = 7
    assert int(buf[-1]) == 7 and int(buf.sum(dtype=np.int64)) == 7 * n
    backed = M.huge_page_bytes(buf)
    assert backed is None or 0 <= backed <= n + 2 * M.huge_page_size()


def test_page_buffer_falls_back_without_thp(monkeypatch):
    monkeypatch.setattr(M, "thp_available", lambda: False)
    buf, thp = M.page_buffer(3 * mmap.PAGESIZE + 5, "huge")  # a real allocation, no advice
    assert thp is False
    assert _address(buf) % mmap.PAGESIZE == 0 and buf.size == 3 * mmap.PAGESIZE + 5
    buf[:] = 1
    assert int(buf.sum(dtype=np.int64)) == buf.size


def test_thp_never_means_no_huge_pages(tmp_path, monkeypatch):
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(M, "THP_ENABLED", never)
    assert M.thp_mode() == "never" and not M.thp_available()
    assert M.page_buffer(1 << 20)[1] is False
    monkeypatch.setattr(M, "THP_ENABLED", tmp_path / "missing")
    assert M.thp_mode() is None and not M.thp_available()
    assert M.page_buffer(1 << 20)[0].size == 1 << 20


def test_page_buffer_modes_and_bad_arguments():
    for mode in ("normal", "default"):
        buf, thp = M.page_buffer(10_000, mode)
        assert thp is False and buf.size == 10_000 and _address(buf) % mmap.PAGESIZE == 0
        buf[:] = 3
    assert M.page_buffer(0)[0].size == 0
    with pytest.raises(ValueError, match="pages"):
        M.page_buffer(10, "giant")
    with pytest.raises(ValueError, match="nbytes"):
        M.page_buffer(-1)


def test_warm_buffer_with_and_without_huge_pages():
    for huge in (False, True):
        buf = M.warm_buffer(3 * mmap.PAGESIZE + 1, huge=huge)
        assert buf.size == 3 * mmap.PAGESIZE + 1 and _address(buf) % mmap.PAGESIZE == 0 and buf.flags.writeable
    assert M.warm_buffer(100).size == 100


def test_llc_and_available_bytes():
    llc = M.llc_bytes()
    assert llc is None or llc > 0
    assert M.available_bytes() > 0


# ---- the floor's read loop -----------------------------------------------------------------------
@pytest.mark.parametrize("words", [0, 1, 7, 33, 4096 * 3 + 5, 1 << 18])
def test_mem_read_sums_every_word_on_every_backend_and_thread_count(words):
    data = np.random.default_rng(words).integers(0, 1 << 63, words, dtype=np.uint64) * 3
    want = int(data.sum(dtype=np.uint64)) if words else 0
    saved = K.get_threads()
    try:
        for backend in AVAILABLE:
            for nt in (1, 2, 3):
                K.set_threads(nt)
                assert B.mem_read(data, backend) == want, (backend, nt)
    finally:
        K.set_threads(saved)


def test_mem_read_refuses_bad_buffers():
    buf = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="buf"):
        B.mem_read(buf[:60], "scalar")
    with pytest.raises(ValueError, match="buf"):
        B.mem_read(buf[1:57], "scalar")
    unsupported = [b for b in K.BACKENDS if b not in AVAILABLE]
    if unsupported:
        with pytest.raises(ValueError, match="backend"):
            B.mem_read(buf, unsupported[0])


# ---- the bench's records ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_run():
    """Every kernel that matters here on tiny sizes: an 8 MiB floor, two copies per cold set."""
    notes: list[str] = []
    records = B.run_bench(repeat=1, backends=AVAILABLE, threads=[1, 2],
                          kernels=("memory", "fma", "matvec", "experts", "fp8_matvec"), cases="all", pages="both",
                          floor_bytes=8 << 20, cold_bytes=1, notes=notes)
    return records, notes


def test_memory_records_per_backend_thread_count_and_pages(small_run):
    records, _ = small_run
    memory = [r for r in records if r.kernel == "memory"]
    assert {(r.backend, r.threads, r.pages) for r in memory} == {
        (b, nt, p) for b in AVAILABLE for nt in (1, 2) for p in ("huge", "normal")}
    assert len(memory) == len(AVAILABLE) * 4
    for r in memory:
        assert r.cold and r.working_set_bytes == 8 << 20 and r.gweights_per_s is None and r.gb_per_s > 0
        assert r.gb_per_s == pytest.approx((8 << 20) / r.median_s / 1e9)
    assert records[:len(memory)] == memory  # the floor comes first


@pytest.mark.parametrize("backend", AVAILABLE)
def test_fma_peak_loop_runs_every_multiply_add(backend):
    """The peak loop's 12 chains a = a * (1 - 2^-10) + 2^-10 start at 0.5 and, after 2^21 steps,
    sit at their fixed point 1 (to fp32 rounding): a checksum of 12 x 2^20 per task says that
    every task ran its whole loop (a skipped or shortened one leaves values near 0.5)."""
    saved = K.get_threads()
    try:
        for nt in (1, 2):
            K.set_threads(nt)
            ntasks = 1 if nt == 1 else 4 * nt
            lanes = B.ffi.new("double *")
            check = B.lib.ds4f_fma_peak(K.BACKENDS.index(backend), B.FMA_ITERS, lanes)
            per = {"scalar": 1, "avx2": 8, "avx512": 16, "neon": 4}[backend]
            assert B.lib.ds4f_fma_lanes(K.BACKENDS.index(backend)) == per
            assert lanes[0] == ntasks * B.FMA_ITERS * 12 * per
            assert check == pytest.approx(ntasks * 12 * 2**20, rel=1e-4)
    finally:
        K.set_threads(saved)
    unsupported = [b for b in K.BACKENDS if b not in AVAILABLE]
    if unsupported:
        with pytest.raises(ValueError, match="backend"):
            B.fma_peak(unsupported[0])


def test_fma_peak_records_and_the_wall_each_kernel_stands_at(small_run):
    records, _ = small_run
    peak = {(r.backend, r.threads): r for r in records if r.kernel == "fma"}
    assert set(peak) == {(b, nt) for b in AVAILABLE for nt in (1, 2)}
    for r in peak.values():
        assert r.glanes_per_s > 0 and r.gweights_per_s is None and r.fraction_of_floor is None
    for r in records:
        if r.kernel in ("memory", "fma") or r.backend == "numpy":
            assert r.fraction_of_fma_peak is None and r.wall is None
            continue
        assert r.fraction_of_fma_peak == pytest.approx(r.gweights_per_s / peak[(r.backend, r.threads)].glanes_per_s,
                                                       rel=1e-9)
        assert r.wall == ("memory" if r.fraction_of_floor >= B.MEMORY_WALL else "compute")


def test_fraction_of_floor_is_gb_per_s_over_the_floor(small_run):
    records, _ = small_run
    floor = {(r.backend, r.threads, r.pages): r.gb_per_s for r in records if r.kernel == "memory"}
    kernel_records = [r for r in records if r.kernel not in ("memory", "fma") and r.backend != "numpy"]
    assert kernel_records
    for r in kernel_records:
        pages = r.pages if r.cold else "huge"  # hot cases against the first --pages kind
        assert r.fraction_of_floor == pytest.approx(r.gb_per_s / floor[(r.backend, r.threads, pages)], rel=1e-9)
    for r in records:
        if r.backend == "numpy":
            assert r.fraction_of_floor is None and r.threads == 0


def test_cold_and_hot_cases(small_run):
    records, _ = small_run
    experts = [r for r in records if r.kernel == "experts" and r.backend != "numpy"]
    hot = [r for r in experts if not r.cold]
    cold = [r for r in experts if r.cold]
    assert {(r.backend, r.threads) for r in hot} == {(b, nt) for b in AVAILABLE for nt in (1, 2)}
    assert {(r.backend, r.threads, r.pages) for r in cold} == {
        (b, nt, p) for b in AVAILABLE for nt in (1, 2) for p in ("huge", "normal")}
    for r in hot:
        assert r.pages is None and r.working_set_bytes is None
    for r in cold:
        assert r.working_set_bytes >= 2 * 6 * 3 * 4096 * 2048 * 17 // 32  # two groups of 6 experts
        assert r.speedup_vs_scalar is not None and r.speedup_vs_1thread is not None
    assert all(not r.cold for r in records if r.kernel == "matvec")
    # vs_hot_matvec: experts Gw/s over the hot matvecs' Gw/s in the experts' mix of shapes
    mv = {(r.backend, r.threads, r.shape): r.gweights_per_s for r in records
          if r.kernel == "matvec" and r.backend != "numpy"}
    for r in experts:
        g1, g2 = mv[(r.backend, r.threads, "2048x4096")], mv[(r.backend, r.threads, "4096x2048")]
        assert r.vs_hot_matvec == pytest.approx(r.gweights_per_s * (2 / 3 / g1 + 1 / 3 / g2))


def test_fp8_records_when_the_kernel_exists(small_run):
    records, notes = small_run
    fp8 = [r for r in records if r.kernel == "fp8_matvec"]
    if not hasattr(K, "fp8_matvec"):
        assert not fp8 and any("fp8_matvec" in n for n in notes)
        return
    shapes = {r.shape for r in fp8 if not r.cold}
    assert shapes == {f"{rows}x{k}" for rows, k in B.FP8_SHAPES}
    assert {r.pages for r in fp8 if r.cold and r.backend != "numpy"} == {"huge", "normal"}
    assert all(r.fraction_of_floor is not None for r in fp8 if r.backend != "numpy")


def test_records_are_json(small_run, tmp_path):
    from ds4f.cli.output import write_json

    records, _ = small_run
    path = tmp_path / "r.json"
    write_json([r.to_dict() for r in records], str(path))
    back = json.loads(path.read_text())
    assert len(back) == len(records)
    for r in back:
        assert {"kernel", "backend", "threads", "gb_per_s", "fraction_of_floor", "cold", "pages"} <= set(r)
        assert isinstance(r["cold"], bool)


def test_plan_sizes_cap_and_copies():
    plan = B.plan_sizes(llc=480 << 20)
    assert plan.floor_bytes == min(max(1 << 30, 960 << 20), plan.cap_bytes)
    assert plan.cap_bytes <= B.MEMORY_CAP
    group = 6 * B._expert_slot_nbytes()
    n = plan.copies(group)
    assert n * group > 960 << 20 or n * group + group > plan.cap_bytes
    huge_llc = B.plan_sizes(llc=4 << 30)  # 2x LLC beyond the cap: capped
    assert huge_llc.copies(group) * group <= huge_llc.cap_bytes


def test_run_bench_refuses_bad_options():
    with pytest.raises(ValueError, match="cases"):
        B.run_bench(cases="warm")
    with pytest.raises(ValueError, match="pages"):
        B.run_bench(pages="giant")


# ---- the command ---------------------------------------------------------------------------------
def test_cli_prints_the_floor_first_and_writes_json(tmp_path, capsys):
    from ds4f.cli import main

    path = tmp_path / "bench.json"
    rc = main(["bench-kernels", "--repeat", "1", "--kernels", "memory,matvec", "--cases", "hot", "-t", "1",
               "--pages", "normal", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.index("memory floor") < out.index("ds4f kernels") and "of floor" in out
    assert "NOT" not in out and "target" not in out.lower()
    records = json.loads(path.read_text())
    assert records[0]["kernel"] == "memory" and {r["kernel"] for r in records} == {"memory", "matvec"}
    assert all(r["fraction_of_floor"] is not None for r in records if r["kernel"] == "matvec"
               and r["backend"] != "numpy")

    rc = main(["bench-kernels", "--repeat", "1", "--kernels", "matvec", "--cases", "hot", "-t", "1",
               "--backends", "scalar", "-o", "csv"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("kernel,shape,cold,pages,backend,threads") and "fraction_of_floor" in lines[0]
    with pytest.raises(SystemExit) as exc:
        main(["bench-kernels", "--cases", "warm"])
    assert exc.value.code == 2
