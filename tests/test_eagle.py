"""Speculative decoding with the self-drafting (EAGLE-style) head, on the real model.

The bundled head (sluice/assets/eagle/, trained by training/train_eagle.py on the
bundled SmolLM2's own answers) drafts for the real SmolLM2 in fp32. Greedy and seeded
sampled output must equal the output without speculation token for token: alone,
batched, with prompts longer than a step's budget (the head catches up in chunks),
with prefix-cache hits (the head starts where the target's features start) and under
preemption; the head's KV pool must be free again when requests end; and its drafts
must mostly pass (it learnt something). The head's serving path (paged attention,
one ragged batch) must compute what the training code computes, and a head made for
another model, or a missing file, must be refused naming speculative_model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from sluice import LLM, SamplingParams
from sluice.config import EngineConfig
from sluice.core.errors import ConfigError
from sluice.core.quantized_tensor import dequantize, quantize_8bit
from sluice.core.request import Request
from sluice.engine.speculative.eagle import EagleProposer
from sluice.engine.speculative.eagle_load import BUNDLED_DIR, head_metadata, load_eagle_head
from sluice.engine.speculative.source import DraftBuild, DraftLoad
from sluice.layers.block_quant import BlockQuantized
from sluice.loader import load_model
from sluice.models.eagle import EAGLE_TENSORS, init_params, train_forward
from sluice.runner.factory import RunnerOptions
from sluice.runner.kv_layout import KVLayout

HEAD = BUNDLED_DIR / "smollm2-135m.safetensors"
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a hash map, one line each.",
]


def _engine(**kw: Any) -> LLM:
    return LLM(dtype="float32", max_num_batched_tokens=64, **kw)


@pytest.fixture(scope="module")
def eagle() -> LLM:
    # Draft at every decode step, any batch (the measured table: the test below).
    llm = _engine(speculative_method="eagle", num_speculative_tokens=4, speculative_draft_cost=0)
    assert llm.engine.speculator is not None and isinstance(llm.engine.draft, EagleProposer)
    return llm


@pytest.mark.usefixtures("step_costs_measured")
def test_the_heads_drafting_is_measured_at_start_up() -> None:
    """With no cost given, the table is measured (in the default dtype: its steps are
    the fast ones) and holds the head's drafting: it costs, and more of it costs more."""
    llm = LLM(speculative_method="eagle", num_speculative_tokens=3, kv_cache_memory=0.05)
    spec = llm.engine.speculator
    assert spec is not None and 1 <= spec.costs.max_rows == len(spec.costs.draft)
    assert all(d[0] == 0 < d[1] and list(d) == sorted(d) for d in spec.costs.draft)
    assert_head_pool_free(llm)


def chat(llm: LLM, texts: list[str]) -> list[list[int]]:
    tok = llm.tokenizer
    out = []
    for t in texts:
        text = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        out.append(list(tok.encode(text, add_special_tokens=False)))
    return out


def token_ids(llm: LLM, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(ps, params, use_tqdm=False)]


def without_speculation(llm: LLM, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The same engine with its speculator set aside (only the drafts differ)."""
    eng = llm.engine
    spec, eng.speculator = eng.speculator, None
    try:
        return token_ids(llm, ps, params)
    finally:
        eng.speculator = spec


def assert_head_pool_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests"] == 0
    assert stats["spec_draft_kv_free_blocks"] == stats["spec_draft_kv_total_blocks"] > 0
    draft = llm.engine.draft
    assert draft is not None and draft.num_tracked == 0


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


def test_bundled_head_is_for_the_bundled_model() -> None:
    meta = head_metadata(HEAD)
    assert meta["target"] == load_model(None).config.name
    assert float(meta["heldout_top1"]) > 0.5


def test_greedy_equals_no_speculation_and_drafts_pass(eagle: LLM) -> None:
    """Alone and batched; the prompts are longer than a step's budget of 64 tokens."""
    ps = chat(eagle, PROMPTS)
    before = eagle.stats()
    assert token_ids(eagle, ps[:1], greedy(64)) == without_speculation(eagle, ps[:1], greedy(64))
    assert token_ids(eagle, ps, greedy(64)) == without_speculation(eagle, ps, greedy(64))
    stats = eagle.stats()
    steps = stats["spec_verify_steps"] - before["spec_verify_steps"]
    emitted = stats["spec_emitted_tokens"] - before["spec_emitted_tokens"]
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    # The head learnt the model: each verification emits its accepted drafts and one
    # token of the target's own, >= 1.3 on average (a head that never guesses: 1.0).
    assert steps > 50 and emitted > 1.3 * steps and accepted > 0
    assert_head_pool_free(eagle)


def test_seeded_sampling_equals_no_speculation(eagle: LLM) -> None:
    """Greedy drafts are a one-hot proposal: accept-if-equal is exact rejection
    sampling, so sampled output is the target's, draw for draw."""
    sp = SamplingParams(temperature=0.7, top_p=0.9, seed=11, n=2, max_tokens=40, logprobs=1)
    ps = chat(eagle, PROMPTS[:2])
    before = eagle.stats()["spec_accepted_tokens"]
    ref = []
    eng = eagle.engine
    spec, eng.speculator = eng.speculator, None
    try:
        ref = eagle.generate(ps, sp, use_tqdm=False)
    finally:
        eng.speculator = spec
    got = eagle.generate(ps, sp, use_tqdm=False)
    assert eagle.stats()["spec_accepted_tokens"] > before
    for r, g in zip(ref, got, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in r.outputs]
    assert_head_pool_free(eagle)


def test_prefix_cache_hits_and_preemption() -> None:
    """A prompt sent again hits the prefix cache (the head starts where the target's
    features start); a pool too small for the batch preempts (the head's KV goes
    with the request's and is rebuilt from the recomputed features)."""
    llm = _engine(
        speculative_method="eagle",
        speculative_draft_cost=0.0,  # draft at every decode step, any batch
        enable_prefix_caching=True,
        kv_cache_memory=12 * 30 * 2 * 3 * 16 * 64 * 4 / 2**30,  # ~12 blocks of 16 tokens
        block_size=16,
    )
    assert llm.engine.speculator is not None
    ps = chat(llm, PROMPTS)
    long = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)  # ~7 blocks each
    ref = without_speculation(llm, ps, long)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert token_ids(llm, ps[:1], long) == ref[:1]
    assert llm.stats()["prefix_cache_hit_tokens"] > hits
    preemptions = llm.stats()["num_preemptions"]
    assert token_ids(llm, ps, long) == ref
    assert llm.stats()["num_preemptions"] > preemptions
    assert_head_pool_free(llm)


