"""Token-budget scheduling: each step is a list of (request, number of new tokens).

Running requests go first (a decode asks for 1 token, a request still prefilling for
the next chunk of its prompt), then waiting requests are admitted while the step's
token budget, the cap on running requests and the free KV blocks allow. When a running
request cannot get a block, the lowest-priority running request (the newest, under
FCFS) is preempted: its blocks are freed and it is recomputed later from its prompt
and the tokens it already produced, so nothing is lost or repeated.

A KV connector's scheduler half (the disk tier, a decode instance's) may say that more
of a waiting request's prompt, past its prefix-cache hit, can be loaded: those tokens
get blocks and count as computed, like the hit, and the step's output lists the loads.
A request whose blocks are still on their way (`is_ready` is False) stays parked in the
waiting queue, in its place, while others are admitted past it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sluice.config import LOCAL_KV_GROUP, EngineConfig
from sluice.core.request import Request, RequestStatus
from sluice.engine.kv_cache import CacheHit, KVCacheManager
from sluice.engine.kv_connector.base import BlockTransfer, KVConnectorScheduler


@dataclass
class SchedulerOutput:
    # (request, num_new_tokens) in batch order; requests[i].num_computed_tokens is
    # still the value before this step (the runner reads it as the start position).
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # The same for the local pool of a split KV cache (its block ids are its own).
    local_blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Blocks a KV connector writes into the pool before the forward pass.
    kv_loads: list[BlockTransfer] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class _DraftRoom:
    """What a step has for draft tokens after every running request's own tokens."""

    tokens: int
    blocks: int


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        max_model_len: int,
        connector: KVConnectorScheduler | None = None,
        *,
        whole_prompts: bool = False,
    ) -> None:
        """whole_prompts: a request's prompt is granted in one step or not at all (an
        encoder's, whose attention looks both ways); the budget must hold the longest."""
        self.config = config
        self.whole_prompts = whole_prompts
        self.kv = kv
        # The scheduler half of a KV connector (the disk tier): prefix blocks it can
        # load count as computed, like a prefix-cache hit.
        self.connector = connector
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._priority = config.scheduling_policy == "priority"
        # The model's LoRA slots: at most this many distinct adapters run at once.
        self.max_loras = config.max_loras if config.enable_lora else 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def _order_key(self, r: Request) -> tuple[int, float]:
        return (r.priority if self._priority else 0, r.arrival_time)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self._priority:
            self.running.sort(key=self._order_key)

        # 1. Running requests, highest priority first, so preemption victims (taken
        #    from the tail) are never requests already granted tokens this step.
        #    Draft tokens only get the budget and the blocks left after every running
        #    request's own tokens, so they never cost anyone a token or a seat.
        room = self._draft_room(budget) if any(r.spec_token_ids for r in self.running) else None
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if room is not None and req.spec_token_ids:
                self._fit_drafts(req, room)
            num_new = min(
                req.num_tokens - req.num_computed_tokens + len(req.spec_token_ids), budget
            )
            while not self.kv.allocate_slots(req, num_new):
                if req.spec_token_ids:
                    req.spec_token_ids = []
                    num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                del req.spec_token_ids[max(0, req.num_computed_tokens + num_new - req.num_tokens) :]
                out.scheduled.append((req, num_new))
                budget -= num_new
                i += 1

        # 2. Waiting requests, unless this step had to preempt (memory is short).
        if not out.preempted:
            self._admit_waiting(out, budget)

        out.blocks_to_copy = self.kv.take_pending_copies()
        if self.kv.local_pool is not None:
            out.local_blocks_to_copy = self.kv.take_pending_copies(LOCAL_KV_GROUP)
        if self.connector is not None:
            out.kv_loads = self.connector.take_loads()
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while the budget, the seats and the blocks
        last. A request with nothing computed starts after its prefix-cache hit and the
        blocks the KV connector can load."""
        if self._priority and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self._order_key))
        # Parked keep their place: their KV is on its way, or their adapter needs a slot.
        parked: list[Request] = []
        adapters = (
            {r.lora.key for r in self.running if r.lora is not None} if self.max_loras else set()
        )
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            fresh = req.num_computed_tokens == 0
            if fresh and self.connector is not None and not self.connector.is_ready(req):
                parked.append(self.waiting.popleft())
                continue
            new_adapter = req.lora is not None and req.lora.key not in adapters
            if new_adapter and len(adapters) >= self.max_loras:
                parked.append(self.waiting.popleft())  # every slot is busy this step
                continue
            hit = self.kv.find_cached_prefix(req) if fresh else CacheHit([], 0)
            loadable = self._loadable_tokens(req, hit) if fresh else 0
            wanted = req.num_tokens - req.num_computed_tokens - hit.num_tokens - loadable
            num_new = min(wanted, budget)
            if self.whole_prompts and num_new < wanted:
                break  # it goes first next step, with the whole budget
            if not self.kv.allocate_slots(req, num_new, hit, loadable):
                break
            self.waiting.popleft()
            if self.connector is not None and fresh and self.kv.may_reuse_prefix(req):
                first = len(hit.blocks)
                loaded = req.block_ids[first : first + loadable // self.kv.block_size]
                self.connector.request_admitted(req, loaded)
            if req.num_cached_tokens < 0:  # first admission: count prompt-cache hits
                req.num_cached_tokens = hit.num_tokens + loadable
                self.kv.record_prefix_query(req.num_prompt_tokens, hit.num_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.lora is not None:
                adapters.add(req.lora.key)
            out.scheduled.append((req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(parked))

    def _loadable_tokens(self, req: Request, hit: CacheHit) -> int:
        """Prompt tokens past the RAM hit that the KV connector can load."""
        if self.connector is None or not self.kv.may_reuse_prefix(req):
            return 0
        return self.connector.num_loadable_tokens(req, hit.num_tokens)

    def _draft_room(self, budget: int) -> _DraftRoom:
        """The tokens of the budget and the free blocks that the running requests' own
        tokens leave this step."""
        tokens, blocks = budget, self.kv.num_free_blocks
        for r in self.running:
            tokens -= r.num_tokens - r.num_computed_tokens
            blocks -= self.kv.num_new_blocks(r, r.num_tokens)
        return _DraftRoom(tokens, blocks)

    def _fit_drafts(self, req: Request, room: _DraftRoom) -> None:
        """Trim the request's drafts to what `room` has left, and take that from it."""
        bs = self.kv.block_size
        held = max(len(req.block_ids), self.kv.blocks_needed(req.num_tokens))
        by_blocks = (held + max(room.blocks, 0)) * bs - req.num_tokens
        keep = max(0, min(len(req.spec_token_ids), room.tokens, by_blocks))
        del req.spec_token_ids[keep:]
        room.tokens -= keep
        room.blocks -= max(0, self.kv.blocks_needed(req.num_tokens + keep) - held)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def requeue(self, requests: list[Request]) -> None:
        """Send running requests back to the front of the queue, in their order, to be
        recomputed from prompt + outputs: after a failed step, whose KV writes may not
        have happened. Like a preemption, but not counted as one."""
        back = [r for r in requests if r.status == RequestStatus.RUNNING]
        if not back:
            return
        ids = {id(r) for r in back}
        self.running = [r for r in self.running if id(r) not in ids]
        for req in reversed(back):
            self.kv.free(req)
            req.spec_token_ids = []
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (finished or aborted) and return its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if self.connector is not None:
            self.connector.request_finished(req)  # what to save, while it holds its blocks
        self.kv.free(req)

    def add_running(self, req: Request) -> None:
        """A forked sequence joins the running set directly (it shares its parent's KV)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)
