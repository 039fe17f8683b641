"""A run's settings (RunConfig) and their checks, made before the run starts: nothing a run
refuses costs it an engine load, and every refusal names the setting (`param`) it concerns. And
what a run settles from them once (settle: threads, the text's end, where its files go), its
state dump's writer, opened first (open_writer), and its sampler (sampler_of)."""
from __future__ import annotations

import json

from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from ds4f.engine.config import AUTO_CHUNK, BACKEND_NAMES, DEFAULT_GEN, MAX_CHUNK, MAX_GEN, MAX_THREADS, Preset, format_bytes
from ds4f.engine.batch import batched_chunk
from ds4f.engine.speculative import parse_spec
from ds4f.engine.text.chat import chat_prompt_ids, check_chat
from ds4f.engine.text.constraint import Constraint, ResponseFormat, check_response_format
from ds4f.engine.text.sampling import Sampler, SamplingParams
from ds4f.engine.text.tokenizer import find_tokenizer
from ds4f.paths import user_data_dir
from ds4f.runs.budget import planned_bytes, runs_budget_for
from ds4f.engine.model.records import RECORDS_OF_DUMP
from ds4f.runs.plan import chunk_that_fits
from ds4f.runs.statedump import RUN_STATE, NoDump, StateWriter, record_nbytes, report_path_for, sweep_run_dirs
from ds4f.settings import DUMP_MODES, Settings
from ds4f.errors import Ds4fError
from ds4f.native import kernels

MAX_STOP = 16              # stop strings a run takes, each of at most MAX_STOP_CHARS characters
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class RunConfig:
    model: str                               # checkpoint path (official shards or ds4f layout)
    preset: "str | Preset" = "laptop"        # a preset of ds4f.toml, or a Preset made in code
    gen: int = DEFAULT_GEN                   # tokens to generate
    fit_gen: bool = False                    # gen is a ceiling: at most what the preset's context leaves
                                             # after the prompt (a server's answer without max_tokens)
    prompt: tuple[int, ...] | None = None    # prompt token ids; None: (bos,)
    io_threads: int | None = None            # None: the preset's, else ds4f.toml's
    kernel_threads: int | None = None        # None: the preset's, else ds4f.toml's (0 there = all cores)
    backend: str | None = None               # auto | scalar | avx2 | avx512 | neon; None: ds4f.toml's engine.backend
    dump_path: str | None = None             # state.bin; None: <data dir>/runs/<id>/state.bin
    dump: str | None = None                  # full | compact | off; None: ds4f.toml's [dump] for the run's
                                             # kind (text: `text`, token ids: `runs`)
    report_path: str | None = None           # report.json; None: next to the state dump (a.bin -> a.report.json)
    config_path: str | None = None           # ds4f.toml to use; None: the usual lookup
    probe_floor: bool | None = None          # measure the NVMe floor; None: ds4f.toml's engine.probe_floor
    moe_only: bool = False                   # allow a checkpoint without attention (the MoE half alone: the cache lab)
    # text: the prompt as text or chat messages (needs the checkpoint's tokenizer), how to pick tokens, when to stop
    text: str | None = None                  # prompt text (BOS prepended); not with `prompt` or `messages`
    special_tokens: bool = False             # text: a special token's string in it ("<｜User｜>") is that
                                             # control token; else (and always for messages) it is text
    messages: tuple | None = None            # chat turns ({"role", "content"}), in the model's chat format
    thinking: bool = False                   # chat: the model reasons first (thinking mode) or answers (chat mode)
    tools: tuple | None = None               # chat: the function schemas offered ({name, description, parameters})
    tool_choice: str | None = None           # chat: auto (None) | none | required | a function's name
    reasoning_effort: str | None = None      # chat, thinking mode: low | medium | high | max (max: the prompt says so)
    sampling: "SamplingParams | None" = None # None: greedy
    stop: tuple[str, ...] = ()               # stop strings: the output ends before the first one
    stop_at_eos: bool | None = None          # end at the end-of-sentence token; None: when the prompt is text
    cold_start: bool = False                 # empty the expert cache first; else a loaded engine's (EngineHost)
                                             # stays warm from the runs before (a new engine starts empty);
                                             # and no prefix is reused
    reuse_prefix: bool = True                # text: start from the longest kept prefix of the prompt ([kv])
    kv_dir: str | None = None                # the prefix cache's directory; None: ds4f.toml's [kv] dir
    prefill_chunk: int | None = None         # prompt tokens per layer-major chunk; 0: token by token;
                                             # None: the preset's
    spec: "str | int" = "off"                # speculative decoding with the MTP layer: off | auto | 1..3 drafts
    response_format: ResponseFormat | None = None     # text: the answer held to JSON / a JSON Schema
                                             # (engine.text.constraint); None: free text


