"""The generation loop of one sequence: what every front end drives (the CLI, the console, the server
and the benchmarks, through runs.run.Run, which observes and records each row it hands out).

From a step on (0, or past a prefix the prefix cache gave): the prompt in layer-major chunks
(Session.prefill; a chunk ends at each mark), else token by token; then the generated tokens, each
a plain step, or with speculation (engine.speculative) a round of drafts verified in one pass, each
kept row handed out as a plain step's. It ends at the token count, or when `stopped()` says so
(the output's end: an end-of-sentence token or a stop string, which the caller reads from the rows;
or a cancel). With `hold_last` (the prefix cache) the last prompt token goes alone, as a step (its
next token is the run's first draw), and the session's state is kept at each mark.

A row goes to `emit(step, token, next_token, arrays, costs, seconds, prefill)`: the step's index,
the token fed, the token picked after it, its arrays (.ids .weights .hidden .attn .logits, and .compact
where a prompt chunk kept compact records: engine.session.Row; views of the session's buffers), its costs (engine.costs.Costs: a step's; a chunk's or a round's split over
its rows) and its share of the time.
"""
from __future__ import annotations

import time

from ds4f.engine.model.forward import Stopped
from ds4f.engine.speculative import finish_round, plain_step, speculate


class Generation:
    def __init__(self, session, prompt, n_steps: int, *, emit, stopped, cancelled, sampler=None, spec=None,
                 marks=(), hold_last: bool = False, before_step=None, counted=None) -> None:
        self.session, self.prompt, self.n_steps = session, tuple(prompt), n_steps
        self.emit, self.stopped, self.cancelled = emit, stopped, cancelled
        self.sampler, self.spec = sampler, spec         # None: greedy; None: no speculation
        self.marks = tuple(marks)                       # positions (tokens fed) to keep the state at
        self.hold_last = hold_last
        self.before_step = before_step or (lambda step: None)   # a step boundary: switches land here
        self.counted = counted or (lambda costs: None)          # each forward pass's costs (its batch share)
        self.marked: list = []                          # the states kept at the marks so far

    def release(self) -> None:
        """The loop's end: the states it marked (copies of the KV cache, kept by then or not at
        all) and its session let go."""
        self.marked = []
        self.session = None

    def run(self, start: int = 0) -> None:
        """The prompt from `start` and the generated tokens (see the module docstring)."""
        session, prompt = self.session, self.prompt
        step, token = self._prefill(start) if session.prefill_chunk else (start, prompt[start])
        while step < self.n_steps and not self.stopped():
            self._mark(step)
            self.before_step(step)
            generating = step >= len(prompt) - 1     # this step picks a generated token
            spec, sampler = self.spec, self.sampler
            k = spec.choose(min(self.n_steps - step, session.max_verify_rows) - 1) if generating and spec else 0
            if k:
                step, token = self._round(step, token, k)
                continue
            t0 = time.perf_counter()
            if generating and spec is not None:    # a plain step, with now and then a shadow draft beside it
                res = plain_step(session, spec, session.drafter, token, sampler)
            else:
                res = session.step(token, pick=sampler.sample if generating and sampler is not None else None)
            seconds = time.perf_counter() - t0
            self.counted(res.costs)
            self.emit(step, token, res.next_token, res, res.costs, seconds, False)
            step += 1
            token = prompt[step] if step < len(prompt) else res.next_token

    def _prefill(self, start: int) -> tuple[int, int]:
        """The prompt from `start`, chunk by chunk, layer by layer; each token's row as a step's.
        (the next step, the token it feeds): past the prompt (hold_last: at its last token),
        unless stopped."""
        session, prompt, sampler = self.session, self.prompt, self.sampler
        chunk = session.prefill_chunk
        end = len(prompt) - 1 if self.hold_last else len(prompt)
        step, token = start, prompt[start]
        while step < end and not self.stopped():
            self._mark(step)
            self.before_step(step)
            stop = min([step + chunk, end] + [m for m in self.marks if m > step])   # a chunk ends at a mark
            part = list(prompt[step:stop])
            n = len(part)
            t0 = time.perf_counter()
            try:
                res = session.prefill(part, should_stop=self.cancelled)
            except Stopped:   # cancelled part way through the chunk
                break
            self.counted(res.costs)
            seconds = time.perf_counter() - t0
            for c, costs in enumerate(res.costs.split(n)):
                generating = step == len(prompt) - 1
                next_token = res.next_token(c, sampler.sample if generating and sampler is not None else None)
                self.emit(step, part[c], next_token, res.row(c), costs, seconds / n, True)
                step += 1
                token = prompt[step] if step < len(prompt) else next_token
        return step, token

    def _round(self, step: int, token: int, k: int) -> tuple[int, int]:
        """A round of k drafts verified in one pass; each kept row handed out as a plain step's, the
        round's costs split over them. (the next step, the token it feeds)."""
        t0 = time.perf_counter()
        rnd = speculate(self.session, self.session.drafter, k, token, self.sampler)
        res = rnd.result
        seconds = time.perf_counter() - t0
        n = len(rnd.picks)
        feed = [token] + rnd.drafts
        emitted = 0
        for c, costs in enumerate(res.costs.split(n)):
            self.emit(step, feed[c], rnd.picks[c], res.row(c), costs, seconds / n, False)
            emitted += 1
            step += 1
            if self.stopped():
                break
        finish_round(self.session, self.spec, rnd, emitted, seconds)
        self.counted(res.costs)
        return step, rnd.picks[emitted - 1]

    def _mark(self, step: int) -> None:
        """Keep the session's state when `step` (the tokens fed so far) is one of the marks."""
        if step in self.marks and all(s.position != step for s in self.marked):
            self.marked.append(self.session.snapshot())
