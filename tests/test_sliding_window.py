"""Sliding-window models with random weights: Gemma 3 (local and global layers) and
Mistral with a window on every layer. sluice's greedy output must equal transformers'
token for token (fp32) on prompts longer than the window, computed in one piece, in
small chunks (chunked prefill), and again after a prefix-cache hit. Gemma 3 runs on a
split KV cache (a local pool for its windowed layers): blocks held, preemption, aborts,
speculative rollback and prefix hits leave both pools whole, and its int8 cache decodes
as the single pool's does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from sluice import LLM, SamplingParams
from sluice.engine.kv_connector.disk_tier import disk_tier
from sluice.engine.prefix_cache import extend_block_hashes
from sluice.loader import tokenizer_from_gguf

WINDOW = 16

COMMON: dict[str, Any] = dict(
    vocab_size=49152,  # the SmolLM2 tokenizer is reused for detokenization
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.3,  # peaky logits: no near-ties for greedy to trip on
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def gemma3() -> Any:
    # Layers 0, 1, 3, 4 local, 2 and 5 global (pattern 3); a score scale and a
    # softcap of their own, and a rope base per layer kind.
    return transformers.Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=6,
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=48,
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
    )


def mistral() -> Any:
    return transformers.MistralConfig(
        **COMMON, num_hidden_layers=3, sliding_window=WINDOW, tie_word_embeddings=False
    )


CONFIGS: dict[str, Callable[[], Any]] = {"gemma3": gemma3, "mistral": mistral}


def build_model(
    kind: str, tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> tuple[str, Path, Any]:
    directory = tmp_path_factory.mktemp(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        if kind == "gemma3":  # norms start at 0 (scale 1): make (1 + weight) matter
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.3)
        # A smaller embedding, so that the token's own embedding does not drown the
        # attention output in the residual stream: without it, Gemma's greedy tokens
        # came out the same with the window switched off, and Mistral never repeated
        # itself (nothing for the speculative test's n-gram proposer to draft).
        model.model.embed_tokens.weight.mul_(0.1)
    model.save_pretrained(directory)
    tokenizer_from_gguf(smollm2_path).save(directory)
    return kind, directory, model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> tuple[str, Path, Any]:
    return build_model(request.param, tmp_path_factory, smollm2_path)


@pytest.fixture(scope="module")
def gemma_dir(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> tuple[str, Path, Any]:
    """Gemma 3 alone: a split KV cache (a local pool for its windowed layers)."""
    return build_model("gemma3", tmp_path_factory, smollm2_path)


def assert_pools_free(engine: Any) -> None:
    """Every block of every pool free again: nothing leaked."""
    for group in engine.kv.groups:
        assert group.pool.num_free == group.pool.num_blocks
        assert not any(group.pool.ref_counts)


def reference(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(ids) :].tolist()


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    # Shorter than the window, a little and much longer (several blocks fall out).
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (7, 23, 61)]


@pytest.mark.parametrize("chunk", [512, 5])  # whole prompts; 5-token chunks
def test_greedy_matches_transformers(model_dir: tuple[str, Path, Any], chunk: int) -> None:
    kind, directory, model = model_dir
    llm = LLM(
        model=str(directory),
        dtype="float32",
        kv_cache_memory=0.02,
        max_num_batched_tokens=chunk,
        block_size=4,
    )
    config = llm.engine.model_config
    assert config.architecture == ("gemma3" if kind == "gemma3" else "llama")
    assert config.sliding_window == WINDOW
    sp = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    batch = prompts()
    outs = llm.generate(batch, sp, use_tqdm=False)
    for ids, out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == reference(model, ids, 40)


def test_prefix_cache_hit_matches_transformers(model_dir: tuple[str, Path, Any]) -> None:
    """A second prompt sharing a long prefix starts from cached blocks, some of them
    outside the window of its first computed token."""
    _, directory, model = model_dir
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory=0.02, block_size=4)
    first = prompts()[2]
    second = [*first[:52], 7, 8, 9, 10, 11]
    sp = SamplingParams(temperature=0, max_tokens=20, min_tokens=20)
    llm.generate([first], sp, use_tqdm=False)
    out = llm.generate([second], sp, use_tqdm=False)[0]
    assert llm.engine.kv.num_hit_tokens >= 48
    assert out.outputs[0].token_ids == reference(model, second, 20)


def test_blocks_held_follow_the_window(model_dir: tuple[str, Path, Any]) -> None:
    """Mistral (every layer windowed) holds only the blocks its window still sees;
    Gemma 3 keeps the whole sequence in its global pool (its global layers read
    everything) and only the window in its local pool."""
    kind, directory, _ = model_dir
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory=0.02, block_size=4)
    engine = llm.engine
    engine.add_request("long", prompts()[2], SamplingParams(temperature=0, max_tokens=60))
    most = [0, 0]  # blocks held in each group while decoding (the prompt is one chunk)
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            if req.num_computed_tokens > 61:
                for group in range(len(engine.kv.groups)):
                    most[group] = max(most[group], engine.kv.num_held_blocks(req, group))
    # The window's 16 positions span at most 5 blocks, plus one being filled.
    if kind == "mistral":
        assert engine.kv.window == WINDOW and engine.kv.local_pool is None and most[0] <= 6
    else:
        assert engine.kv.window is None and most[0] >= (61 + 59) // 4
        assert engine.kv.local_pool is not None and 0 < most[1] <= 6
    assert_pools_free(engine)


def test_speculative_decoding_matches_transformers(
    model_dir: tuple[str, Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verifying drafts (several queries a sequence in the paged kernel, each with its
    own window) and rolling back rejected ones, with blocks released behind the window.
    The drafts are transformers' own next tokens with the last one wrong, so every
    verification accepts some and rejects one (a random model gives an n-gram
    proposer nothing to draft)."""
    _, directory, model = model_dir
    llm = LLM(
        model=str(directory),
        dtype="float32",
        kv_cache_memory=0.02,
        block_size=4,
        speculative_method="ngram",
        num_speculative_tokens=4,
        # Verify every draft: step costs measured on a busy machine can make one draft a
        # step the best plan, and a one-token draft here is always the wrong last one.
        speculative_draft_cost=0.0,
    )
    ids = prompts()[2]
    ref = reference(model, ids, 60)

    def propose(requests: list[Any], num_tokens: list[int]) -> list[list[int]]:
        drafts = []
        for req, k in zip(requests, num_tokens, strict=True):
            done = req.num_output_tokens
            run = ref[done : done + k]
            drafts.append([*run[:-1], (run[-1] + 1) % 49152] if run else [])
        return drafts

    assert llm.engine.speculator is not None
    monkeypatch.setattr(llm.engine.speculator.proposer, "propose", propose)
    sp = SamplingParams(temperature=0, max_tokens=60, min_tokens=60)
    out = llm.generate([ids], sp, use_tqdm=False)[0]
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    assert out.outputs[0].token_ids == ref
    assert_pools_free(llm.engine)  # rolled-back drafts' blocks went back to both pools