def checked(config: RunConfig, settings: Settings) -> RunConfig:
    """`config` with its backend and dump resolved (None: ds4f.toml's), once every setting that
    needs no file is in range; else a Ds4fError naming the first that is not."""
    if isinstance(config.gen, bool) or not isinstance(config.gen, int) or not 1 <= config.gen <= MAX_GEN:
        raise Ds4fError(f"gen: must be a number of tokens from 1 to {MAX_GEN}, got {config.gen!r}", param="gen")
    if config.backend is None:
        config = replace(config, backend=settings.engine.default_backend())
    if config.dump is None:
        text = config.text is not None or config.messages is not None
        config = replace(config, dump=settings.dump.mode("text" if text else "runs"))
    if config.dump not in DUMP_MODES:
        raise Ds4fError(f"dump: {' | '.join(DUMP_MODES)}, got {config.dump!r}", param="dump")
    check_backend(config.backend)
    chunk = config.prefill_chunk
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 <= chunk <= MAX_CHUNK):
        raise Ds4fError(f"prefill_chunk: must be from 0 (token by token) to {MAX_CHUNK} prompt tokens, got {chunk!r}",
                        param="prefill_chunk")
    config = replace(config, spec=parse_spec(config.spec))
    check_threads(io_threads=config.io_threads, kernel_threads=config.kernel_threads)
    if not config.model:
        raise Ds4fError("model: no checkpoint path given", param="model")
    _check_text_settings(config)
    return config


def check_backend(backend: str) -> None:
    """A backend a run may ask for: known, and usable on this machine (or auto)."""
    if backend not in BACKEND_NAMES:
        raise Ds4fError(f"backend: unknown backend {backend!r} (known: {', '.join(BACKEND_NAMES)})",
                        param="backend")
    if backend != "auto" and backend not in kernels.available_backends():
        raise Ds4fError(f"backend: {backend} is not available on this machine "
                        f"(available: {', '.join(kernels.available_backends())})", param="backend")


def check_threads(**counts: int | None) -> None:
    """Thread counts by name (io_threads, kernel_threads): None, or from 1 to MAX_THREADS."""
    for name, value in counts.items():
        if value is not None and (not isinstance(value, int) or not 1 <= value <= MAX_THREADS):
            raise Ds4fError(f"{name}: must be between 1 and {MAX_THREADS}, got {value!r}", param=name)


def check_fits(config: RunConfig, checkpoint, prompt: tuple[int, ...], preset: Preset,
               settings: Settings | None = None) -> None:
    """The prompt and the tokens to generate fit the run: a checkpoint with attention (or
    moe_only), positions within the preset's context, then a full state dump within [dump]
    full_limit and the run's files within [runs] budget (`settings`')."""
    g = checkpoint.geometry
    if g.attention is None and not config.moe_only:
        raise Ds4fError(f"model: {config.model}: its config.json has no attention settings (num_attention_heads,"
                        f" head_dim, compress_ratios, ...), so only the MoE half of the model could run and its tokens"
                        f" would not be the model's; make the checkpoint again (ds4f synth / convert), or pass"
                        f" --moe-only to run the MoE half for the cache lab", param="model")
    if isinstance(config.spec, int) and not checkpoint.mtp_layers:
        raise Ds4fError(f"spec: {config.spec} drafts asked for, but "
                        + (checkpoint.mtp_problem or f"{config.model} has no MTP layer (mtp.0.*) to draft with")
                        + " (spec auto runs plainly where there is none)", param="spec")
    if g.attention is not None:
        check_context(len(prompt), config.gen, preset)
    if config.dump == "full" and settings is not None:
        steps = len(prompt) - 1 + config.gen
        nbytes = steps * record_nbytes(g.to_config(), "full")
        if nbytes > settings.dump.full_limit:
            raise Ds4fError(f"dump: a full state dump of {steps} tokens would be {format_bytes(nbytes)}"
                            f" ({format_bytes(nbytes / steps)} a token), past [dump] full_limit of"
                            f" {format_bytes(settings.dump.full_limit)} in {settings.source}: ask for a compact dump"
                            f" (--dump compact), or raise full_limit", param="dump")
    if config.dump != "off" and config.dump_path is None and settings is not None:
        check_runs_budget(config, g.to_config(), prompt, settings)


