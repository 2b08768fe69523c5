"""Speculative decoding with a draft model: lossless, and no draft block outlives its request.

Fast tests use small random-weight Qwen2 models (fp32) with the SmolLM2 tokenizer: a
target, a "close" draft (the target's weights plus noise: it agrees with the target on
most tokens, not all, so steps accept some drafts and reject others) and a "far" one
of another shape that agrees on almost nothing. Their engines are made to draft at
every decode step, whatever the measured cost model says: these tests are about the
mechanism. Greedy and seeded sampled output must equal the output without
speculation token for token (alone, batched, with a prompt longer than a step's
budget, under preemption), the draft's KV must be rolled back to what the target
accepted, and the draft pool must be full again once requests finish, are preempted
or are aborted. Then the errors (another tokenizer, a vocabulary too small), the options
and the cost model. The slow tests run the real Qwen2.5-Coder pair.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from sluice import LLM, SamplingParams
from sluice.cli import build_parser, engine_config
from sluice.config import EngineConfig
from sluice.core.errors import ConfigError, ModelNotFoundError
from sluice.core.request import Request
from sluice.engine.speculative import StepCosts, plan_drafts
from sluice.engine.speculative.draft_model import DraftModelProposer
from sluice.loader import resolve_model_path, tokenizer_from_gguf

VOCAB = 49152  # the SmolLM2 tokenizer's
SHAPE = dict(
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.3,  # peaky logits: no near-ties for greedy to trip on
    tie_word_embeddings=False,
    rope_theta=1000000.0,
    bos_token_id=1,
    eos_token_id=2,
)
TARGET = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
FAR = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
CLOSE_NOISE = 0.01  # relative to each weight's spread: ~40% of drafts accepted
BLOCK = 8
# A step costs one decode step whatever its drafts and drafting is free: always draft.
ALWAYS = StepCosts.uniform(0.0, max_rows=16)


def _save(model: torch.nn.Module, directory: Path, smollm2_path: Path) -> Path:
    model.save_pretrained(directory)
    tokenizer_from_gguf(smollm2_path).save(directory)
    return directory


def _random_qwen2(shape: dict[str, int], seed: int, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**{**SHAPE, **shape, **overrides})
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-models")
    target = _random_qwen2(TARGET, seed=0)
    paths = {"target": _save(target, root / "target", smollm2_path)}
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in target.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * CLOSE_NOISE)
    paths["close"] = _save(target, root / "close", smollm2_path)
    paths["far"] = _save(_random_qwen2(FAR, seed=2), root / "far", smollm2_path)
    return paths


def engine(models: dict[str, Path], draft: str | None, blocks: int = 96, **kw: Any) -> LLM:
    """An fp32 engine on the random target with `blocks` KV blocks (for each model),
    drafting at every decode step of any batch when it has a draft model."""
    per_block = 2 * 3 * 2 * BLOCK * 2 * 32 * 4  # both models' KV, the target's shape
    options: dict[str, Any] = {
        "dtype": "float32",
        "block_size": BLOCK,
        "kv_cache_memory": blocks * per_block / 2**30,
        "max_num_batched_tokens": 48,
        **kw,
    }
    if draft is None:
        options["kv_cache_memory"] /= 2  # the same number of target blocks
        return LLM(model=str(models["target"]), **options)
    llm = LLM(
        model=str(models["target"]),
        speculative_model=str(models[draft]),
        num_speculative_tokens=4,
        **options,
    )
    spec = llm.engine.speculator
    assert spec is not None and isinstance(llm.engine.draft, DraftModelProposer)
    # Measured at start-up: verifying more drafts never costs less, drafting costs, and
    # more of it costs more.
    costs = spec.costs
    assert 1 <= costs.max_rows == len(costs.draft) == len(costs.plain)
    for rel, drafting in zip(costs.rel, costs.draft, strict=True):
        assert len(rel) == 5 and rel[0] == 1.0 and list(rel) == sorted(rel)
        assert drafting[0] == 0 < drafting[1] and list(drafting) == sorted(drafting)
    assert costs.plain[0] == 1.0
    spec.costs = ALWAYS
    return llm


@pytest.fixture(scope="module")
def plain(models: dict[str, Path]) -> LLM:
    return engine(models, None)


@pytest.fixture(scope="module")
def close(models: dict[str, Path]) -> LLM:
    return engine(models, "close")


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


def token_ids(llm: LLM, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(ps, params, use_tqdm=False)]


def without_speculation(llm: LLM, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """token_ids from the same engine with its speculator set aside (same weights, pools
    and kernels: only the drafts differ)."""
    eng = llm.engine
    spec, eng.speculator = eng.speculator, None
    try:
        return token_ids(llm, ps, params)
    finally:
        eng.speculator = spec


def assert_draft_pool_full(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests"] == 0
    assert stats["spec_draft_kv_free_blocks"] == stats["spec_draft_kv_total_blocks"] > 0
    draft = llm.engine.draft
    assert draft is not None and draft.num_tracked == 0


# ---- lossless ---------------------------------------------------------------------


def test_greedy_equals_no_speculation(plain: LLM, close: LLM) -> None:
    """Alone, then batched with a prompt longer than a step's budget (the draft catches
    up on it in chunks) and one the far draft would never guess."""
    before = close.stats()
    ps = prompts(5, 23, 70, 9)
    for p in ps[:2]:
        assert token_ids(close, [p], greedy(24)) == token_ids(plain, [p], greedy(24))
    assert token_ids(close, ps, greedy(24)) == token_ids(plain, ps, greedy(24))
    stats = close.stats()
    drafted = stats["spec_drafted_tokens"] - before["spec_drafted_tokens"]
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < drafted  # some drafts pass, some fail: both paths ran
    assert_draft_pool_full(close)


def test_a_draft_that_is_always_wrong_changes_nothing(models: dict[str, Path], plain: LLM) -> None:
    far = engine(models, "far")
    ps = prompts(7, 31, seed=1)
    assert token_ids(far, ps, greedy(16)) == token_ids(plain, ps, greedy(16))
    assert far.stats()["spec_drafted_tokens"] > 0
    assert_draft_pool_full(far)


def test_seeded_sampling_equals_no_speculation(plain: LLM, close: LLM) -> None:
    """Greedy drafts are a one-hot proposal, for which the target's accept-if-equal rule
    is exact rejection sampling: sampled output is the target's, draw for draw."""
    sp = SamplingParams(temperature=0.8, top_k=20, seed=7, n=2, max_tokens=24, logprobs=1)
    ps = prompts(12, 40, seed=2)
    before = close.stats()["spec_accepted_tokens"]
    ref = plain.generate(ps, sp, use_tqdm=False)
    got = close.generate(ps, sp, use_tqdm=False)
    assert close.stats()["spec_accepted_tokens"] > before
    for r, g in zip(ref, got, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in r.outputs]
    assert_draft_pool_full(close)


