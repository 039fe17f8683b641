"""A run's artifacts on real files: state.bin and report.json come as a consistent pair whatever
point the process dies at, a failed run leaves nothing and says why, and `ds4f convert` never
leaves a directory that looks complete but is not."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds4f.engine.checkpoint.verify import verify_checkpoint
from ds4f.errors import Ds4fError
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run
from ds4f.runs.statedump import (StateWriter, pair_problem, partial_path, read_routing,
                                   read_state)

KILLS = 15
GEN = 150   # tokens of a killed run: long enough that most kills land while it writes


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "ds4f.cli", *map(str, args)]


def run_in(model, dump: Path | None, gen: int = 4, prompt=(0, 17), **kw):
    """A run to its end; dump None: the default place, <data dir>/runs/<id>/."""
    run = start_run(RunConfig(model=str(model), gen=gen, prompt=prompt, backend="scalar", probe_floor=False,
                              dump_path=str(dump) if dump is not None else None, **kw))
    assert run.wait(120), "run did not finish"
    return run


def leftovers(place: Path) -> list[str]:
    return sorted(p.name for p in place.iterdir() if p.name.endswith(".partial"))


def pair_view(dump: Path, report: Path) -> tuple[str | None, dict | None]:
    """(sha256 of the state or None, the report or None)."""
    state = sha(dump) if dump.exists() else None
    rep = json.loads(report.read_text()) if report.exists() else None
    return state, rep


# ---- kill -9 at any point -----------------------------------------------------------------------
def spread(i: int, lo: float, hi: float) -> float:
    """The i-th of KILLS moments spread evenly over [lo, hi] (the same moments every time)."""
    return lo + (hi - lo) * (i + 0.5) / KILLS


def test_kill_9_during_a_run_never_leaves_a_new_state_with_an_old_report(tiny_model, tmp_path):
    """`ds4f run` killed with SIGKILL at moments spread from its start-up to past its end, again and again in the same place: after
    each kill the place holds the previous pair, or the new pair (the report's state_sha256 is the
    state's), or a new report whose state never landed, which every reader refuses. Never a new
    state beside an old report. The next run there removes what the killed ones left."""
    place = tmp_path / "place"
    dump, report = place / "a.bin", place / "a.report.json"
    t0 = time.monotonic()
    done = subprocess.run(cli("run", tiny_model, "--gen", GEN, "--no-probe", "--prompt", "0,1",
                              "--dump-state", dump), capture_output=True, text=True, timeout=120)
    full = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    seen = {"old pair": 0, "new pair": 0, "uncommitted report": 0, "partial files": 0}
    for i in range(KILLS):
        old_state, old_report = pair_view(dump, report)
        # a prompt of its own per iteration: each run's state differs from the one before
        proc = subprocess.Popen(cli("run", tiny_model, "--gen", GEN, "--no-probe", "--prompt", f"0,{i + 2}",
                                    "--dump-state", dump, "--force"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(spread(i, 0.2 * full, 1.1 * full))   # from the start-up to past the end
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        state, rep = pair_view(dump, report)
        seen["partial files"] += bool(leftovers(place))
        why = f"kill {i}: state {state}, report {rep and rep['run_id']}"
        if state != old_state:   # a new state: its report is new and names it
            assert state is not None and rep is not None, why
            assert rep["run_id"] != (old_report or {}).get("run_id") and rep["state_sha256"] == state, why
            seen["new pair"] += 1
        elif rep is not None and rep != old_report:   # a new report whose state did not land: not done
            assert rep["state_sha256"] != state, why
            assert pair_problem(dump) is not None, why
            if state is not None:
                with pytest.raises(Ds4fError, match="not a finished run"):
                    read_state(dump)
            seen["uncommitted report"] += 1
        else:
            assert rep == old_report, why
            seen["old pair"] += 1
        if rep is not None and state is not None and rep["state_sha256"] == state:
            assert read_state(dump).sha256 == state
    # the next run in the same place ends done, with nothing of the killed ones left
    final = subprocess.run(cli("run", tiny_model, "--gen", "5", "--no-probe", "--dump-state", dump, "--force"),
                           capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stderr
    assert leftovers(place) == [] and sorted(p.name for p in place.iterdir()) == ["a.bin", "a.report.json"]
    state, rep = pair_view(dump, report)
    assert rep["state_sha256"] == state and rep["state_nbytes"] == dump.stat().st_size
    assert pair_problem(dump) is None
    print(f"kills: {seen}")


def test_a_half_committed_pair_is_not_done_anywhere_and_the_next_run_removes_it(tiny_model, tmp_path):
    """The instant between the report's rename and the state's, frozen: a new report beside the
    old state. read_state, `ds4f diff` and the server's check refuse the dump; the next run in the
    place removes the pair and the leftovers and ends done."""
    dump, report = tmp_path / "a.bin", tmp_path / "a.report.json"
    first = run_in(tiny_model, dump, prompt=(0, 5))
    assert first.state == "done"
    old_sha = sha(dump)
    # what a second run had written when it was killed: its state and report as .partial, the report renamed
    w = StateWriter(dump, first.report["geometry"], [0, 6], 1, report_path=report)
    s = read_state(dump)
    w.write(0, 1, "scalar", s.records["ids"][0], s.records["weights"][0], s.records["hidden"][0] * 2)
    new_sha = w.close()
    doc = dict(first.report, run_id="interrupted", state_sha256=new_sha, state_nbytes=w.nbytes)
    w.report_tmp.write_text(json.dumps(doc))
    os.replace(w.report_tmp, report)
    w._release()                             # the killed process's lock goes with it
    assert partial_path(dump).exists() and sha(dump) == old_sha
    problem = pair_problem(dump)
    assert problem and str(dump) in problem and "not a finished run" in problem
    with pytest.raises(Ds4fError, match="not a finished run"):
        read_state(dump)
    out = subprocess.run(cli("diff", dump, dump), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not a finished run" in out.stderr and "Traceback" not in out.stderr
    # a stray report .partial too, as a kill during the report's writing leaves
    partial_path(report).write_text("{")
    again = run_in(tiny_model, dump, prompt=(0, 7))
    assert again.state == "done", again.error
    assert any("half-committed" in e for e in again.snapshot().events), again.snapshot().events
    assert leftovers(tmp_path) == []
    assert json.loads(report.read_text())["state_sha256"] == sha(dump) == again.report["state_sha256"]
    assert read_routing(dump).shape[0] == again.n_steps


def test_a_place_a_live_writer_holds_is_refused(tiny_model, tmp_path):
    dump = tmp_path / "a.bin"
    first = run_in(tiny_model, dump)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    w = StateWriter(dump, first.report["geometry"], [0], 1, report_path=tmp_path / "a.report.json")
    try:
        run = run_in(tiny_model, dump)
        assert run.state == "failed" and "another run is writing" in run.error and str(dump) in run.error
        assert partial_path(dump).exists()          # the live writer's file is untouched
    finally:
        w.abort()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_run_in_the_default_place_sweeps_what_killed_runs_left(tiny_model, tmp_path):
    """Runs without --dump-state get a directory each under <data dir>/runs. A run killed there
    leaves its .partial files; the next run removes them (and the directory), once they are a
    minute old and unlocked, and leaves finished runs and live writers alone."""
    from ds4f.paths import user_data_dir

    runs = user_data_dir() / "runs"
    before = set(runs.iterdir()) if runs.is_dir() else set()
    err = tmp_path / "stderr.txt"
    with open(err, "w") as ef:
        proc = subprocess.Popen(cli("run", tiny_model, "--gen", "8000", "--no-probe"), stdout=subprocess.DEVNULL,
                                stderr=ef)
        try:
            _wait_for(lambda: "token    3/" in err.read_text())
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
    (killed,) = set(runs.iterdir()) - before
    assert (killed / "state.bin.partial").exists()
    half = runs / "19990101-000000-half"       # killed between the report's rename and the state's
    half.mkdir(parents=True)
    (half / "report.json").write_text("{}")
    (half / "state.bin.partial").write_bytes(b"x")
    live = runs / "19990101-000000-live"       # a writer in another process, still at work
    writer = StateWriter(live / "state.bin", {"num_hidden_layers": 1, "num_experts_per_tok": 1, "hidden_size": 1},
                         [0], 1)
    finished = run_in(tiny_model, None, prompt=(0, 3))
    assert finished.state == "done", finished.error
    old = time.time() - 3600
    try:
        for d in (killed, half, live):
            for p in d.iterdir():
                os.utime(p, (old, old))
        run = run_in(tiny_model, None, prompt=(0, 4))
        assert run.state == "done", run.error
        assert not killed.exists() and not half.exists()
        assert any(str(killed) in e for e in run.snapshot().events), run.snapshot().events
        assert (live / "state.bin.partial").exists()
        assert sorted(p.name for p in finished.dump_path.parent.iterdir()) == ["report.json", "state.bin"]
        assert read_state(finished.dump_path).sha256 == finished.report["state_sha256"]
    finally:
        writer.abort()
        shutil.rmtree(live, ignore_errors=True)


def test_kill_9_during_convert_never_leaves_an_incomplete_checkpoint(tiny_official, tmp_path):
    """`ds4f convert --force` killed with SIGKILL at moments spread over its work: under the final name there is
    nothing or a checkpoint `ds4f verify` passes; the next convert removes the hidden leftovers."""
    parent = tmp_path / "out"
    dst = parent / "ck"
    t0 = time.monotonic()
    done = subprocess.run(cli("convert", tiny_official, dst), capture_output=True, text=True, timeout=120)
    full = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    for i in range(KILLS):
        proc = subprocess.Popen(cli("convert", tiny_official, dst, "--force"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(spread(i, 0.0, full * 1.1))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        if dst.exists():
            assert verify_checkpoint(dst) == [], f"kill {i}"
        others = [p.name for p in parent.iterdir() if p.name != "ck"]
        assert all(n.startswith(".ck.") for n in others), others   # only hidden temporary siblings
    out = subprocess.run(cli("convert", tiny_official, dst, "--force"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [p.name for p in parent.iterdir()] == ["ck"]
    out = subprocess.run(cli("verify", dst), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


# ---- a failed run leaves nothing and says why ---------------------------------------------------------
def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], capture_output=True)


def test_an_unwritable_dump_directory_fails_the_run_and_leaves_nothing(tiny_model, tmp_path):
    place = tmp_path / "locked"
    place.mkdir()
    place.chmod(0o555)
    try:
        if os.access(place, os.W_OK):
            pytest.skip("chmod does not stop this user (root) from writing")
        run = run_in(tiny_model, place / "a.bin")
        assert run.state == "failed" and str(place / "a.bin") in run.error and "permission denied" in run.error
        assert list(place.iterdir()) == []
    finally:
        place.chmod(0o755)


def test_a_dump_path_under_a_file_fails_the_run(tiny_model, tmp_path):
    (tmp_path / "file").write_text("x")
    run = run_in(tiny_model, tmp_path / "file" / "a.bin")
    assert run.state == "failed" and str(tmp_path / "file") in run.error and "Traceback" not in run.error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_read_only_file_system_fails_the_run_and_leaves_nothing(tiny_model, tmp_path):
    ro = tmp_path / "ro"
    if not _mount_tmpfs(ro, "ro,size=64k"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount)")
    try:
        run = run_in(tiny_model, ro / "a.bin")
        assert run.state == "failed" and str(ro / "a.bin") in run.error and "read-only" in run.error, run.error
        assert list(ro.iterdir()) == []
    finally:
        _umount(ro)


@pytest.mark.parametrize("room", ["none", "state only"])
def test_a_full_disk_fails_the_run_naming_the_file_and_leaves_nothing(tiny_model, tmp_path, room):
    """ENOSPC on a 1 MiB tmpfs filled up but for a little room: none at all, or enough for the state
    dump but not the report. The run ends failed, naming the file and 'no space'; no files stay."""
    sizes = run_in(tiny_model, tmp_path / "probe" / "a.bin", gen=40)
    state_nbytes = sizes.report["state_nbytes"]
    report_nbytes = (tmp_path / "probe" / "a.report.json").stat().st_size
    assert report_nbytes > 8192
    small = tmp_path / "small"
    if not _mount_tmpfs(small, "size=1m"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount)")
    try:
        st = os.statvfs(small)
        page = st.f_frsize
        leave = 0 if room == "none" else -(-state_nbytes // page) * page + page
        with open(small / "filler", "wb") as f:
            f.write(b"\0" * (st.f_bavail * page - leave))
        run = run_in(tiny_model, small / "a.bin", gen=40)
        assert run.state == "failed", run.state
        which = "a.bin" if room == "none" else "a.report.json"
        assert str(small / which) in run.error and "no space" in run.error, run.error
        assert sorted(p.name for p in small.iterdir()) == ["filler"]
        # the same from the CLI: one line naming the file, exit 2
        out = subprocess.run(cli("run", tiny_model, "--gen", "40", "-p", "0,17", "--no-probe", "--dump-state",
                                 small / "a.bin"),  # the same run: the same state size
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "no space" in out.stderr and str(small / which) in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        assert sorted(p.name for p in small.iterdir()) == ["filler"]
    finally:
        _umount(small)


# ---- signals and pipes --------------------------------------------------------------------------------
def _wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_sigterm_cancels_a_cli_run_like_ctrl_c(tiny_model, tmp_path):
    place = tmp_path / "place"
    err = tmp_path / "stderr.txt"
    with open(err, "w") as ef:
        proc = subprocess.Popen(cli("run", tiny_model, "--gen", "8000", "--no-probe", "--dump-state",
                                    place / "a.bin"), stdout=subprocess.DEVNULL, stderr=ef)
        try:
            _wait_for(lambda: "token    3/" in err.read_text())
            assert partial_path(place / "a.bin").exists()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = err.read_text()
    assert rc in (130, 143), text
    assert "cancelled" in text and "Traceback" not in text
    assert list(place.iterdir()) == []


def test_a_closed_stdout_pipe_leaves_a_pair_or_nothing(tiny_model, tmp_path):
    """`ds4f run ... | head -c1`, and a reader that left before the run ended: no partial files,
    and what is there is a consistent pair."""
    place = tmp_path / "place"
    dump = place / "a.bin"
    cmd = " ".join(f"'{a}'" for a in cli("run", tiny_model, "--gen", "6", "--no-probe", "--dump-state", dump))
    out = subprocess.run(f"{cmd} 2>/dev/null | head -c1", shell=True, capture_output=True, timeout=120)
    assert len(out.stdout) == 1
    proc = subprocess.Popen(cli("run", tiny_model, "--gen", "6", "--no-probe", "--dump-state", dump, "--force"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()   # the reader is gone before the run prints anything
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    proc.stderr.close()
    assert rc in (0, 141) and "Traceback" not in err, err
    assert leftovers(place) == []
    state, rep = pair_view(dump, place / "a.report.json")
    assert rep is not None and rep["state_sha256"] == state


@pytest.mark.parametrize("how", ["gen1-chunked", "gen1-token-by-token", "stop-first"])
def test_a_run_that_ends_after_its_first_token_is_done_with_its_files(tiny_model, tmp_path, how):
    """One generated token after a prompt of several, or an answer that ends at its first token
    (a stop string in its text): a done run, its report and dump a matching pair, a summary with no
    warm-token speed rather than an internal error."""
    from ds4f.engine.text import Tokenizer

    tok = Tokenizer.load(tiny_model)
    text = "Hello there, keeper"
    kw = dict(prompt=(tok.bos_id, *tok.encode(text)), gen=1)
    if how == "gen1-token-by-token":
        kw["prefill_chunk"] = 0
    if how == "stop-first":      # the first token's text as a stop string: the answer ends before it
        for i, text in enumerate(("Hello there, keeper", "Once upon a time", "The sea", "A walk", "Notes on")):
            probe = run_in(tiny_model, tmp_path / f"probe{i}.bin", gen=1, prompt=None, text=text)
            assert probe.state == "done", probe.error
            first = probe.report["generated"][0]
            if "\ufffd" not in tok.decode([first]) and tok.decode([first]).strip():
                break
        else:
            pytest.fail("no probe prompt whose first answer token is whole text")
        kw = dict(prompt=None, text=text, gen=5, stop=(tok.decode([first]),))
    dump = tmp_path / "one.bin"
    run = run_in(tiny_model, dump, **kw)
    assert run.state == "done", run.error
    assert run.generated_tokens == 1 and run.finish_reason == ("stop" if how == "stop-first" else "length")
    report = run.report
    assert report["state_sha256"] == sha(dump) and pair_problem(dump) is None
    assert any(" done: " in e for e in run.snapshot().events) and run.error is None