def check_runs_budget(config: RunConfig, geometry: dict, prompt: tuple[int, ...], settings: Settings) -> None:
    """A run whose files in the runs directory (its state dump and report) would alone pass
    [runs] budget is refused before it starts, naming the sizes and the setting."""
    steps = len(prompt) - 1 + config.gen
    nbytes = planned_bytes(geometry, config.dump, len(prompt), steps, text_chars(config))
    if nbytes > settings.runs_budget:
        raise Ds4fError(f"dump: a {config.dump} state dump of {steps} tokens and its report would take up to"
                        f" {format_bytes(nbytes)} in the runs directory, past [runs] budget of"
                        f" {format_bytes(settings.runs_budget)} in {settings.source}: ask for a smaller dump (--dump compact"
                        f" or off), or raise the budget", param="dump")


def text_chars(config: RunConfig) -> int:
    """The characters of a text run's prompt that its report repeats (the text, the messages, the tools)."""
    n = len(config.text or "")
    for part in (config.messages, config.tools):
        if part:
            n += len(json.dumps(list(part), default=str))
    return n


def fitted(config: RunConfig, prompt: tuple[int, ...], preset: Preset) -> RunConfig:
    """`config`, its gen lowered to the positions the preset's context leaves after the prompt when
    gen is a ceiling (fit_gen); at least 1, so a prompt that fills the context is refused as the prompt."""
    if not config.fit_gen:
        return config
    return replace(config, gen=max(1, min(config.gen, preset.context - len(prompt) + 1)))


def check_context(prompt_len: int, gen: int, preset: Preset) -> None:
    """A prompt and the tokens to generate within the preset's context, the positions its KV cache
    is allocated for (what the memory plan fits): the only bound on a prompt's length. A prompt
    that alone passes it is refused as the prompt (param `prompt`), else as the tokens asked for
    (`gen`); both name the limit, the prompt's length and the setting that raises it."""
    setting = f"raise `context` in [presets.{preset.name}] of ds4f.toml (`ds4f plan` shows what the memory fits)"
    if prompt_len > preset.context:
        raise Ds4fError(f"prompt: {prompt_len} tokens, past the context of {preset.context} positions (prompt and"
                        f" generated tokens together) of preset {preset.name!r}: shorten the prompt, or {setting}",
                        param="prompt")
    positions = prompt_len - 1 + gen
    if positions > preset.context:
        raise Ds4fError(f"gen: a prompt of {prompt_len} tokens and {gen} generated ones reach {positions} positions,"
                        f" past the context of {preset.context} of preset {preset.name!r}: generate at most"
                        f" {preset.context - prompt_len + 1}, or {setting}", param="gen")


def _check_text_settings(config: RunConfig) -> None:
    """The text settings' types and ranges, before any file is opened."""
    given = [name for name in ("prompt", "text", "messages") if getattr(config, name) is not None]
    if len(given) > 1:
        raise Ds4fError(f"{given[1]}: give the prompt one way only (token ids, text or chat messages), "
                        f"not {' and '.join(given)}", param=given[1])
    if config.text is not None and (not isinstance(config.text, str) or not config.text):
        raise Ds4fError("text: the prompt text is empty", param="text")
    _check_text(config)
    if config.special_tokens and config.text is None:
        raise Ds4fError("special_tokens: for a text prompt only (a chat's messages are always text)",
                        param="special_tokens")
    if config.messages is not None:
        if not config.messages:
            raise Ds4fError("messages: no chat messages given", param="messages")
        check_chat(config.messages, config.tools, config.reasoning_effort, config.tool_choice,
                   thinking=config.thinking)
    elif config.tools is not None or config.tool_choice is not None or config.reasoning_effort is not None:
        name = next(n for n in ("tools", "tool_choice", "reasoning_effort") if getattr(config, n) is not None)
        raise Ds4fError(f"{name}: for a chat (messages) only", param=name)
    if config.sampling is not None and not isinstance(config.sampling, SamplingParams):
        raise Ds4fError(f"sampling: expected SamplingParams, got {type(config.sampling).__name__}", param="sampling")
    _check_response_format(config)
    stop = config.stop
    if isinstance(stop, str) or not isinstance(stop, (tuple, list)) or len(stop) > MAX_STOP \
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise Ds4fError(f"stop: at most {MAX_STOP} stop strings, each of 1 to {MAX_STOP_CHARS} characters",
                        param="stop")


