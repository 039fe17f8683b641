"""A run's use of the engine's prefix cache, kept exact: a reused prefix gives the same tokens and
the same state dump as computing it.

A kept state is the session's KV (engine.session_state). A run that writes a state dump also
keeps the compact records of the state's tokens with it (attached as raw bytes, a few KB a token,
never the full records), so a later run with a compact dump that starts from it writes those
records as its own: the math of a position depends only on the tokens up to it and the backend,
and the cache only gives a state to a run of the same backend. Of a record only the `next` field
depends on the run: for every prompt token but the last it is the greedy choice, the top logit's
id, which the record holds (the last prompt token is always computed, since its next token is the
run's first draw). A run without a dump needs no records and takes any state of its tokens; a run
with a full dump reuses nothing (its records are every float) but keeps its states for the others.
A done run keeps the states at its marks and at its end (prompt and answer: a continuation's
prefix). The marks: before its last prompt token (what the next turn of a chat shares, whatever
the chat format renders after it), and in a chat before its first user message (the end of the
system prompt, which other conversations share).
"""
from __future__ import annotations

import numpy as np

from ds4f.engine.checkpoint.fingerprint import checkpoint_fingerprint
from ds4f.engine.prefix_cache import kept_tokens_on_disk
from ds4f.engine.session_state import SessionState, with_attached
from ds4f.engine.text.tokenizer import USER
from ds4f.errors import Ds4fError
from ds4f.runs.snapshot import TokenRecord
from ds4f.runs.statedump import compact_records, read_records

RECORDS = "records"


def attach_records(states: list[SessionState], dump_path, geometry: dict) -> list[SessionState]:
    """Each state with the compact records of its tokens from the done run's state dump (full or
    compact), read once for the longest (the others' tokens are a prefix of it: the same run's)."""
    if not states:
        return []
    records = compact_records(read_records(dump_path, 0, max(s.position for s in states)), geometry)
    raw = np.frombuffer(records.tobytes(), np.uint8).reshape(len(records), -1)
    return [with_attached(s, **{RECORDS: raw if s.position == len(raw) else raw[:s.position].copy()})
            for s in states]


def reusable_records(state: SessionState, dtype: np.dtype) -> np.ndarray | None:
    """The state's records as this run writes them (each `next` the greedy choice), or None when it
    has none of this dump's layout (then the state is not used)."""
    raw = state.attached.get(RECORDS)
    if raw is None or raw.ndim != 2 or raw.shape != (state.position, dtype.itemsize):
        return None
    records = np.frombuffer(raw.tobytes(), dtype).copy()
    records["next"] = records["top_ids"][:, 0]
    return records


def marks(prompt, user_id: int | None = None) -> list[int]:
    """The prompt positions (tokens fed) a run keeps a state at: before the last prompt token; with
    `user_id` (a chat's), before the first user message. Sorted; none at BOS alone (a state of one
    token saves nothing)."""
    first = next((i for i, t in enumerate(prompt) if t == user_id), None) if user_id is not None else None
    at = {len(prompt) - 1} | ({first} if first is not None else set())
    return sorted(m for m in at if 1 < m < len(prompt))


def kept_on_disk(position: int, prompt_len: int, thinking: bool) -> bool:
    """Does a done run's state at `position` go to the directory too (else RAM alone)? On disk, one
    head a request: the end state (prompt and answer: what a chat's or an agent's next request
    continues), or in thinking mode, whose next prompt drops the reasoning, the state before the
    last prompt token; and the marks inside the prompt (a system prompt's end, written once for all
    the conversations that share it). Every state stays in RAM while it fits."""
    if position == prompt_len - 1:
        return thinking
    if position >= prompt_len:
        return not thinking
    return True


def kept_tokens_for(config, kv, checkpoint, engines=None) -> list[tuple[int, ...]]:
    """The token ids of the kept states, for a chat prompt with an earlier answer given as text
    alone (engine.text.chat spells it as a kept state does), when the run may reuse a prefix (`kv`:
    its [kv] settings, None when it may not): the host's loaded prefix cache for this checkpoint,
    else the headers in the directory. [] when there is nothing to spell."""
    if kv is None or not config.messages or not any(m.get("role") == "assistant" and m.get("tokens") is None
                                                    for m in config.messages):
        return []
    if engines is not None and (kept := engines.kept_tokens(checkpoint)) is not None:
        return kept
    directory = config.kv_dir or kv.dir
    if not directory or kv.disk_bytes <= 0:
        return []
    return kept_tokens_on_disk(directory, checkpoint_fingerprint(checkpoint.path), checkpoint.geometry.to_config())