def test_split_pool_prefix_hit_with_the_local_prefix_evicted(
    gemma_dir: tuple[str, Path, Any],
) -> None:
    """Gemma 3's split cache, prefilling in 5-token chunks. The global pool could serve
    52 tokens of a second prompt, but the local pool lost blocks 0-5 and block 12: the
    longest hit whose window is whole locally is 48 tokens (position 48 reads blocks
    8-11 locally). Greedy output equals transformers', also for a sequence forked
    from it."""
    _, directory, model = gemma_dir
    llm = LLM(
        model=str(directory),
        dtype="float32",
        kv_cache_memory=0.02,
        block_size=4,
        max_num_batched_tokens=5,
    )
    kv = llm.engine.kv
    assert kv.local_pool is not None
    first = prompts()[2]
    second = [*first[:52], 7, 8, 9, 10, 11]
    sp = SamplingParams(temperature=0, max_tokens=20, min_tokens=20)
    llm.generate([first], sp, use_tqdm=False)
    local = kv.local_pool
    hashes = extend_block_hashes([], first, 52, 4, kv.hash_root)  # blocks 0-12
    lost = [local.lookup(h) for h in [*hashes[:6], hashes[12]]]
    assert None not in lost
    local.uncache([b for b in lost if b is not None])
    # Two sequences: the second forks from the first after the prompt and copies the
    # shared partial block in each pool before writing to it.
    two = SamplingParams(n=2, temperature=0, max_tokens=20, min_tokens=20)
    out = llm.generate([second], two, use_tqdm=False)[0]
    assert kv.num_hit_tokens == 48
    ref = reference(model, second, 20)
    assert [c.token_ids for c in out.outputs] == [ref, ref]
    assert_pools_free(llm.engine)