def _check_response_format(config: RunConfig) -> None:
    """A response format: for a text or chat prompt that ends at the end-of-sentence token (where a
    valid answer ends), never with a call the answer could make instead, and compilable."""
    fmt = config.response_format
    if fmt is None:
        return
    if config.text is None and config.messages is None:
        raise Ds4fError("response_format: for a text or chat prompt only (it needs the tokenizer)",
                        param="response_format")
    if config.stop_at_eos is False:
        raise Ds4fError("response_format: the answer ends at the end-of-sentence token: not with stop_at_eos off",
                        param="response_format")
    if config.tools and config.tool_choice != "none":
        raise Ds4fError("response_format: not with tools the answer may call (the answer must be the format's"
                        " JSON); send tool_choice none, or no response_format", param="response_format")
    check_response_format(fmt)


def _check_text(config: RunConfig) -> None:
    """Every text of the run is text: encodable as UTF-8 (a lone surrogate, which invalid bytes in
    a command line or a JSON escape give, is not), named by its parameter."""
    stops = config.stop if isinstance(config.stop, (tuple, list)) else ()
    texts = [("text", config.text)] + [("stop", s) for s in stops]
    for i, m in enumerate(config.messages or ()):
        if isinstance(m, dict):
            texts += [(f"messages[{i}].{k}", m.get(k)) for k in ("content", "reasoning")]
            if m.get("tool_calls"):
                texts.append((f"messages[{i}].tool_calls", json.dumps(m["tool_calls"], ensure_ascii=False,
                                                                      default=str)))
    if config.tools:
        texts.append(("tools", json.dumps(config.tools, ensure_ascii=False, default=str)))
    for name, value in texts:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise Ds4fError(f"{name}: not valid text: {value[exc.start]!r} at character {exc.start} is a lone"
                                f" surrogate (invalid UTF-8 in the input?)", param=name.split("[")[0]) from None


def prompt_of(config: RunConfig, checkpoint, kept=()) -> tuple[tuple[int, ...], object]:
    """The prompt's token ids, and the tokenizer when the run speaks text (None otherwise).
    kept: the token ids of kept states, to spell a chat's earlier answers given as text alone."""
    g = checkpoint.geometry
    wants_text = config.text is not None or config.messages is not None or bool(config.stop)
    tokenizer = find_tokenizer(checkpoint.path) if checkpoint.path.is_dir() else None
    if wants_text and tokenizer is None:
        raise Ds4fError(f"model: {checkpoint.path} has no tokenizer (tokenizer.json), so it cannot read or write"
                        f" text; give the prompt as token ids, or use a checkpoint with its tokenizer files",
                        param="model", path=str(checkpoint.path))
    if config.messages is not None:
        prompt = tuple(chat_prompt_ids(tokenizer, list(config.messages), thinking=config.thinking, kept=kept,
                                       tools=config.tools, reasoning_effort=config.reasoning_effort,
                                       tool_choice=config.tool_choice))
    elif config.text is not None:
        prompt = (tokenizer.bos_id, *(tokenizer.encode if config.special_tokens else tokenizer.encode_text)(
            config.text))
    else:
        prompt = tuple(config.prompt) if config.prompt else (g.bos_token_id,)
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < g.vocab]
    if bad:
        what = "the tokenizer gives token ids" if wants_text else "token ids"
        raise Ds4fError(f"prompt: {what} {bad[:5]} outside the model's vocabulary (0..{g.vocab - 1})",
                        param="prompt")
    return prompt, tokenizer


def kv_of(config: RunConfig, cfg):
    """The [kv] settings a run goes by: for text (a chat's turns, repeated system prompts), when it
    may reuse a prefix, never on a cold start; None: no prefix cache."""
    text = config.text is not None or config.messages is not None
    return cfg.kv if text and config.reuse_prefix and not config.cold_start else None