# ---- the draft's KV ----------------------------------------------------------------


def test_draft_kv_is_rolled_back_to_the_accepted_tokens(
    close: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After each verifying step the draft keeps exactly its KV of tokens the target
    now has (accepted drafts included, so it never recomputes them) and holds no block
    past it."""
    eng = close.engine
    draft = eng.draft
    assert draft is not None
    verifying: list[Request] = []
    execute = eng.runner.execute

    def recording(scheduled: list[tuple[Request, int]]) -> Any:
        verifying[:] = [r for r, _ in scheduled if r.spec_token_ids]
        return execute(scheduled)

    monkeypatch.setattr(eng.runner, "execute", recording)
    for i, p in enumerate(prompts(6, 20, 33, seed=3)):
        eng.add_request(f"kv{i}", p, greedy(20))
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        for req in verifying:
            shadow = draft._shadows.get(req)
            if shadow is None:
                assert req.is_finished  # its draft KV went with it
                continue
            seq, computed = shadow.seq, shadow.seq.num_computed_tokens
            assert seq.all_token_ids[:computed] == req.all_token_ids[:computed]
            assert len(seq.block_ids) == draft.kv.blocks_needed(computed)
            # k drafts, a accepted: the draft had computed the known tokens and the
            # first k - 1 drafts, and keeps them up to the first rejected one.
            assert req.num_tokens - 2 <= computed <= req.num_tokens - 1
            checked += 1
    assert checked > 10
    assert_draft_pool_full(close)


def test_preemption_frees_the_draft_blocks(models: dict[str, Path], plain: LLM) -> None:
    small = engine(models, "close", blocks=14, max_num_batched_tokens=32)
    ps = prompts(30, 26, 35, seed=4)  # ~30 tokens + 24 out each: three do not fit in 14
    assert token_ids(small, ps, greedy(24)) == token_ids(plain, ps, greedy(24))
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_accepted_tokens"] > 0
    assert_draft_pool_full(small)


def test_abort_frees_the_draft_blocks(close: LLM) -> None:
    eng = close.engine
    for i, p in enumerate(prompts(10, 25, seed=5)):
        eng.add_request(f"ab{i}", p, greedy(40))
    for _ in range(6):
        eng.step()
    stats = close.stats()
    assert stats["spec_draft_kv_free_blocks"] < stats["spec_draft_kv_total_blocks"]
    assert eng.abort_request("ab0") and eng.abort_request("ab1")
    assert_draft_pool_full(close)


# ---- errors, options, cost -----------------------------------------------------------


@pytest.fixture
def other_tokenizer(models: dict[str, Path], tmp_path: Path) -> Iterator[Path]:
    """The close draft with two tokens' ids swapped in its tokenizer."""
    directory = tmp_path / "swapped"
    directory.mkdir()
    for f in models["close"].iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (1000, 1001))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    yield directory