def test_split_pool_preemption_and_abort_free_both_pools(gemma_dir: tuple[str, Path, Any]) -> None:
    """A cache too small for three sequences at once: requests are preempted (by either
    pool running out) and recomputed, and the output still equals transformers'. The
    pools are sized by the rule in engine._split_kv_blocks, and only the global one caps
    max_model_len."""
    _, directory, model = gemma_dir
    llm = LLM(
        model=str(directory),
        dtype="float32",
        kv_cache_memory=0.0002,  # 214748 bytes
        block_size=4,
        max_num_batched_tokens=16,
    )
    engine = llm.engine
    # Blocks of 4 tokens: 4096 bytes over the 2 global layers, 8192 over the 4 local
    # ones. By share of 512 vs 16 + 16 positions the local pool would get 2 blocks; it
    # gets the floor of one window plus a chunk: 8 + 2 blocks. The rest is global.
    assert engine.kv.local_pool is not None and engine.kv.local_pool.num_blocks == 10
    assert engine.kv.pool.num_blocks == (214748 - 10 * 8192) // 4096 == 32
    assert engine.max_model_len == 32 * 4
    stats = engine.stats()
    assert (stats["kv_total_blocks"], stats["kv_local_total_blocks"]) == (32, 10)
    batch = prompts()
    sp = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    outs = llm.generate(batch, sp, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    for ids, out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == reference(model, ids, 40)
    assert_pools_free(engine)
    engine.add_request("gone", batch[2], sp)
    for _ in range(6):  # into decoding, blocks released behind the window
        engine.step()
    assert engine.abort_request("gone")
    assert_pools_free(engine)


def test_split_pool_int8_equals_one_pool(gemma_dir: tuple[str, Path, Any], tmp_path: Path) -> None:
    """The int8 KV cache in both pools (a full-precision layer beside int8 ones in the
    global pool): greedy tokens equal the single pool's, which split_kv_pool=False
    keeps, as does a KV connector (the disk tier moves one pool's blocks)."""
    _, directory, _ = gemma_dir
    options: dict[str, Any] = dict(
        model=str(directory),
        dtype="float32",
        kv_cache_memory=0.02,
        block_size=4,
        max_num_batched_tokens=5,
        kv_cache_dtype="int8",
        kv_cache_skip_layers=(2,),
    )
    split, single = LLM(**options), LLM(**options, split_kv_pool=False)
    assert split.engine.runner.kv_pool_groups == [0, 0, 1]  # global fp32 and int8, local
    assert single.engine.kv.local_pool is None and single.engine.runner.kv_pool_groups == [0, 0]
    sp = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    batch = prompts()
    for a, b in zip(
        split.generate(batch, sp, use_tqdm=False),
        single.generate(batch, sp, use_tqdm=False),
        strict=True,
    ):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_pools_free(split.engine)
    tiered = LLM(model=str(directory), kv_cache_memory=0.02, kv_offload_dir=str(tmp_path))
    assert tiered.engine.kv.local_pool is None
    tiered.shutdown()
    # A connector attached later cannot change the pools: a clear error, nothing attached.
    one = single.engine
    tier = disk_tier(tmp_path / "late", 2**20, one.kv_block_format(), one.runner)
    with pytest.raises(ValueError, match="connector"):
        split.engine.attach_kv_connector(tier)
    assert split.engine.kv_connector is None
