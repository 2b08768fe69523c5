"""What draft tokens cost on this machine: measured once per model and CPU, then cached.

Speculation pays only when a step that verifies k drafts costs less than the tokens it
is expected to yield, and that cost is a property of the hardware, the kernels and the
model, not a constant. On this project's Zen 4 with the bundled model (bfloat16, its
GGUF blocks), a single decode row verifying 1, 2, 3 drafts takes 1.25, 1.55, 2.6 plain
steps (the 3-row decode stack makes the first two cheap) and with two decode rows a
draft already costs 0.8-0.9 of a step; on an AVX2 CPU, in fp32, or with a 1.5B model
whose step is longer and more bound by weight reads, the table is different. A fixed
table would either leave speed unused or make speculation slower than plain decoding,
which is what users of the other engines report. So the engine measures the table at
start-up, the way vLLM's users are told to tune their schedule by hand:

- `rel[b - 1][k]`: the time of a step in which b decode rows each verify k drafts,
  over the time of the same step with no drafts, for b = 1..max_rows and k =
  0..max_drafts, each the median of a few interleaved timings (one warm-up round
  first) at a short context, through the runner and the sampler as a verifying step
  runs. Beyond max_rows decode rows nothing is measured and nothing is speculated:
  with many rows a step is compute bound, where drafts cost as much as tokens.
- With a draft model, its drafting is timed too (draft.py's passes: a catch-up step of
  two tokens a row, as after a step whose drafts all passed, then k - 1 one-token
  steps, batched over the rows): `draft[m - 1][k]` is drafting k tokens for m rows,
  and `plain[b - 1]` the plain step of b decode rows, both in plain one-row steps,
  so that the speculator can charge m drafting rows' draft time to a step of b rows.
- The measurement uses its own requests and blocks and leaves the pool and the
  prefix cache as they were; it takes about a second for the bundled model and tens
  of seconds for a 1.5B one, hence the cache: `cache_dir()/step_costs/<key>.json`,
  keyed by the model file, dtype, weight format, kernel build, threads, device and
  the versions of sluice and torch. Delete the file to measure again, or give
  `speculative_draft_cost` to plan with a flat cost and measure nothing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.core.request import DraftRow, Request, SamplingRow
from sluice.engine.kv_cache import KVCacheManager
from sluice.runner.model_runner import ModelRunner
from sluice.runner.sampler import Sampler
from sluice.sampling_params import SamplingParams
from sluice.settings import cache_dir

logger = logging.getLogger(__name__)

MAX_ROWS = 4  # decode rows measured (and so the most that ever speculate)
MAX_MEASURED_DRAFTS = 8  # beyond this, the table is extended by its last slope
CONTEXT = 128  # tokens each measuring request holds
ROUNDS = 4  # timed rounds per case, after one warm-up round


@dataclass(frozen=True)
class StepCosts:
    """rel[b - 1][k]: a step with b decode rows verifying k drafts each, in steps with
    none."""

    rel: tuple[tuple[float, ...], ...]
    # A draft model's drafting (none: drafts come free, as the n-gram proposers'
    # nearly do): draft[m - 1][k] for m rows and k drafts, and plain[b - 1], the plain
    # step of b rows, both in plain one-row steps.
    draft: tuple[tuple[float, ...], ...] = ()
    plain: tuple[float, ...] = ()

    @property
    def max_rows(self) -> int:
        return len(self.rel)

    def cost(self, rows: int, k: int) -> float:
        """Step time with `rows` decode rows of k drafts (extended by the last slope
        past the measured drafts); `rows` must be at most max_rows."""
        return _extended(self.rel[rows - 1], k)

    def draft_cost(self, rows: int, m: int, k: int) -> float:
        """The time m of a step's `rows` decode rows take to draft k tokens each, in
        plain steps of `rows` rows (0 without a draft model)."""
        if not self.draft:
            return 0.0
        return _extended(self.draft[m - 1], k) / self.plain[rows - 1]

    def describe(self) -> str:
        text = "; ".join(
            f"{b} row(s): " + " ".join(f"{c:.2f}" for c in row) for b, row in enumerate(self.rel, 1)
        )
        if self.draft:
            text += "; drafting, in 1-row steps: " + "; ".join(
                f"{m} row(s): " + " ".join(f"{c:.2f}" for c in row[1:])
                for m, row in enumerate(self.draft, 1)
            )
        return text

    @classmethod
    def uniform(cls, per_draft: float, max_rows: int, max_drafts: int = 8) -> StepCosts:
        """Every draft costs `per_draft` of a step, at any batch: config.speculative_draft_cost,
        and tests."""
        row = tuple(1.0 + per_draft * k for k in range(max_drafts + 1))
        return cls(tuple(row for _ in range(max_rows)))


def _extended(table: Sequence[float], k: int) -> float:
    """table[k], extended past its end by its last slope."""
    if k < len(table):
        return table[k]
    return table[-1] + (k - len(table) + 1) * (table[-1] - table[-2])


def cache_key(parts: dict[str, object]) -> str:
    try:
        ours = importlib.metadata.version("sluice")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        ours = "unknown"
    blob = json.dumps({**parts, "sluice": ours, "torch": torch.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def load_or_measure(
    key_parts: dict[str, object], measure: StepCostMeasurement, cache: Path | None = None
) -> StepCosts:
    """The cached table for these settings, or a new measurement (then cached)."""
    path = (cache or cache_dir() / "step_costs") / f"{cache_key(key_parts)}.json"
    try:
        data = json.loads(path.read_text())
        return StepCosts(
            _table(data["rel"]), _table(data.get("draft", ())), tuple(data.get("plain", ()))
        )
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measure (and write it again)
    t0 = time.perf_counter()
    costs = measure.run()
    logger.info(
        "speculation: measured the step-cost table in %.1fs (%s); cached in %s",
        time.perf_counter() - t0,
        costs.describe(),
        path,
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        record = {"key": key_parts, "rel": costs.rel, "draft": costs.draft, "plain": costs.plain}
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only cache only costs the next start-up a measurement
        logger.warning("could not cache the step-cost table in %s: %s", path, e)
    return costs


def _table(rows: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(x) for x in row) for row in rows)


class StepCostMeasurement:
    """Times verifying steps on the engine's own runner, KV pool and sampler (and a
    draft model's steps on its runner and pool)."""

    def __init__(
        self,
        runner: ModelRunner,
        kv: KVCacheManager,
        sampler: Sampler,
        max_drafts: int,
        draft: tuple[ModelRunner, KVCacheManager] | None = None,
    ) -> None:
        self.runner = runner
        self.kv = kv
        self.sampler = sampler
        self.max_drafts = min(max_drafts, MAX_MEASURED_DRAFTS)
        self.draft = draft

    def run(self) -> StepCosts:
        reqs = _requests(self.runner, self.kv, CONTEXT, self.max_drafts + 1, "target")
        shadows: list[Request] = []
        if self.draft is not None:  # every measured row drafts too
            shadows = _requests(*self.draft, CONTEXT + 1, 0, "draft")
            for r in reqs[len(shadows) :]:  # rows the draft pool could not hold
                self.kv.free(r)
            for r in shadows[len(reqs) :]:
                self.draft[1].free(r)
            reqs, shadows = reqs[: len(shadows)], shadows[: len(reqs)]
        if not reqs:  # a pool too small to measure in: speculate nowhere
            return StepCosts(((1.0, 2.0),))
        try:
            with torch.inference_mode():
                return self._measure(reqs, shadows)
        finally:
            for r in reqs:
                r.spec_token_ids = []
                self.kv.free(r)
            for r in shadows:
                assert self.draft is not None
                self.draft[1].free(r)
            # Their blocks were named as they filled: forget them (the cache is empty
            # at start-up, so nothing else goes).
            self.kv.reset_prefix_cache()

    def _measure(self, reqs: list[Request], shadows: list[Request]) -> StepCosts:
        rows = range(1, len(reqs) + 1)
        cases = [("verify", b, k) for b in rows for k in range(self.max_drafts + 1)]
        cases += [("draft", b, n) for b in rows for n in (1, 2) if shadows]
        times: dict[tuple[str, int, int], list[float]] = {c: [] for c in cases}
        for rnd in range(ROUNDS + 1):
            order = cases if rnd % 2 == 0 else cases[::-1]  # interleaved against drift
            for case in order:
                kind, b, n = case
                if kind == "verify":
                    t = self._time_step(reqs[:b], n)
                else:
                    t = self._time_draft(shadows[:b], n)
                if rnd > 0:
                    times[case].append(t)
        med = {c: statistics.median(ts) for c, ts in times.items()}
        rel = tuple(
            tuple(med[("verify", b, k)] / med[("verify", b, 0)] for k in range(self.max_drafts + 1))
            for b in rows
        )
        if not shadows:
            return StepCosts(_monotone(rel))
        unit = med[("verify", 1, 0)]
        plain = tuple(med[("verify", b, 0)] / unit for b in rows)
        draft = []
        for b in rows:
            one, two = med[("draft", b, 1)], max(med[("draft", b, 1)], med[("draft", b, 2)])
            ks = range(1, self.max_drafts + 1)
            draft.append((0.0, *((two + (k - 1) * one) / unit for k in ks)))
        return StepCosts(_monotone(rel), tuple(draft), plain)

    def _time_step(self, reqs: Sequence[Request], k: int) -> float:
        """One verifying step of `reqs` with k drafts each; nothing is kept."""
        rows: list[SamplingRow] = []
        for r in reqs:
            r.spec_token_ids = [r.all_token_ids[-1]] * k
            rows.append(r)
            rows.extend(DraftRow(r, r.spec_token_ids[:j]) for j in range(1, k + 1))
        _sync(self.runner.device)
        t0 = time.perf_counter()
        out = self.runner.execute([(r, 1 + k) for r in reqs])
        self.sampler(out.logits, rows, [[] for _ in rows])
        _sync(self.runner.device)
        elapsed = time.perf_counter() - t0
        for r in reqs:
            r.spec_token_ids = []
        return elapsed

    def _time_draft(self, shadows: Sequence[Request], n: int) -> float:
        """One draft-model pass over `shadows`, n tokens each (two: a catch-up after
        every draft passed; one: a drafting step), and its greedy pick, as
        draft_model.py runs them."""
        assert self.draft is not None
        runner = self.draft[0]
        for s in shadows:  # each holds CONTEXT + 1 tokens
            s.num_computed_tokens = CONTEXT + 1 - n
        _sync(runner.device)
        t0 = time.perf_counter()
        out = runner.execute([(s, n) for s in shadows])
        out.logits.argmax(dim=-1).tolist()
        _sync(runner.device)
        return time.perf_counter() - t0