def test_a_draft_with_another_tokenizer_is_refused(
    models: dict[str, Path], other_tokenizer: Path, tmp_path: Path, smollm2_path: Path
) -> None:
    with pytest.raises(ConfigError, match="does not share the target model's tokenizer") as err:
        LLM(model=str(models["target"]), speculative_model=str(other_tokenizer), dtype="float32")
    assert err.value.param == "speculative_model"
    assert "token 100" in str(err.value)
    # A model whose vocabulary is smaller than the tokenizer: incompatible vocab sizes.
    tiny = _save(_random_qwen2(FAR, seed=3, vocab_size=VOCAB - 100), tmp_path / "t", smollm2_path)
    with pytest.raises(ConfigError, match="incompatible vocab sizes") as err:
        LLM(model=str(models["target"]), speculative_model=str(tiny), dtype="float32")
    assert err.value.param == "speculative_model"


def test_options_and_flag() -> None:
    for command in (["serve"], ["generate", "hi"], ["chat"]):
        args = build_parser().parse_args([*command, "--speculative-model", "qwen2.5-coder-0.5b"])
        cfg = engine_config(args)
        assert cfg.speculative_model == "qwen2.5-coder-0.5b"
        assert cfg.speculative_method == "draft"  # implied by the model
    with pytest.raises(ConfigError) as err:
        EngineConfig(speculative_method="draft")
    assert err.value.param == "speculative_model"
    with pytest.raises(ConfigError, match="speculative_method='draft'") as err:
        EngineConfig(speculative_method="ngram", speculative_model="x")
    assert err.value.param == "speculative_model"
    args = build_parser().parse_args(["serve", "--speculative-draft-vocab-size", "32768"])
    assert engine_config(args).speculative_draft_vocab_size == 32768
    for bad in (-1, 2.5, True, None):
        with pytest.raises(ConfigError) as err:
            EngineConfig(speculative_model="x", speculative_draft_vocab_size=bad)
        assert err.value.param == "speculative_draft_vocab_size"
    with pytest.raises(ConfigError) as err:
        LLM(speculative_model="no-such-model")
    assert err.value.param == "speculative_model"
    assert isinstance(err.value.__cause__, ModelNotFoundError)


def test_cost_model_counts_the_draft(close: LLM) -> None:
    """k comes from expected tokens over the step's cost, drafting included."""
    verify = ((1.0, 1.1, 1.2, 1.3, 1.4),)  # verifying is nearly free, one row

    def per_draft(cost: float) -> StepCosts:
        return StepCosts(verify, ((0.0, *(k * cost for k in range(1, 5))),), (1.0,))

    assert plan_drafts([0.9], [4], StepCosts(verify)) == [4]  # no drafting cost
    assert plan_drafts([0.9], [4], per_draft(0.4))[0] < 4  # drafting is not free
    assert plan_drafts([0.9], [4], per_draft(1.0)) == [0]  # as dear as the target
    assert plan_drafts([0.3], [4], per_draft(0.4)) == [0]  # acceptance too low
    # Two rows: drafting for one of them is charged against a step of both.
    two = StepCosts(verify * 2, ((0.0, 0.2, 0.4, 0.6, 0.8), (0.0, 0.3, 0.6, 0.9, 1.2)), (1.0, 1.2))
    assert two.draft_cost(2, 1, 1) == pytest.approx(0.2 / 1.2)
    assert plan_drafts([0.95, 0.2], [4, 4], two) == [4, 0]
    eng = close.engine
    assert eng.draft is not None
    run = Request("c", [5] * 10, greedy(4))
    assert eng.draft.propose([run], [0]) == [[]]  # asked for nothing: no forward
    assert eng.draft.num_tracked == 0


