"""Admission: queued requests prefilled into free row slots between device calls, whole or in
chunks (`serving.prefill_chunk`: a chunk per round, the running rows' decode call between
chunks), straight into the shared page pool through each row's table (or into a per-slot
contiguous cache), then spliced into the batch state (`rows.insert_row`).

It owns the rows still prefilling in chunks (`prefilling`) and the round's prompt-token budget;
requests move through the ledger (`ledger.Ledger`: queue, activate, fail), pages through the
KV manager, device rows through the runner (`device_call.DeviceRunner`: the pool lent to a
prefill, rows spliced in). The loop (`Scheduler.run_once`) calls `admit` and `prefill_chunks`
each round. The model is reached only through the engine's serving surface
(`Engine.prefill_rows`, `write_prompt`, `empty_cache`, `with_adaptive`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode import drafter as drafter_lib
from jaxspec.decode.sampling import SamplingParams
from jaxspec.engine.prepare import bucket, prompt_bucket
from jaxspec.models import paged_attention
from jaxspec.serving import paged_cache
from jaxspec.serving.batch import split_widths
from jaxspec.serving.requests import Request


def prompt_width(n: int, done: int, tail_width: int | None = None) -> int:
    """The prompt array's width for a prompt of n tokens: its `prompt_bucket` when the whole
    prompt runs (the prefill computes every padded position); when only a tail from `done` runs
    (the tail has its own bucket; the array only carries tokens), `tail_width` where one width
    serves every prompt (`tail_prompt_width`), else the power-of-two `bucket`."""
    if not done:
        return prompt_bucket(n)
    return tail_width if tail_width is not None else bucket(n)


FINE_TAILS_FROM = 128  # tails longer than this also get a bucket at 3/4 of each octave


def tail_bucket(n: int) -> int:
    """The width a tail of n tokens is padded to (the tokens its prefill runs): the power-of-two
    `bucket`, and past FINE_TAILS_FROM also 3/4 of it (264 -> 384, not 512), so a whole prompt
    run as a tail (`whole_as_tail`) is padded at most 1.5x there, for three more programs up to
    1024 (a 264-token prompt's time to first token: 1.55x the exact bucket's at 512, see
    docs/history/BENCHMARKS-session-30.md)."""
    b = bucket(n)
    three_quarters = b // 4 * 3
    return three_quarters if b > FINE_TAILS_FROM and n <= three_quarters else b


def tail_prompt_width(spec, capacity: int) -> int | None:
    """The one prompt width every tail's prefill takes (`capacity`), where nothing in it runs a
    model over the whole prompt array: no drafter, or one that drafts from tokens with neither
    a model nor the target's features. Then the tail programs are one per tail bucket (the
    array's extra width costs only its copy) instead of one per (prompt bucket, tail bucket).
    None: a drafter that sets itself up over the prompt through a model (a draft model, an
    EAGLE-style head) pays for the array's width, so its tails keep the prompt's `bucket`."""
    if spec.drafter is None:
        return capacity
    t = drafter_lib.traits(spec.drafter)
    plain = t.drafts_from_tokens and t.model is None and t.model_cfg is None
    return capacity if plain and not tuple(spec.drafter.hidden_layers) else None


def prefill_sampling(values: list[tuple]) -> SamplingParams:
    """The rows' sampling values for a prefill call, mode "any" always (each row greedy or
    sampled as its values say): a prefill draws one token a row, so an all-greedy program of
    its own saves next to nothing and would double the prefill programs to hold."""
    return dataclasses.replace(SamplingParams.rows(values), mode="any")


def any_mode(program):
    """A (jitted function, args, kwargs) prefill program with its SamplingParams' mode "any"
    (what `prefill_sampling` gives every call)."""
    fn, args, kwargs = program
    args = tuple(dataclasses.replace(a, mode="any") if isinstance(a, SamplingParams) else a
                 for a in args)
    return fn, args, kwargs


def whole_as_tail(paged: bool, prefix_cache: str, chunk: int | None,
                  tail_width: int | None) -> bool:
    """Whether whole prompts run as tails from position 0 (the prefix cache's tail programs,
    one per power-of-two tail bucket) rather than programs of their own per `prompt_bucket`:
    where tails run over pages with one prompt width (`tail_prompt_width`) and prompts are not
    chunked. Fewer programs to load and hold resident (a compiled program's code is most of a
    CPU server's memory), for a tail bucket up to 2x the prompt where its bucket was <= 1.25x."""
    return paged and prefix_cache == "on" and chunk is None and tail_width is not None


class Admission:
    def __init__(self, engine, spec, shape, *, pool, kv, policy, stats, device, ledger,
                 chunk: int | None, budget: int | None, batch_prefill: bool, prefix_cache: str):
        self.engine, self.spec, self.shape = engine, spec, shape
        self.pool, self.kv, self.policy, self.stats = pool, kv, policy, stats
        self.device, self.ledger = device, ledger
        self.chunk = chunk  # prompts longer than this go a chunk per round (None: whole)
        self.budget = budget  # prompt tokens prefilled per round at most (None: no budget)
        self.batch_prefill = batch_prefill
        self.prefix_cache = prefix_cache
        self.prefilling: dict[int, list] = {}  # slot -> [request, prompt tokens in the pool]
        self.round_left: int | None = None  # the round's budget left
        self.round_tokens = 0  # prompt tokens prefilled this round
        self.tail_width = tail_prompt_width(spec, shape.capacity)  # None: the prompt's bucket
        # whole prompts run as tails from 0 (`whole_as_tail`): no whole-prompt programs
        self.whole_as_tail = whole_as_tail(shape.paged, prefix_cache, chunk, self.tail_width)

    def free_slots(self) -> list[int]:
        return [s for s in range(self.shape.slots)
                if s not in self.ledger.active and s not in self.prefilling]

    def drop_cancelled(self) -> None:
        """Cancelled requests still prefilling in chunks out (their pages freed)."""
        for slot, (req, _) in list(self.prefilling.items()):
            if req.cancelled:
                del self.prefilling[slot]
                self.pool.release(slot)
                self.ledger.cancel(req)

    def admit(self) -> None:
        """Queued requests, in the policy's order, into free slots while the pool holds their
        prompt and one step: prefilled now, or (long prompts, chunked) a chunk per round."""
        left = self._reserve_budget()  # None: no budget
        used = self.pool.used_pages  # the running rows grown for their next call
        self.stats.peak_used_pages = max(self.stats.peak_used_pages, used)
        if self.shape.static and self.ledger.active:
            return
        free, ready = self.free_slots(), []
        for req in self.policy.order(self.ledger.queue):
            if not free:
                break
            if not self.policy.admit(req, self.pool):
                continue
            if left is not None and self._waits_for_budget(req, left):
                break
            cached = self.kv.take(req, free[0], written=self.device.pool_written)
            if cached is None:
                break  # the pool is short: wait for a row to end
            left = self._admit_one(req, free.pop(0), cached, ready, left)
        if left is not None:  # the chunk phase: the reserved chunks, then what is left
            self.round_left += left
        self._prefill_batched(ready)
        self.stats.peak_used_pages = max(self.stats.peak_used_pages, self.pool.used_pages)

    def _waits_for_budget(self, req, left: int) -> bool:
        """Under a budget: `req` waits for a round it fits (or goes alone, first of a round)."""
        rest = len(req.prompt_ids) - self._cached_estimate(req)
        chunks = self.chunk is not None and rest > self.chunk
        return not chunks and rest > left and left < self.budget

    def _admit_one(self, req, slot: int, cached: int, ready: list, left):
        """`req` (its pages taken, `cached` prompt tokens shared) into `slot`: prefilled now,
        queued in `ready` (batched), or chunked; -> the round's budget left."""
        self.ledger.queue.remove(req)
        req.peak_pages = max(req.peak_pages, self.pool.held(slot))
        req.cached_tokens = cached
        self.stats.prompt_tokens += len(req.prompt_ids)
        self.stats.prefix_cached_tokens += cached
        chunked = self.chunk is not None and len(req.prompt_ids) - cached > self.chunk
        if chunked:  # a chunk per round (`prefill_chunks`), the first request's too: its chunks
            self.prefilling[slot] = [req, cached]  # go into the pool before the batch state
        elif self.batch_prefill:
            ready.append((req, slot, cached))
            if left is not None:
                left -= len(req.prompt_ids) - cached
        else:
            self._prefill_into(req, slot, cached)
        return left

    def prefill_chunks(self) -> bool:
        """One chunk of every prefilling request's prompt written into its pages; the last
        (at most `chunk` tokens) through `speculate.prefill` with the pool already holding the
        rest (`paged_cache.TailTarget`), which splices the row in. False: none prefilling."""
        if self.batch_prefill:
            more = self._prefill_chunks_batched()
            self.stats.max_round_prefill_tokens = max(self.stats.max_round_prefill_tokens,
                                                      self.round_tokens)
            return more
        for slot, entry in list(self.prefilling.items()):
            req, done = entry
            if len(req.prompt_ids) - done > self.chunk:
                t0 = time.perf_counter()
                cache = self.device.take_pool_rows([slot], [done])
                tokens = jnp.asarray([req.prompt_ids[done : done + self.chunk]], jnp.int32)
                cache = self.engine.write_prompt(self.spec.target, tokens, cache)
                self.device.set_cache(k=cache.k, v=cache.v)
                entry[1] = done + self.chunk
                self.kv.written(slot, req.prompt_ids[: entry[1]], req.cache_salt)  # shareable
                self.stats.prefill_s += time.perf_counter() - t0
                self._count_call(self.chunk, chunks=1)
            else:
                del self.prefilling[slot]
                self._prefill_into(req, slot, done)
        return bool(self.prefilling) or bool(self.ledger.active)

    def _prefill_into(self, req: Request, slot: int, done: int = 0) -> None:
        """`req` prefilled into `slot` (`_prefill_row`); a failure fails `req` alone."""
        with self._confined([req], [slot]) as failed:
            self._prefill_row(req, slot, done)
        if failed:
            self.ledger.fail(req, failed[0])

    @contextlib.contextmanager
    def _confined(self, reqs, slots, release: bool = True):
        """Around a prefill of `reqs` into `slots`: an exception is caught and the yielded
        list gets it, with the pool put back (and, `release`, their slots' pages freed), so
        only they fail. Re-raised when the pool went with the failed call (donated and
        deleted): then the engine cannot go on."""
        state = self.device.state
        pool = ((state.cache.k, state.cache.v) if state is not None else self.device.early_pool
                ) if self.shape.paged else None
        failed: list[BaseException] = []
        try:
            yield failed
        except Exception as e:  # noqa: BLE001 -- confined below, or re-raised
            if pool is not None and any(x.is_deleted() for x in jax.tree.leaves(pool)):
                raise
            if pool is not None:
                self.device.set_cache(k=pool[0], v=pool[1])
            for r, slot in zip(reqs, slots):
                if self.ledger.active.get(slot) is r:  # spliced in before the failure: out again
                    self.ledger.release(r)
                elif release:
                    self.pool.release(slot)
                r.slot = -1
            failed.append(e)

    def _prefill_row(self, req: Request, slot: int, done: int = 0) -> None:
        t0 = time.perf_counter()
        row = self._row_state(self.spec, req, slot, done)
        self.kv.written(slot, req.prompt_ids, req.cache_salt)
        self.device.splice_row(row, slot)
        self.ledger.activate(req, slot)
        self.stats.prefill_s += time.perf_counter() - t0
        self._count_call(len(req.prompt_ids) - done)

    def _count_call(self, tokens: int, chunks: int = 0) -> None:
        """A prefill call that ran `tokens` prompt tokens (`chunks` of them chunk writes)."""
        self.stats.prefill_calls += 1
        self.stats.prefill_chunks += chunks
        self.stats.max_prefill_call_tokens = max(self.stats.max_prefill_call_tokens, tokens)

    def _live(self) -> set[int]:
        return set(self.ledger.active) | set(self.prefilling)

    def _row_state(self, spec, req: Request, slot: int, done: int = 0):
        """done: prompt tokens already in the row's pages (earlier chunks of chunked prefill,
        pages shared from the prefix cache): only the tokens from `done` on run, in a tail of
        a bucketed width (`paged_cache.TailTarget`: nothing below `done` is written)."""
        ids = req.prompt_ids
        as_tail = bool(done) or self.whole_as_tail
        if as_tail:
            tail = paged_cache.TailTarget(spec.target, tail_bucket(len(ids) - done))
            spec = dataclasses.replace(spec, target=tail)
        prompt = np.zeros((1, prompt_width(len(ids), as_tail, self.tail_width)), np.int32)
        prompt[0, : len(ids)] = ids
        sp = prefill_sampling([req.sampling.values])
        state = self.engine.prefill_rows(
            spec, jnp.asarray(prompt), jnp.asarray([len(ids)], jnp.int32),
            jnp.asarray([req.sampling.max_tokens], jnp.int32), sp, self.device.key,
            jnp.asarray([req.seed], jnp.int32), self.shape.capacity,
            cache=self.device.take_pool_rows([slot], [done]) if self.shape.paged else None,
            penalties=self.engine.row_penalties([req.sampling.penalties]),
            grammar=self.device.grammar_rows([req.constraint], [slot], self._live()))
        return self.engine.with_adaptive(state, self.spec, costs_batch=1)

    def prefill_programs(self, prompt_lengths) -> list[dict]:
        """Every prefill program admission may call for prompts of these lengths, at every row
        width it may use (1, or each compiled width under batch_prefill): the whole prompt of
        each `prompt_bucket`; where tails run (the prefix cache, chunked prefill) the tail over written
        pages of every tail bucket up to the prompt's bucket (up to the chunk's when chunked: a
        longer rest goes in chunks); and the chunk writes. Each {"name" ("prefill",
        "prefill_tail", "prefill_chunk"), "rows", "prompt_bucket", "tokens" (the tokens it
        runs through the model), "program" ((jitted function, args, kwargs), abstract)}."""
        out = []
        widths = self.shape.widths if self.batch_prefill else (1,)
        tails = self.shape.paged and (self.prefix_cache == "on" or self.chunk is not None)
        wholes = () if self.whole_as_tail else sorted({prompt_bucket(n) for n in prompt_lengths})
        for prompt in wholes:  # whole prompts (as tails from 0 where `whole_as_tail`)
            out += self._programs_at(prompt, [("prefill", prompt, self.spec.target)], widths)
        for prompt, most in self._tail_widths(prompt_lengths) if tails else ():
            targets = [("prefill_tail", t, paged_cache.TailTarget(self.spec.target, t))
                       for t in sorted({tail_bucket(n) for n in range(1, most + 1)})]
            out += self._programs_at(prompt, targets, widths)  # every tail bucket up to `most`
        if self.chunk is not None:
            for rows_ in widths:
                out.append({"name": "prefill_chunk", "rows": rows_, "prompt_bucket": None,
                            "tokens": self.chunk, "program": self.engine.write_prompt_program(
                                self.spec.target, rows_, self.chunk, self._pool_shape(rows_))})
        return out

    def _tail_widths(self, prompt_lengths) -> list[tuple[int, int]]:
        """(prompt array width, longest tail) of the tail programs: one width for every prompt
        where `tail_width` is set, else each prompt's `bucket`; a tail is at most the prompt,
        and at most the chunk when chunked (a longer rest goes in chunks)."""
        lengths = list(prompt_lengths)
        if not lengths:
            return []
        if self.tail_width is not None:
            widths = {self.tail_width: bucket(max(lengths))}
        else:
            widths = {bucket(n): bucket(n) for n in lengths}
        cap = bucket(self.chunk) if self.chunk is not None else None
        return [(w, most if cap is None else min(most, cap)) for w, most in sorted(widths.items())]

    def _programs_at(self, prompt: int, targets, widths) -> list[dict]:
        """`prefill_programs`' rows of prompts `prompt` wide: each (name, tokens, target) at
        every row width."""
        out = []
        grammars = self.device.grammars  # None: the server carries no constraints
        for name, tokens, target in targets:
            spec = dataclasses.replace(self.spec, target=target)
            for rows_ in widths:
                grammar = None if grammars is None else grammars.rows([None] * rows_)
                out.append({"name": name, "rows": rows_, "prompt_bucket": prompt,
                            "tokens": tokens, "program": any_mode(self.engine.prefill_program(
                                spec, rows_, prompt, self.shape.capacity, self._pool_shape(rows_),
                                penalties=True, grammar=grammar))})
        return out

    def _pool_shape(self, rows_: int):
        """The shapes of the cache a `rows_`-row prefill writes into (the pool and these rows'
        tables, as `_take_pool_rows` gives); None for a contiguous cache (made by the call)."""
        if not self.shape.paged:
            return None
        shape = self.engine.cache_shape(self.spec.target, 1, self.shape.capacity)
        return paged_attention.PagedKVCache(
            shape.k, shape.v, jax.ShapeDtypeStruct((rows_, self.shape.max_pages), jnp.int32),
            jax.ShapeDtypeStruct((rows_,), jnp.int32))

    # ---- the token budget per round (serving.max_batched_tokens) ----------------------------
    def _reserve_budget(self) -> int | None:
        """A new round: the budget's tokens left for new prompts once the prefilling rows'
        next pieces (admission order, while they fit) are reserved; None: no budget."""
        self.round_tokens = 0
        if self.budget is None:
            self.round_left = None
            return None
        reserved = 0
        for req, done in self.prefilling.values():
            piece = min(self.chunk, len(req.prompt_ids) - done)
            if reserved + piece > self.budget:
                break
            reserved += piece
        self.round_left = reserved
        return self.budget - reserved

    def _cached_estimate(self, req: Request) -> int:
        """Prompt tokens of `req` the prefix cache would give it now (`KVManager.take`'s)."""
        if not self.kv.sharing or not self.device.pool_written:
            return 0
        return len(self.pool.cached_prefix(req.prompt_ids, req.cache_salt)) * self.pool.page_size

    def _budgeted(self, entries: list) -> list:
        """The prefilling (slot, [request, done]) entries whose next piece (a chunk, or the
        rest) fits what the round has left, in admission order; all of them without a budget."""
        if self.round_left is None:
            return entries
        chosen = []
        for slot, entry in entries:
            piece = min(self.chunk, len(entry[0].prompt_ids) - entry[1])
            if piece > self.round_left:
                break
            self.round_left -= piece
            chosen.append((slot, entry))
        return chosen

    # ---- batched admission (serving.batch_prefill) ------------------------------------------
    def _prefill_batched(self, ready: list[tuple[Request, int, int]]) -> None:
        """(request, slot, prompt tokens already in its pages) prefilled several rows a call:
        grouped by program (the prompt's bucket, and the tail's for tails over pages already
        written: a `TailTarget` program), so no row computes a longer row's padding, and each
        group cut into compiled widths (`batch.split_widths`: no padded rows)."""
        def shape(x):  # the call's program: prompt bucket, tail bucket (0: whole prompts)
            req, _, done = x
            n, as_tail = len(req.prompt_ids), bool(done) or self.whole_as_tail
            return prompt_width(n, as_tail, self.tail_width), tail_bucket(n - done) if as_tail else 0

        for key in sorted({shape(x) for x in ready}):  # no row padded to a longer one's bucket
            group = sorted((x for x in ready if shape(x) == key),
                           key=lambda x: len(x[0].prompt_ids))
            for n in split_widths(self.shape.widths, len(group)):
                self._prefill_rows_confined(group[:n])
                group = group[n:]

    def _prefill_rows_confined(self, items: list[tuple[Request, int, int]]) -> None:
        """`_prefill_rows`; when the call fails, each row is prefilled alone, so only the
        request that caused it fails."""
        alone = len(items) == 1
        with self._confined([r for r, _, _ in items], [s for _, s, _ in items],
                            release=alone) as failed:
            self._prefill_rows(items)
        if not failed:
            return
        if alone:
            self.ledger.fail(items[0][0], failed[0])
            return
        for item in items:
            self._prefill_rows_confined([item])

    def _prefill_rows(self, items: list[tuple[Request, int, int]]) -> None:
        """One prefill call over these rows (a batch of `_prefill_into`), spliced into their
        slots (`rows.insert_rows`)."""
        t0 = time.perf_counter()
        reqs, slots, dones = zip(*items)
        spec, as_tail = self.spec, any(dones) or self.whole_as_tail
        if as_tail:
            tail = tail_bucket(max(len(r.prompt_ids) - d for r, d in zip(reqs, dones)))
            spec = dataclasses.replace(spec, target=paged_cache.TailTarget(spec.target, tail))
        prompt = np.zeros((len(reqs), prompt_width(max(len(r.prompt_ids) for r in reqs),
                                                   as_tail, self.tail_width)), np.int32)
        for i, r in enumerate(reqs):
            prompt[i, : len(r.prompt_ids)] = r.prompt_ids
        sp = prefill_sampling([r.sampling.values for r in reqs])
        group = self.engine.prefill_rows(
            spec, jnp.asarray(prompt), jnp.asarray([len(r.prompt_ids) for r in reqs], jnp.int32),
            jnp.asarray([r.sampling.max_tokens for r in reqs], jnp.int32), sp, self.device.key,
            jnp.asarray([r.seed for r in reqs], jnp.int32), self.shape.capacity,
            cache=self.device.take_pool_rows(slots, dones) if self.shape.paged else None,
            penalties=self.engine.row_penalties([r.sampling.penalties for r in reqs]),
            grammar=self.device.grammar_rows([r.constraint for r in reqs], slots, self._live()))
        group = self.engine.with_adaptive(group, self.spec, costs_batch=1)
        for r, slot in zip(reqs, slots):
            self.kv.written(slot, r.prompt_ids, r.cache_salt)
        self.round_tokens += sum(len(r.prompt_ids) - d for r, d in zip(reqs, dones))
        self.device.splice_rows(group, slots)
        for r, slot in zip(reqs, slots):
            self.ledger.activate(r, slot)
        self.stats.prefill_s += time.perf_counter() - t0
        self._count_call(sum(len(r.prompt_ids) - d for r, d in zip(reqs, dones)))

    def _prefill_chunks_batched(self) -> bool:
        """`_prefill_chunks` with every prefilling row's next chunk in one write per compiled
        width, and the rows whose rest fits one chunk prefilled together (`_prefill_batched`)."""
        entries = sorted(self._budgeted(list(self.prefilling.items())))
        more = [(s, e) for s, e in entries if len(e[0].prompt_ids) - e[1] > self.chunk]
        last = [(e[0], s, e[1]) for s, e in entries if len(e[0].prompt_ids) - e[1] <= self.chunk]
        while more:
            t0 = time.perf_counter()
            n = split_widths(self.shape.widths, len(more))[0]
            part, more = more[:n], more[n:]
            cache = self.device.take_pool_rows([s for s, _ in part], [e[1] for _, e in part])
            tokens = jnp.asarray([e[0].prompt_ids[e[1] : e[1] + self.chunk] for _, e in part],
                                 jnp.int32)
            cache = self.engine.write_prompt(self.spec.target, tokens, cache)
            self.device.set_cache(k=cache.k, v=cache.v)
            self.round_tokens += self.chunk * len(part)
            for slot, entry in part:
                entry[1] += self.chunk
                self.kv.written(slot, entry[0].prompt_ids[: entry[1]],  # shareable already
                                entry[0].cache_salt)
            self.stats.prefill_s += time.perf_counter() - t0
            self._count_call(self.chunk * len(part), chunks=len(part))
        for _, slot, _ in last:
            del self.prefilling[slot]
        self._prefill_batched(last)
        return bool(self.prefilling) or bool(self.ledger.active)
