"""The dump a run writes (full, compact, off) and what follows from it: files written, the report,
the history, the refusal of a full dump past [dump] full_limit, and the prefix cache's records."""
from __future__ import annotations

import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.errors import Ds4fError
from ds4f.runs.config import RunConfig
from ds4f.runs.history import History
from ds4f.runs.host import EngineHost
from ds4f.runs.prefix import RECORDS
from ds4f.runs.run import start_run
from ds4f.runs.statedump import read_state, record_nbytes
from ds4f.settings import load_settings

Q1 = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is an expert cache?"}]
Q2 = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Why keep it warm?"}]


def _config(tmp_path, extra: str = "") -> str:
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[engine]\nprobe_floor = false\n[kv]\nram = "64 MiB"\ndir = "{tmp_path / "kv"}"\n'
                   f'budget = "1 GB"\n{extra}')
    return str(cfg)


def _done(run):
    assert run.wait(120) and run.state == "done", run.error
    return run


def test_text_runs_write_compact_dumps_and_token_runs_full_ones_by_default(tiny_model, tmp_path):
    cfg = _config(tmp_path)
    text = _done(start_run(RunConfig(model=str(tiny_model), messages=tuple(Q1), gen=3, config_path=cfg,
                                     dump_path=str(tmp_path / "text.bin"))))
    ids = _done(start_run(RunConfig(model=str(tiny_model), prompt=(0, 5), gen=3, config_path=cfg,
                                    dump_path=str(tmp_path / "ids.bin"))))
    assert (read_state(text.dump_path).mode, read_state(ids.dump_path).mode) == ("compact", "full")
    assert text.summary_report["dump"] == "compact" and ids.summary_report["dump"] == "full"
    # and [dump] in ds4f.toml says otherwise
    cfg = _config(tmp_path, '[dump]\ntext = "full"\nruns = "compact"\n')
    text = _done(start_run(RunConfig(model=str(tiny_model), messages=tuple(Q1), gen=3, config_path=cfg,
                                     dump_path=str(tmp_path / "text2.bin"))))
    ids = _done(start_run(RunConfig(model=str(tiny_model), prompt=(0, 5), gen=3, config_path=cfg,
                                    dump_path=str(tmp_path / "ids2.bin"))))
    assert (read_state(text.dump_path).mode, read_state(ids.dump_path).mode) == ("full", "compact")


def test_a_run_without_a_dump_writes_no_file_and_keeps_its_report(tiny_model, tmp_path):
    history = History(tmp_path / "history.sqlite3")
    before = set(tmp_path.rglob("*"))
    run = _done(start_run(RunConfig(model=str(tiny_model), prompt=(0, 5, 9), gen=4, dump="off",
                                    config_path=_config(tmp_path)), history=history))
    assert run.dump_path is None and run.report_path is None
    new = set(tmp_path.rglob("*")) - before
    assert not [p for p in new if p.suffix in (".bin", ".json")], new
    report = run.report
    assert report["state_path"] is None and report["state_sha256"] is None and report["dump"] == "off"
    assert report["generated"] == run.summary_report["generated"] and len(report["generated"]) == 4
    rec = history.get(run.id)
    assert rec.state == "done" and rec.state_path is None and rec.state_sha256 is None
    assert rec.report["summary"]["s_per_token"] is not None
    # the same run with a dump: the same tokens
    dumped = _done(start_run(RunConfig(model=str(tiny_model), prompt=(0, 5, 9), gen=4, dump="compact",
                                       config_path=_config(tmp_path), dump_path=str(tmp_path / "c.bin"))))
    assert dumped.report["generated"] == report["generated"]


def test_a_full_dump_past_the_limit_is_refused_before_the_run_starts(tiny_model, tmp_path):
    cfg = _config(tmp_path, '[dump]\nfull_limit = "100 KB"\n')
    ckpt = open_checkpoint(tiny_model)
    per_token = record_nbytes(ckpt.geometry.to_config(), "full")
    ckpt.close()
    assert per_token * 22 > 100_000 > record_nbytes(ckpt.geometry.to_config(), "compact") * 22
    with pytest.raises(Ds4fError) as err:
        start_run(RunConfig(model=str(tiny_model), prompt=(0, 5, 9), gen=20, dump="full", config_path=cfg,
                            dump_path=str(tmp_path / "big.bin")))
    message = str(err.value)
    assert err.value.param == "dump" and "full_limit" in message and "22 tokens" in message, message
    assert cfg in message and "--dump compact" in message
    assert not list(tmp_path.glob("big*")), "nothing written"
    # a compact dump of the same run is not limited
    _done(start_run(RunConfig(model=str(tiny_model), prompt=(0, 5, 9), gen=20, dump="compact", config_path=cfg,
                              dump_path=str(tmp_path / "small.bin"))))


@pytest.mark.parametrize("key, value, says", [("text", '"bulky"', "dump.text"), ("full_limit", '"10%"', "full_limit"),
                                              ("server", "1", "dump.server")])
def test_a_bad_dump_setting_names_the_file_and_key(tmp_path, key, value, says):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f"[dump]\n{key} = {value}\n")
    with pytest.raises(Ds4fError) as err:
        load_settings(cfg)
    assert str(cfg) in str(err.value) and says in str(err.value), str(err.value)


def test_kept_states_carry_records_only_from_runs_with_a_dump(tiny_model, tmp_path):
    """A run without a dump keeps states without records and reuses any state; a run with a
    compact dump reuses only a state with records (and then writes a cold run's dump); a run with
    a full dump reuses nothing and keeps states with compact records."""
    cfg = _config(tmp_path)
    host = EngineHost()

    def chat(name, messages, dump):
        return _done(start_run(RunConfig(model=str(tiny_model), messages=tuple(messages), gen=3, dump=dump,
                                         config_path=cfg, backend="scalar",
                                         dump_path=str(tmp_path / f"{name}.bin") if dump != "off" else None),
                               engines=host))

    try:
        off1 = chat("off1", Q1, "off")
        cache = host._engine.prefix_cache
        assert cache is not None and len(cache) >= 1
        assert all(RECORDS not in e.attached for e in (*cache._ram.values(), *cache._disk.values()))
        off2 = chat("off2", Q2, "off")
        assert off2.prompt_tokens_reused > 0                     # the system prompt's state
        compact1 = chat("compact1", Q2, "compact")
        assert compact1.prompt_tokens_reused == 0                # no state with records yet
        assert compact1.generated_ids == off2.generated_ids
        compact2 = chat("compact2", Q1, "compact")
        assert compact2.prompt_tokens_reused > 0                 # the state compact1 kept at its system prompt
        assert compact2.generated_ids == off1.generated_ids
        full = chat("full", Q1, "full")
        assert full.prompt_tokens_reused == 0
        assert any(RECORDS in e.attached for e in (*cache._ram.values(), *cache._disk.values()))
    finally:
        host.close()
    cold = _done(start_run(RunConfig(model=str(tiny_model), messages=tuple(Q1), gen=3, dump="compact",
                                     config_path=cfg, backend="scalar", reuse_prefix=False,
                                     dump_path=str(tmp_path / "cold.bin"))))
    assert cold.prompt_tokens_reused == 0
    assert read_state(compact2.dump_path).sha256 == read_state(cold.dump_path).sha256
    assert read_state(full.dump_path).compact().tobytes() == read_state(cold.dump_path).records.tobytes()