def test_a_request_holding_an_id_the_draft_lacks_is_not_drafted_for(
    close: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Vocabularies padded to different sizes: drafts are ids both models have."""
    draft = close.engine.draft
    assert draft is not None
    req = Request("v", [5, 6, 7, 8], greedy(4))
    assert len(draft.propose([req], [2])[0]) == 2 and draft.num_tracked == 1
    monkeypatch.setattr(draft, "vocab_size", 1000)
    req.append_token(4000)  # an id past the draft's vocabulary
    assert draft.propose([req], [2]) == [[]]
    assert draft.num_tracked == 0 and draft.kv.num_free_blocks == draft.kv.pool.num_blocks


def _recording_drafts(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every draft token the engine's draft model proposes from now on."""
    draft = llm.engine.draft
    assert draft is not None
    seen: list[int] = []
    propose = draft.propose

    def record(requests: Any, num_tokens: Any) -> list[list[int]]:
        out = propose(requests, num_tokens)
        seen.extend(t for d in out for t in d)
        return out

    monkeypatch.setattr(draft, "propose", record)
    return seen


def test_a_restricted_draft_head_proposes_its_ids_only(
    models: dict[str, Path], plain: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """speculative_draft_vocab_size=N: the draft's head has rows for ids 0..N-1 and the
    added tokens only, every draft is one of them, and the output is unchanged."""
    size = VOCAB // 2
    llm = engine(models, "close", speculative_draft_vocab_size=size)
    draft = llm.engine.draft
    assert draft is not None and draft.output_ids is not None
    kept = set(draft.output_ids.tolist())
    assert set(range(size)) <= kept and len(kept) < VOCAB
    assert draft.runner.model.lm_head.out_features == len(kept)
    seen = _recording_drafts(llm, monkeypatch)
    ps = prompts(5, 23, 70, seed=3)
    assert token_ids(llm, ps, greedy(24)) == token_ids(plain, ps, greedy(24))
    assert seen and set(seen) <= kept
    assert llm.stats()["spec_accepted_tokens"] > 0
    assert_draft_pool_full(llm)


def test_draft_output_ids_keep_the_added_tokens(smollm2_path: Path) -> None:
    """Added tokens past the first N ids (Qwen's end-of-turn marks sit at the end of its
    vocabulary) stay in a restricted head; a size covering the vocabulary is no cut."""
    from sluice.engine.speculative.draft_load import draft_output_ids

    tok = tokenizer_from_gguf(smollm2_path)
    tok.backend.add_special_tokens(["<|late_mark|>"])
    late = tok.backend.token_to_id("<|late_mark|>")
    assert late == VOCAB
    ids = draft_output_ids(tok, VOCAB + 1, 1000)
    assert ids is not None
    assert ids.tolist() == sorted(set(range(1000)) | {late} | set(range(17)))
    assert draft_output_ids(tok, VOCAB + 1, VOCAB + 1) is None
    assert draft_output_ids(tok, VOCAB + 1, 0) is None


def test_a_restricted_head_on_tied_quantized_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled GGUF (its head is its Q8_0 embedding) drafting for itself with a
    head over 8,192 ids: the head keeps those rows of the quantized blocks, the
    embedding keeps every row, and greedy output equals the plain engine's (no prefix
    cache: bf16 prefill of another length could round a near-tie the other way)."""
    llm = LLM(
        speculative_model="smollm2-135m",
        speculative_draft_vocab_size=8192,
        speculative_draft_cost=0.0,
        kv_cache_memory=0.1,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    eng = llm.engine
    assert eng.speculator is not None and eng.draft is not None
    model = eng.draft.runner.model
    assert model.lm_head.out_features == 8192  # SmolLM2's added tokens are ids 0..16
    assert model.embed_tokens.quantized is not None
    assert model.embed_tokens.quantized.shape[0] == VOCAB
    seen = _recording_drafts(llm, monkeypatch)
    prompt = "<|im_start|>user\nCount from 1 to 20.<|im_end|>\n<|im_start|>assistant\n"
    ps = [llm.tokenizer.encode(prompt)]
    with_drafts = token_ids(llm, ps, greedy(32))
    plain = without_speculation(llm, ps, greedy(32))
    assert with_drafts == plain
    assert seen and max(seen) < 8192
    assert llm.stats()["spec_accepted_tokens"] > len(seen) // 2


# ---- the real pair -----------------------------------------------------------------

EDIT_PROMPT = (
    "<|im_start|>user\nRename `total` to `acc`:\n```python\ndef add_all(xs):\n"
    "    total = 0\n    for x in xs:\n        total += x\n    return total\n```<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _installed(alias: str) -> None:
    try:
        resolve_model_path(alias)
    except ModelNotFoundError as exc:
        pytest.skip(f"{alias} is not installed: {exc}")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_pair_greedy_equals_no_speculation(target: str) -> None:
    """fp32, one engine: without speculation first (its speculator set aside), then
    with the 0.5B drafting; no prefix cache, so both runs compute the same way."""
    _installed(target)
    _installed("qwen2.5-coder-0.5b")
    llm = LLM(
        target,
        dtype="float32",
        speculative_model="qwen2.5-coder-0.5b",
        num_speculative_tokens=4,
        speculative_draft_cost=0.0,
        kv_cache_memory=0.25,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    assert llm.engine.speculator is not None
    ref = without_speculation(llm, [EDIT_PROMPT], greedy(24))
    got = token_ids(llm, [EDIT_PROMPT], greedy(24))
    assert got == ref
    stats = llm.stats()
    assert stats["spec_accepted_tokens"] > stats["spec_drafted_tokens"] // 2
    assert_draft_pool_full(llm)