# -- a run's settings and its state dump's writer (runs.run.Run: set up once, before its thread) ----
def settle(run, settings: Settings) -> None:
    """The settings the run goes by: what the RunConfig leaves open, from the preset and
    ds4f.toml (`settings`); the text's end; where its files go."""
    cfg = settings.engine
    config, preset, tokenizer, prompt = run.config, run.preset, run.tokenizer, run.prompt
    # a prompt of one token has nothing to prefill (and needs no chunk buffers)
    chunk = preset.prefill_chunk if config.prefill_chunk is None else config.prefill_chunk
    if chunk == AUTO_CHUNK:               # the largest chunk this machine's memory plan fits
        chunk = chunk_that_fits(run.checkpoint.geometry, preset, int(psutil.virtual_memory().total),
                                cfg.kv.ram_bytes if cfg.kv is not None else 0,
                                run.engines.parallel if run.engines is not None else 1,
                                config.spec != "off", RECORDS_OF_DUMP[config.dump]).prefill_chunk
    if chunk and run.engines is not None and run.engines.parallel > 1:
        chunk = batched_chunk(chunk)      # a prompt in a batch goes in steps of a few rows
    run.prefill_chunk = min(chunk, len(prompt)) if len(prompt) > 1 else 0
    run.stop_at_eos = config.stop_at_eos if config.stop_at_eos is not None else tokenizer is not None and (
        config.text is not None or config.messages is not None)
    run.eos_id = tokenizer.eos_id if tokenizer is not None else run.checkpoint.geometry.eos_token_id
    run.io_threads = config.io_threads or cfg.effective_io_threads(preset)
    run.kernel_threads = config.kernel_threads or cfg.effective_kernel_threads(preset)
    run.probe = cfg.probe_floor if config.probe_floor is None else config.probe_floor
    run._kv = kv_of(config, cfg)
    run.dump_mode = config.dump          # full | compact | off (checked() resolved it)
    # the runs directory's budget ([runs] budget): its files there and the history together
    history_path = getattr(run.history, "path", None)
    run._budget = runs_budget_for(user_data_dir() / "runs", settings.runs_budget, history_path, settings.source) \
        if history_path is not None or (run.dump_mode != "off" and not config.dump_path) else None
    run._reservation = None    # its room in the runs directory (reserve_room), once reserved
    if run.dump_mode == "off":           # no state dump, no report file: the report is in memory and the history
        run.dump_path = run.report_path = None
        return
    run.dump_path = Path(config.dump_path) if config.dump_path else user_data_dir() / "runs" / run.id / RUN_STATE
    run.report_path = Path(config.report_path) if config.report_path else \
        report_path_for(run.dump_path, own_dir=not config.dump_path)


def open_writer(run) -> "StateWriter | NoDump":
    """The state dump's writer, first, so an unwritable or busy place fails the run before the
    engine loads; its header holds what determines the numbers: the geometry (attention
    included), the prompt, the token count, the sampling. NoDump when the run writes none."""
    if run.dump_mode == "off":
        return NoDump()
    sampling = run.config.sampling
    writer = StateWriter(run.dump_path, run.checkpoint.geometry.to_config(), list(run.prompt), run.n_steps,
                         report_path=run.report_path, mode=run.dump_mode,
                         sampling=sampling.to_dict() if sampling is not None and not sampling.greedy else None,
                         response_format=fmt.to_dict() if (fmt := run.config.response_format) is not None else None)
    notes = writer.notes
    if not run.config.dump_path:   # the default place: one directory per run, beside killed runs' ones
        # those the budget's scan before the run found (not every run's directory walked again)
        leftovers = run._budget.leftover_dirs() if run._budget is not None else None
        notes += sweep_run_dirs(run.dump_path.parent.parent, keep=run.dump_path.parent, candidates=leftovers)
    for note in notes:
        run._log(note)
    return writer


def reserve_room(run) -> None:
    """Room in the runs directory for what the run writes in its own directory there (older
    finished runs removed if need be), before its thread starts; a Ds4fError if there is none."""
    if run._budget is None or run.dump_path is None or run.config.dump_path:
        return
    nbytes = planned_bytes(run.checkpoint.geometry.to_config(), run.dump_mode, len(run.prompt), run.n_steps,
                           text_chars(run.config))
    run._reservation = run._budget.reserve(run.dump_path.parent, nbytes, run.history)
    for note in run._reservation.notes:
        run._log(note)


def sampler_of(run) -> Sampler | None:
    """The run's sampler: None for plain greedy; a response format's constraint on every pick."""
    sampling, fmt = run.config.sampling, run.config.response_format
    if fmt is not None:
        constraint = Constraint(run.tokenizer, fmt, run.checkpoint.geometry.vocab,
                                thinking=run.config.thinking and run.config.messages is not None)
        return Sampler(sampling if sampling is not None else SamplingParams(temperature=0.0), constraint)
    return Sampler(sampling) if sampling is not None and not sampling.greedy else None