# -- a run's prefix reuse: its prompt's kept prefix restored, its states kept when done ----------
def reuse_prefix(run, eng, session, writer) -> tuple[int, tuple[int, ...]]:
    """The longest kept prefix of the run's prompt (all of it but its last token at most) put
    into the session, its records written to the state dump and logged as reused prompt tokens:
    (how many tokens it gave, 0: none or the prefix cache is off for this run; the prompt
    positions after those to keep a state at)."""
    if run._kv is None or session.kv is None or len(run.prompt) < 2:
        return 0, ()
    kv = run._kv
    cache = eng.use_prefix_cache(kv.ram_bytes, run.config.kv_dir or kv.dir, kv.disk_bytes, run._log, kv.block,
                                 kv.write_budget)
    if run.dump_mode == "full":     # kept states carry compact records; a full dump needs every float
        run._log("prefix cache: not used by a run that writes a full state dump (kept states carry"
                 " compact records); its states are kept")
        start = 0
    else:
        start = _restore_kept(run, cache, eng, session, writer)
    user = run.tokenizer.special_id(USER) if run.config.messages is not None else None
    return start, tuple(m for m in marks(run.prompt, user) if m > start)


def _restore_kept(run, cache, eng, session, writer) -> int:
    """reuse_prefix's restore: the longest kept prefix into the session; how many tokens it gave. A
    run with a state dump takes only a state with records of its tokens (written as its own)."""
    dumps = writer.dtype is not None
    state = cache.lookup(run.prompt, session.kernels.backend, at_most=len(run.prompt) - 1,
                         need=RECORDS if dumps else None)
    if state is None:
        return 0
    records = reusable_records(state, writer.dtype) if dumps else None
    if dumps and records is None:
        run._log("prefix cache: a kept state without records of this run's dump: not used")
        return 0
    try:
        session.restore(state)
    except Ds4fError as exc:     # not this model's state after all: dropped, the prompt computed
        cache.discard(state.tokens, state.backend, str(exc))
        run._log(f"prefix cache: not used: {exc}")
        return 0
    # the greedy pick after each reused token is in its record; without records it is not known (-1)
    nexts = records["next"] if dumps else np.full(state.position, -1)
    if dumps:
        writer.write_records(records)
    with run._lock:
        for i, (token, nxt) in enumerate(zip(state.tokens, nexts)):
            run._steps.log.add(TokenRecord(index=i, token_id=int(token), next_token_id=int(nxt),
                                            seconds=0.0, bytes_read=0, hits=0, misses=0, stall_s=0.0,
                                            backend=session.kernels.backend,
                                            kernel_threads=session.kernels.threads,
                                            io_threads=eng.io_threads, prefill=True, reused=True))
    run._log(f"prefix cache: {state.position} prompt tokens reused, {len(run.prompt) - state.position} computed")
    return state.position


def keep_states(run) -> None:
    """A done run's states into the prefix cache, with its records of their tokens: at its
    marks (runs.prefix.marks) and at the end. Not when the kernels switched during the run (its
    records would not be those of one backend)."""
    eng, session = run._lease.engine, run._lease.session
    if run._kv is None or eng is None or eng.prefix_cache is None or session is None:
        return
    if len(run._steps.log.switches) > 1:
        run._log("prefix cache: nothing kept: the kernels switched during the run")
        return
    cache = eng.prefix_cache
    written = 0      # bytes its kept states wrote to the prefix cache's directory
    try:
        marked = run._generation.marked if run._generation is not None else []
        states = [s for s in (*marked, session.snapshot()) if s.position]
        if run.dump_path is not None:      # a run with a dump keeps its tokens' compact records with them
            states = attach_records(states, run.dump_path, run.checkpoint.geometry.to_config())
        before = cache.figures()
        for state in states:
            cache.keep(state, disk=kept_on_disk(state.position, len(run.prompt), run.config.thinking))
        after = cache.figures()
        written = (after.written_heads + after.written_blocks) - (before.written_heads + before.written_blocks)
    except Ds4fError as exc:
        run._log(f"prefix cache: not kept: {exc}")
    except Exception as exc:   # the run is done and its files are in place: say it, never fail it
        run._log(f"prefix cache: not kept: internal error: {type(exc).__name__}: {exc}")
    run._log(f"prefix cache: {len(cache)} states, {cache.stats.ram_bytes / 2**20:.1f} MiB in RAM,"
             f" {cache.stats.disk_bytes / 1e6:.1f} MB on disk; this run wrote {written / 1e6:.1f} MB")