def test_serving_path_computes_what_training_computes() -> None:
    """The head on its ModelRunner (paged attention, a ragged batch of two sequences,
    one in two chunks) gives the guessed features train_forward gives."""
    target = load_model(None)
    params = init_params_scaled(target)
    path_cfg = EngineConfig.from_kwargs(dtype="float32", speculative_method="eagle")
    options = RunnerOptions(torch.float32, torch.device("cpu"), "none")
    head = load_eagle_head(DraftLoad(path_cfg, target, options))
    head.tensors.update({n: params[n].clone() for n in EAGLE_TENSORS})
    layout = KVLayout(block_size=path_cfg.block_size, num_blocks=64, max_model_len=512)
    proposer = head.build(DraftBuild(path_cfg, target.config, options, layout))
    embed = proposer.runner.model.embed_tokens
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 49152, (n,), generator=gen) for n in (21, 9)]
    feats = [torch.randn(len(s), 576, generator=gen) * 2 for s in seqs]
    reqs = [Request(f"s{i}", s.tolist(), SamplingParams(temperature=0)) for i, s in enumerate(seqs)]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for chunk in ((0, 13), (13, 21)):  # the first sequence in two steps, beside the second
        batch = [(reqs[0], chunk[1] - chunk[0])]
        fmap = {reqs[0]: feats[0][chunk[0] : chunk[1]]}
        if chunk[0] == 0:
            batch.append((reqs[1], 9))
            fmap[reqs[1]] = feats[1]
        for r, n in batch:
            assert proposer.kv.allocate_slots(r, n)
        out = proposer.runner.execute(batch, fmap)
        assert out.features is not None
        for r, n in batch:
            r.num_computed_tokens += n
            got[int(r.request_id[1])].append(out.features[r])
    with torch.no_grad():
        for i, s in enumerate(seqs):
            e = embed(s)[None]
            want = train_forward(params, head.config, e, feats[i][None])[0]
            torch.testing.assert_close(torch.cat(got[i]), want, rtol=1e-4, atol=1e-4)


def init_params_scaled(target: Any) -> dict[str, torch.Tensor]:
    """Random parameters large enough that attention is far from uniform."""
    from sluice.models.eagle import eagle_config

    params = init_params(eagle_config(target.config), seed=5)
    return {n: (p * 4 if p.dim() == 2 else p) for n, p in params.items()}


def test_errors_name_speculative_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="speculative_model") as e:
        LLM(speculative_method="eagle", speculative_model=str(tmp_path / "none.safetensors"))
    assert e.value.param == "speculative_model"
    wrong = tmp_path / "other.safetensors"
    tensors = {n: torch.zeros(1) for n in EAGLE_TENSORS}
    meta = {**head_metadata(HEAD), "target": "another model"}
    save_file(tensors, str(wrong), metadata=meta)
    with pytest.raises(ConfigError, match="another model") as e:
        LLM(speculative_method="eagle", speculative_model=str(wrong))
    assert e.value.param == "speculative_model"
    with pytest.raises(ConfigError, match="speculative_model"):
        LLM(speculative_method="ngram", speculative_model=str(HEAD))


def test_default_dtype_runs_the_head_on_block_kernels() -> None:
    """In the default dtype the target's weights stay block-quantized and so do the
    head's projections (8 bits, 32 a scale): drafts still pass."""
    llm = LLM(speculative_method="eagle", speculative_draft_cost=0.0, max_num_batched_tokens=64)
    draft = llm.engine.draft
    assert isinstance(draft, EagleProposer)
    if llm.engine.quantization == "gguf":
        fc = draft.runner.model.fc.method
        assert isinstance(fc, BlockQuantized) and fc.weight is not None and fc.weight.bits == 8
    assert llm.engine.speculator is not None
    ps = chat(llm, PROMPTS[:2])
    llm.generate(ps, greedy(48), use_tqdm=False)
    stats = llm.stats()
    # Each verification emits its accepted drafts and one token of the target's own.
    assert stats["spec_verify_steps"] > 10 and stats["spec_mean_accepted_length"] > 1.3
    assert_head_pool_free(llm)


def test_quantize_8bit_is_within_half_a_step() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    w[3, :32] = 0  # an all-zero group stays zero
    q = quantize_8bit(w)
    assert (q.bits, q.group, q.source) == (8, 32, "Q8_0")
    step = w.abs().reshape(64, 4, 32).amax(-1, keepdim=True) / 127
    err = (dequantize(q) - w).abs().reshape(64, 4, 32)
    assert (err <= step * 0.5 + 1e-3 * step + 1e-7).all()
    assert dequantize(q)[3, :32].eq(0).all()