def _requests(
    runner: ModelRunner, kv: KVCacheManager, length: int, extra: int, name: str
) -> list[Request]:
    """Up to MAX_ROWS requests of `length` prompt tokens, as many as the pool takes
    with room for `extra` more, their first CONTEXT - 1 tokens computed."""
    reqs: list[Request] = []
    per_req = kv.blocks_needed(length + extra)
    for i in range(MAX_ROWS):
        if kv.num_free_blocks < per_req:
            break
        # Distinct prompts, so that no measuring request hits another's blocks.
        prompt = [(1000 + 7 * i + 13 * j) % 30_000 + 1 for j in range(length)]
        req = Request(f"__step_cost_{name}_{i}", prompt, SamplingParams(temperature=0))
        # Blocks for the prompt and the most drafts a step verifies, held throughout
        # (a timed step only writes past the first CONTEXT - 1 tokens).
        assert kv.allocate_slots(req, length + extra)
        reqs.append(req)
    if reqs:
        runner.execute([(r, CONTEXT - 1) for r in reqs])
        for r in reqs:
            r.num_computed_tokens = CONTEXT - 1
    return reqs


def _monotone(rel: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
    """More drafts never cost less (timing noise aside): a running maximum per row,
    starting at 1."""
    out = []
    for row in rel:
        fixed, top = [], 1.0
        for c in row:
            top = max(top, c)
            fixed.append(top)
        out.append(tuple(fixed))
    return tuple(out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
